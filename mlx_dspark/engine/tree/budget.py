"""How many tree nodes a round verifies (issue 37): a fixed budget, or `auto`, chosen from this machine's costs.

One policy object per generation, asked three things by the tree round (tree_steps.py):
`grow_nodes(position=, depth=)` before drafting (0: no draft, the round verifies its anchor alone: parked),
`pick(tree, position=)` the node rows of the grown tree to verify, and `observe(tree, verified=, path=, ms=)`
after the round's host read (`ms`: the round's time, start to host read).

Every grown tree holds the draft's top chain as deep as the round goes in its first rows (engine/tree/grow.py),
so a tree never accepts less than the chain it contains. `AutoTree` grows the tree of `cap` nodes (or, while
the chain is what pays, the chain alone: growing and reading a wide tree costs the host time too) and
verifies, per round, the candidate of the highest expected tokens per millisecond: the top chain's first l
nodes (the chain a chain round verifies, l = 1 .. the depth) or the tree's first b rows (the whole chain and
the best b - depth other nodes), each costing the draft block and a verify forward of 1 + its nodes on the
cost curve at the context depth reached (a tree: plus what growing and reading it cost beyond the chain
alone in this generation's rounds, where the curve is this machine's), against one plain step per token. Its expected accepted tokens are what the rounds showed: a
verified set holds every smaller candidate nested in it (a row's children are tried in row order, so
dropping later rows or later siblings changes nothing before them), and the path accepted there says what
each would have accepted (the path's rows up to b; the path's agreement with the top chain up to l): a
moving average per chain length, and per tree size of what it accepted beyond the chain's nodes among its
rows (a difference read off the same rounds: a tree is not picked on a stale lucky mean). A candidate not observed yet counts what the draft itself expects (its path
probabilities). Every `explore_every` rounds (and the first) the whole tree is verified, so every candidate
stays observed; while those looks keep finding the chain better, they come half as often (down to one in
`max_explore_every`). Where no candidate beats a plain step the policy parks: `park_rounds` rounds without a
draft, then a look at the whole tree again (backing off while the looks lose).

Lossless whatever it picks: the choice reads draft values and past rounds only, never this round's target.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from mlx_dspark.engine.costs import heal as cost_heal
from mlx_dspark.engine.costs.curve import CostCurve
from mlx_dspark.engine.costs.heal import CurveHealer
from mlx_dspark.engine.tree.grow import Tree


PRIOR_ROUNDS = 2  # the draft's estimate of a tree's gain weighs as much as this many observed rounds


class TreeBudget(Protocol):
    def grow_nodes(self, *, position: int, depth: int | None = None) -> int:
        """Nodes to grow for the round whose anchor sits at `position`, `depth` deep (0: no draft this round)."""

    def pick(self, tree: Tree, *, position: int) -> list[int]:
        """The rows (ascending, 1-based, prefix-closed) of the grown `tree` this round verifies."""

    def observe(self, tree: Tree, *, verified: list[int], path: list[int], ms: float | None = None) -> None:
        """The round verified `verified` rows of `tree` and accepted the node rows `path` (in `tree`'s rows),
        in `ms` milliseconds (None: not timed)."""


class FixedTree:
    """Every round grows and verifies a tree of `nodes` nodes (`tree_nodes` N)."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.sizes: Counter[int] = Counter()  # verified nodes per round -> rounds

    def grow_nodes(self, *, position: int, depth: int | None = None) -> int:
        return self.nodes

    def pick(self, tree: Tree, *, position: int) -> list[int]:
        return list(range(1, tree.size + 1))

    def observe(self, tree: Tree, *, verified: list[int], path: list[int], ms: float | None = None) -> None:
        self.sizes[len(verified)] += 1

    def summary(self) -> dict:
        return {"sizes": dict(sorted(self.sizes.items()))}


class AutoTree:
    """Per round the chain or tree candidate of the highest expected tokens per ms; parked where none pays."""

    def __init__(
        self, curve: CostCurve, cap: int, *, smoothing: float = 0.2, margin: float = 0.05, explore_every: int = 8,
        park_rounds: int = 8, max_park_rounds: int = 128, max_explore_every: int = 64, heal: bool | None = None,
    ) -> None:  # fmt: skip
        self.cap = min(cap, curve.max_width - 1)
        if self.cap < 1:
            raise ValueError(f"cost curve {curve.source} covers verify width 1 only: tree_nodes 'auto' needs widths 1..{cap + 1}")
        self.base_curve, self.smoothing, self.margin, self.explore_every = curve, smoothing, margin, explore_every
        self.park_rounds, self.max_park_rounds, self.max_explore_every = park_rounds, max_park_rounds, max_explore_every
        # learn what rounds cost beyond `curve`: by default where it is this machine's (from the cost cache), not a given one
        self.heal = cost_heal.ENABLED and curve.cache_path is not None if heal is None else heal
        # the curve as this generation's own round times correct it (a curve measured under load heals, as
        # draft_length.AutoLength's does: a noisy first-use curve would otherwise keep the draft parked)
        self.healer = CurveHealer(curve) if self.heal else None
        # b -> mean of what the tree's first b rows accepted beyond the top chain's nodes among them (nested in
        # the same rounds: a difference of low variance, so a tree is not picked on a stale lucky mean)
        self.tree_gain: dict[int, float] = {}
        self.chain_accepted: dict[int, float] = {}  # l -> mean accepted by the top chain's first l nodes
        # "chain" / "tree" -> mean ms a round grown that way took beyond the curve's draft block and verify (heal)
        self.overhead_ms: dict[str, float] = {}
        self._samples: Counter[tuple[int, int]] = Counter()  # (table, key) -> rounds observed
        self._until_explore = 0  # the first round looks at the whole tree
        self._explore_interval = explore_every
        self._look = False  # this round verifies everything it grew (the whole tree, or the chain alone)
        # rounds until a look grows the whole tree again while chains win: growing and reading a wide tree costs
        # the host more than its verify (measured: ~80 ms for 32 nodes of the demo pair), so a chain-winning
        # generation looks at the chain alone and at the tree only every `max_explore_every` rounds
        self._until_tree_look = 0
        self._trees = True  # the last decision was a tree: grow the whole tree (else the chain alone)
        self._grown = "tree"  # how this round was grown
        self._position = 0
        self._parked_for = 0  # rounds left without a draft
        self._park_interval = park_rounds
        self.choices: Counter[str] = Counter()  # "chain-l" / "tree-b" / "look" (the whole tree) / "parked" -> rounds

    @property
    def curve(self) -> CostCurve:
        return self.base_curve if self.healer is None else self.healer.curve

    def grow_nodes(self, *, position: int, depth: int | None = None) -> int:
        self._position = position
        if self._parked_for > 0:
            self._parked_for -= 1
            self.choices["parked"] += 1
            return 0
        self._until_explore -= 1
        self._look = self._until_explore < 0
        if self._look:
            self._until_explore = self._explore_interval - 1
        self._until_tree_look -= 1
        tree_look = self._look and (self._trees or self._until_tree_look < 0)
        if tree_look:
            self._until_tree_look = self.max_explore_every
        chain_only = not (tree_look or self._trees) and depth is not None
        self._grown = "chain" if chain_only else "tree"
        return min(depth, self.cap) if chain_only else self.cap

    def pick(self, tree: Tree, *, position: int) -> list[int]:
        everything = list(range(1, tree.size + 1))
        name, rows, rate = self.best(tree, curve=self.curve.at(position))
        if self._look:
            self.choices["look"] += 1  # the whole tree; what the estimates say decides the rounds until the next look
            self._trees = name.startswith("tree")
            seen = self._samples[id(self.tree_gain), tree.size] * self.smoothing >= 1  # the tree's gain is a mean, not a guess
            self._explore_interval = self.explore_every if self._trees or not seen else min(2 * self._explore_interval, self.max_explore_every)
            return everything
        if rate <= 1.0 / max(self.curve.at(position).verify_ms[0], 1e-9):  # nothing beats a plain step: park
            self._parked_for = self._park_interval
            self._park_interval = min(2 * self._park_interval, self.max_park_rounds)
            self._until_explore = 0  # the round after the park looks at the whole tree again
            self.choices["parked"] += 1
            return []
        self._park_interval = self.park_rounds
        self._trees = name.startswith("tree")
        self.choices[name] += 1
        return rows

    def best(self, tree: Tree, *, curve: CostCurve) -> tuple[str, list[int], float]:
        """The candidate of the highest expected tokens per ms: (name, its rows, the rate). A tree must beat
        the best chain by `margin` (its estimate is read off fewer rounds when chains are picked)."""
        chain = tree.top_chain()
        chains, trees = [("parked", [], 0.0)], [("parked", [], 0.0)]
        chain_probs = [tree.path_probs[row - 1] for row in chain]
        # what growing and reading the whole tree costs beyond growing the chain alone (the rounds' own times)
        tree_ms = max(0.0, self.overhead_ms.get("tree", 0.0) - self.overhead_ms.get("chain", 0.0))
        for b in range(len(chain) + 1, min(tree.size, self.cap) + 1):  # the whole chain and b - len(chain) others
            inside = sum(1 for row in chain if row <= b)
            chain_part = self.chain_accepted.get(inside, sum(chain_probs[:inside])) if inside else 0.0
            expected = chain_part + self._gain(b, prior=sum(tree.path_probs[:b]) - sum(chain_probs[:inside]))
            trees.append((f"tree-{b}", list(range(1, b + 1)), (1 + expected) / max(curve.round_ms(b) + tree_ms, 1e-9)))
        for length in range(1, min(len(chain), self.cap) + 1):
            expected = self.chain_accepted.get(length, sum(tree.path_probs[row - 1] for row in chain[:length]))
            chains.append((f"chain-{length}", chain[:length], (1 + expected) / max(curve.round_ms(length), 1e-9)))
        best_chain, best_tree = (max(c, key=lambda c: c[2]) for c in (chains, trees))
        return best_tree if best_tree[2] > best_chain[2] * (1 + self.margin) else best_chain

    def observe(self, tree: Tree, *, verified: list[int], path: list[int], ms: float | None = None) -> None:
        if ms is not None and self.healer is not None and (not verified or self._grown == "chain"):
            # a parked round is a plain step (it scales the verify times); a chain round's time is the curve's
            # draft block and verify (a tree's growth beyond the chain is `overhead_ms`, not the draft block)
            self.healer.observe(proposed=len(verified), ms=ms)
        if not verified:
            return
        if ms is not None and self.heal:  # what growing and reading this kind of round costs beyond the curve
            extra = ms - self.curve.at(self._position).round_ms(len(verified))
            self._update(self.overhead_ms, self._grown, extra)
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

    def _gain(self, b: int, *, prior: float) -> float:
        """What the tree's first b rows accept beyond the chain: the rounds' mean, drawn toward the draft's own
        estimate `prior` while few rounds (whole-tree looks, mostly) have shown it."""
        seen = min(self._samples[id(self.tree_gain), b], 1.0 / self.smoothing)
        return (seen * self.tree_gain.get(b, 0.0) + PRIOR_ROUNDS * prior) / (seen + PRIOR_ROUNDS)

    def _update(self, table: dict, key: int | str, value: float) -> None:
        """The mean of the first 1 / smoothing samples (one unlucky round does not park a good draft), then a
        moving average."""
        count = self._samples[id(table), key] = self._samples[id(table), key] + 1
        old = table.get(key, 0.0)
        table[key] = old + max(self.smoothing, 1.0 / count) * (value - old)

    def summary(self) -> dict:
        return {"choices": dict(sorted(self.choices.items())),
                "overhead_ms": {kind: round(ms, 3) for kind, ms in sorted(self.overhead_ms.items())}}
