"""A small inventory store: items, stock levels, and reports (a benchmark workload, not package code)."""

import json
from dataclasses import dataclass, field


class InventoryError(Exception):
    """Raised when a request cannot be served from the stock."""


@dataclass
class Item:
    sku: str
    name: str
    price: float
    quantity: int = 0
    tags: list = field(default_factory=list)

    def total_value(self):
        return self.price * self.quantity

    def to_dict(self):
        return {
            "sku": self.sku,
            "name": self.name,
            "price": self.price,
            "quantity": self.quantity,
            "tags": list(self.tags),
        }

    @classmethod
    def from_dict(cls, data):
        return cls(
            sku=data["sku"],
            name=data["name"],
            price=float(data["price"]),
            quantity=int(data.get("quantity", 0)),
            tags=list(data.get("tags", [])),
        )


class Inventory:
    def __init__(self, items=None):
        self.items = {}
        for item in items or []:
            self.add_item(item)

    def add_item(self, item):
        if item.sku in self.items:
            raise InventoryError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item
        return item

    def remove_item(self, sku):
        if sku not in self.items:
            raise InventoryError(f"unknown sku {sku}")
        return self.items.pop(sku)

    def get(self, sku):
        try:
            return self.items[sku]
        except KeyError:
            raise InventoryError(f"unknown sku {sku}") from None

    def restock(self, sku, amount):
        if amount <= 0:
            raise InventoryError(f"restock amount must be positive, got {amount}")
        item = self.get(sku)
        item.quantity += amount
        return item.quantity

    def take(self, sku, amount):
        item = self.get(sku)
        if amount > item.quantity:
            raise InventoryError(f"only {item.quantity} of {sku} left, asked for {amount}")
        item.quantity -= amount
        return item.quantity

    def find(self, tag=None, max_price=None):
        found = []
        for item in self.items.values():
            if tag is not None and tag not in item.tags:
                continue
            if max_price is not None and item.price > max_price:
                continue
            found.append(item)
        return sorted(found, key=lambda item: item.sku)

    def low_stock(self, threshold=5):
        return [item for item in self.items.values() if item.quantity < threshold]

    def total_value(self):
        return sum(item.total_value() for item in self.items.values())

    def report(self):
        lines = []
        for item in sorted(self.items.values(), key=lambda item: item.name):
            lines.append(f"{item.sku:10} {item.name:24} {item.quantity:6} {item.price:10.2f}")
        lines.append(f"{'total':10} {'':24} {'':6} {self.total_value():10.2f}")
        return "\n".join(lines)

    def to_json(self):
        return json.dumps([item.to_dict() for item in self.items.values()], indent=2)

    @classmethod
    def from_json(cls, text):
        return cls(Item.from_dict(data) for data in json.loads(text))


def load_inventory(path):
    with open(path, encoding="utf-8") as handle:
        return Inventory.from_json(handle.read())


def save_inventory(inventory, path):
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(inventory.to_json())


def merge_inventories(first, second):
    merged = Inventory()
    for inventory in (first, second):
        for item in inventory.items.values():
            if item.sku in merged.items:
                merged.items[item.sku].quantity += item.quantity
            else:
                merged.add_item(Item.from_dict(item.to_dict()))
    return merged


def transfer(source, target, sku, amount):
    source.take(sku, amount)
    if sku not in target.items:
        item = source.get(sku)
        target.add_item(Item(item.sku, item.name, item.price, 0, list(item.tags)))
    return target.restock(sku, amount)


def main():
    inventory = Inventory(
        [
            Item("A-100", "hex bolt", 0.25, 400, ["hardware"]),
            Item("A-101", "wing nut", 0.15, 3, ["hardware"]),
            Item("B-200", "cordless drill", 89.0, 7, ["tools", "power"]),
            Item("B-201", "hand saw", 21.5, 2, ["tools"]),
        ]
    )
    inventory.restock("A-101", 50)
    inventory.take("B-200", 2)
    print(inventory.report())
    for item in inventory.low_stock():
        print(f"low stock: {item.sku} {item.name} ({item.quantity})")


if __name__ == "__main__":
    main()
