"""How many tree nodes a round verifies (issue 37): a fixed budget, or `auto`, chosen from this machine's costs.

One policy object per generation, asked three things by the tree round (tree_steps.py):
`grow_nodes(position=)` before drafting (0: no draft, the round verifies its anchor alone: parked),
`pick(tree, position=)` the node rows of the grown tree to verify, and `observe(tree, verified=, path=)`
after the round's host read.

`AutoTree` grows the best-first tree of `cap` nodes, and the draft's top chain beside it, and verifies, per
round, the candidate of the highest expected tokens per millisecond: the top chain's first l nodes (the
chain a chain round verifies, l = 1 .. the depth) or the tree's first b rows (the best b-node tree, b = 1 ..
cap), each costing the draft block and a verify forward of 1 + its nodes on the cost curve at the context
depth reached, against one plain step per token. Its expected accepted tokens are what the rounds showed: a
verified set holds every smaller candidate nested in it (a row's children are tried in row order, so
dropping later rows or later siblings changes nothing before them), and the path accepted there says what
each would have accepted (the path's rows up to b; the path's agreement with the top chain up to l): a
moving average per chain length, and per tree size of what it accepted beyond the chain's nodes among its
rows (a difference read off the same rounds: a tree is not picked on a stale lucky mean). A candidate not observed yet counts what the draft itself expects (its path
probabilities). Every `explore_every` rounds (and the first) the whole tree is verified, so every candidate
stays observed. Where no candidate beats a plain step the policy parks: `park_rounds` rounds without a
draft, then a look at the whole tree again (backing off while the looks lose).

Lossless whatever it picks: the choice reads draft values and past rounds only, never this round's target.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from mlx_dspark.engine.costs.curve import CostCurve
from mlx_dspark.engine.tree.grow import Tree


class TreeBudget(Protocol):
    def grow_nodes(self, *, position: int) -> int:
        """Nodes to grow for the round whose anchor sits at `position` (0: no draft this round)."""

    def pick(self, tree: Tree, *, position: int) -> list[int]:
        """The rows (ascending, 1-based, prefix-closed) of the grown `tree` this round verifies."""

    def observe(self, tree: Tree, *, verified: list[int], path: list[int]) -> None:
        """The round verified `verified` rows of `tree` and accepted the node rows `path` (in `tree`'s rows)."""


class FixedTree:
    """Every round grows and verifies a tree of `nodes` nodes (`tree_nodes` N)."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.sizes: Counter[int] = Counter()  # verified nodes per round -> rounds

    def grow_nodes(self, *, position: int) -> int:
        return self.nodes

    def pick(self, tree: Tree, *, position: int) -> list[int]:
        return list(range(1, tree.size + 1))

    def observe(self, tree: Tree, *, verified: list[int], path: list[int]) -> None:
        self.sizes[len(verified)] += 1

    def summary(self) -> dict:
        return {"sizes": dict(sorted(self.sizes.items()))}


class AutoTree:
    """Per round the chain or tree candidate of the highest expected tokens per ms; parked where none pays."""

    wants_chain = True  # the round grows the top chain as deep as it goes beside the best `cap` nodes (tree.with_chain)

    def __init__(
        self, curve: CostCurve, cap: int, *, smoothing: float = 0.2, margin: float = 0.05, explore_every: int = 8,
        park_rounds: int = 8, max_park_rounds: int = 128,
    ) -> None:  # fmt: skip
        self.cap = min(cap, curve.max_width - 1)
        if self.cap < 1:
            raise ValueError(f"cost curve {curve.source} covers verify width 1 only: tree_nodes 'auto' needs widths 1..{cap + 1}")
        self.curve, self.smoothing, self.margin, self.explore_every = curve, smoothing, margin, explore_every
        self.park_rounds, self.max_park_rounds = park_rounds, max_park_rounds
        # b -> mean of what the tree's first b rows accepted beyond the top chain's nodes among them (nested in
        # the same rounds: a difference of low variance, so a tree is not picked on a stale lucky mean)
        self.tree_gain: dict[int, float] = {}
        self.chain_accepted: dict[int, float] = {}  # l -> mean accepted by the top chain's first l nodes
        self._samples: Counter[tuple[int, int]] = Counter()  # (table, key) -> rounds observed
        self._until_explore = 0  # the first round looks at the whole tree
        self._parked_for = 0  # rounds left without a draft
        self._park_interval = park_rounds
        self.choices: Counter[str] = Counter()  # "chain-l" / "tree-b" / "look" (the whole tree) / "parked" -> rounds

    def grow_nodes(self, *, position: int) -> int:
        if self._parked_for > 0:
            self._parked_for -= 1
            self.choices["parked"] += 1
            return 0
        return self.cap

    def pick(self, tree: Tree, *, position: int) -> list[int]:
        everything = list(range(1, tree.size + 1))
        self._until_explore -= 1
        if self._until_explore < 0:
            self._until_explore = self.explore_every - 1
            self.choices["look"] += 1  # the whole tree
            return everything
        name, rows, rate = self.best(tree, curve=self.curve.at(position))
        if rate <= 1.0 / max(self.curve.at(position).verify_ms[0], 1e-9):  # nothing beats a plain step: park
            self._parked_for = self._park_interval
            self._park_interval = min(2 * self._park_interval, self.max_park_rounds)
            self._until_explore = 0  # the round after the park looks at the whole tree again
            self.choices["parked"] += 1
            return []
        self._park_interval = self.park_rounds
        self.choices[name] += 1
        return rows

    def best(self, tree: Tree, *, curve: CostCurve) -> tuple[str, list[int], float]:
        """The candidate of the highest expected tokens per ms: (name, its rows, the rate). A tree must beat
        the best chain by `margin` (its estimate is read off fewer rounds when chains are picked)."""
        chain = tree.top_chain()
        chains, trees = [("parked", [], 0.0)], [("parked", [], 0.0)]
        chain_probs = [tree.path_probs[row - 1] for row in chain]
        for b in range(1, min(tree.size, self.cap) + 1):
            inside = sum(1 for row in chain if row <= b)  # the top chain's first nodes are among the first b rows
            chain_part = self.chain_accepted.get(inside, sum(chain_probs[:inside])) if inside else 0.0
            expected = chain_part + self.tree_gain.get(b, sum(tree.path_probs[:b]) - sum(chain_probs[:inside]))
            trees.append((f"tree-{b}", list(range(1, b + 1)), (1 + expected) / max(curve.round_ms(b), 1e-9)))
        for length in range(1, min(len(chain), self.cap) + 1):
            expected = self.chain_accepted.get(length, sum(tree.path_probs[row - 1] for row in chain[:length]))
            chains.append((f"chain-{length}", chain[:length], (1 + expected) / max(curve.round_ms(length), 1e-9)))
        best_chain, best_tree = (max(c, key=lambda c: c[2]) for c in (chains, trees))
        return best_tree if best_tree[2] > best_chain[2] * (1 + self.margin) else best_chain

    def observe(self, tree: Tree, *, verified: list[int], path: list[int]) -> None:
        if not verified:
            return
        held = set(verified)
        prefix = next((b for b in range(len(verified), 0, -1) if all(r in held for r in range(1, b + 1))), 0)
        chain = tree.top_chain()
        on_chain = next((k for k, (a, c) in enumerate(zip(path, chain)) if a != c), min(len(path), len(chain)))
        for b in range(1, prefix + 1):  # the tree's first b rows: the path's rows among them, less the chain's part
            inside = sum(1 for row in chain if row <= b)
            self._update(self.tree_gain, b, sum(1 for row in path if row <= b) - min(on_chain, inside))
        for length in range(1, len(chain) + 1):
            if chain[length - 1] not in held:
                break
            self._update(self.chain_accepted, length, min(on_chain, length))

    def _update(self, table: dict[int, float], key: int, value: float) -> None:
        """The mean of the first 1 / smoothing samples (one unlucky round does not park a good draft), then a
        moving average."""
        count = self._samples[id(table), key] = self._samples[id(table), key] + 1
        old = table.get(key, 0.0)
        table[key] = old + max(self.smoothing, 1.0 / count) * (value - old)

    def summary(self) -> dict:
        return {"choices": dict(sorted(self.choices.items()))}
