"""How many tree nodes a round verifies (issue 37): a fixed budget, or `auto`, chosen from this machine's costs.

One policy object per generation, asked by the tree round (engine/tree/rounds.py): `grow_nodes(position=,
depth=)` before drafting (0: no draft: parked, plain decoding's own pipelined steps run until it drafts again,
asking `length_policy`), then either a chain round (`chain_round`: the chain round's own propose and verify,
no tree growth, reported by `observe_chain`) or a tree round: `pick(tree, position=)` the node rows of the
grown tree to verify, `observe(tree, verified=, path=, ms=)` after the round's host read.

Every grown tree holds the draft's top chain as deep as the round goes in its first rows (engine/tree/grow.py),
so a tree never accepts less than the chain it contains. `AutoTree` is the chain rounds' own length policy
(policy/draft_length.AutoLength: how long a chain, or parked) plus trees where they have shown they pay
(issue 52: on a machine where a tree never pays, `auto` runs the chain's rounds, not tree rounds that verify a
chain): now and then a look grows and verifies a whole tree of `look_nodes` (every `explore_every` drafted
rounds, half as often after each look that finds the chain better, down to one in `max_explore_every`, and
never while even a tree accepting every node could not beat the chain at the costs seen); while a look finds
a tree better by `margin`, every round grows the tree and verifies the candidate of the highest expected tokens
per millisecond: the top chain's first l nodes or the tree's first b rows (the whole chain and the best b - depth
other nodes), each costing the curve's round of its nodes at the context depth reached (a tree: plus what
growing and reading it cost beyond a chain round, the rounds' own times). Expected accepted tokens are what
the rounds showed: a verified set holds every smaller candidate nested in it (a row's children are tried in row
order), so the path accepted there says what each would have accepted: a moving average per chain length, and
per tree size of what it accepted beyond the chain's nodes among its rows (a difference read off the same
rounds); a candidate not observed yet counts the draft's own path probabilities.

Lossless whatever it picks: the choice reads draft values and past rounds only, never this round's target.
"""

from __future__ import annotations

from collections import Counter

from mlx_dspark.engine.costs import heal as cost_heal
from mlx_dspark.engine.costs.curve import CostCurve
from mlx_dspark.engine.policy.draft_length import AutoLength, DraftLength
from mlx_dspark.engine.tree.grow import Tree


PRIOR_ROUNDS = 2  # the draft's estimate of a tree's gain weighs as much as this many observed rounds
LOOK_NODES = 16  # a look's tree: the chain as deep as the round goes and the best others (15 nodes pay most where trees pay)


class TreeBudget:
    """What the tree round asks of a node budget; a budget overrides what it uses."""

    chain_round = False  # the round `grow_nodes` just sized verifies the chain alone, through the chain round
    length_policy: DraftLength | None = None  # what parked steps ask and tell (None: the budget never parks)

    def grow_nodes(self, *, position: int, depth: int | None = None) -> int:
        """Nodes to grow for the round whose anchor sits at `position`, `depth` deep (0: no draft this round)."""
        raise NotImplementedError

    def pick(self, tree: Tree, *, position: int) -> list[int]:
        """The rows (ascending, 1-based, prefix-closed) of the grown `tree` this round verifies."""
        return list(range(1, tree.size + 1))

    def observe(self, tree: Tree, *, verified: list[int], path: list[int], ms: float | None = None) -> None:
        """The round verified `verified` rows of `tree` and accepted the node rows `path` (in `tree`'s rows),
        in `ms` milliseconds (None: not timed)."""

    def observe_chain(self, *, proposed: int, accepted: int, ms: float | None = None) -> None:
        """A chain round verified `proposed` drafts and accepted `accepted`, in `ms` milliseconds."""


class FixedTree(TreeBudget):
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

    def observe_chain(self, *, proposed: int, accepted: int, ms: float | None = None) -> None:
        self.sizes[proposed] += 1

    def summary(self) -> dict:
        return {"sizes": dict(sorted(self.sizes.items()))}


class AutoTree(TreeBudget):
    """The chain rounds' length policy, with a tree instead of the chain where looks show a tree pays."""

    def __init__(
        self, curve: CostCurve, cap: int, *, depth: int | None = None, chain: DraftLength | None = None,
        smoothing: float = 0.2, margin: float = 0.05, explore_every: int = 8, max_explore_every: int = 64,
        look_nodes: int = LOOK_NODES, heal: bool | None = None,
    ) -> None:  # fmt: skip
        self.cap = min(cap, curve.max_width - 1)
        if self.cap < 1:
            raise ValueError(f"cost curve {curve.source} covers verify width 1 only: tree_nodes 'auto' needs widths 1..{cap + 1}")
        depth = self.cap if depth is None else max(1, min(depth, self.cap))
        # heal by the rounds' times where the curve is this machine's (from the cost cache), not a given one
        heal = cost_heal.ENABLED and curve.cache_path is not None if heal is None else heal
        # chain or parked, and how long a chain: the chain rounds' own policy (its healed curve, its memory)
        self.chain = AutoLength(curve, depth, heal=heal) if chain is None else chain
        self.heal = heal  # a given curve (a file, a test) is taken as given: no overhead beyond it is learned
        self.length_policy = self.chain
        self.base_curve, self.smoothing, self.margin = curve, smoothing, margin
        self.look_nodes = max(1, min(look_nodes, self.cap))
        self.explore_every, self.max_explore_every = explore_every, max_explore_every
        # b -> mean of what the tree's first b rows accepted beyond the top chain's nodes among them (nested in
        # the same rounds: a difference of low variance, so a tree is not picked on a stale lucky mean)
        self.tree_gain: dict[int, float] = {}
        self.chain_accepted: dict[int, float] = {}  # l -> mean accepted by the top chain's first l nodes
        # "chain" / "tree" -> mean ms a round of that kind took beyond the curve's draft block and verify
        self.overhead_ms: dict[str, float] = {}
        self._samples: Counter[tuple[int, int | str]] = Counter()  # (table, key) -> rounds observed
        self._look_interval = explore_every
        self._until_look = 1  # rounds until the next look: the first round looks
        self._trees = False  # the last look found a tree better: every round grows the tree
        self._kind = "chain"  # this round: "chain" / "look" / "tree" / "parked"
        self._length = 0  # the chain policy's length for this round
        self._position = 0
        self.chain_round = True
        self.choices: Counter[str] = Counter()  # "chain-l" / "tree-b" / "look" (the whole tree) / "parked" -> rounds

    @property
    def curve(self) -> CostCurve:
        return self.chain.curve or self.base_curve

    def grow_nodes(self, *, position: int, depth: int | None = None) -> int:
        depth = self.cap if depth is None else depth
        self._position = position
        self._length = length = min(self.chain.next_length(position=position), depth)
        self._until_look -= 1  # parked rounds count too: a tree may pay where no chain does
        look = self._until_look <= 0 and depth > 0 and self._worth_a_look(position, depth)
        if look:
            self._until_look = self._look_interval
        self._kind = "look" if look else "tree" if self._trees and depth else "chain" if length else "parked"
        self.chain_round = self._kind in ("chain", "parked")
        if self._kind == "parked":
            self.choices["parked"] += 1
        return length if self.chain_round else self._tree_nodes(depth)

    def pick(self, tree: Tree, *, position: int) -> list[int]:
        if self._kind == "look":
            self.choices["look"] += 1
            return list(range(1, tree.size + 1))
        name, rows, _ = self.best(tree, curve=self.curve.at(position))
        self.choices[name] += 1
        self._trees = name.startswith("tree")  # a chain picked from a grown tree: chain rounds again
        return rows

    def best(self, tree: Tree, *, curve: CostCurve) -> tuple[str, list[int], float]:
        """The candidate of the highest expected tokens per ms: (name, its rows, the rate). A tree must beat
        the chain the chain policy asked by `margin` (its estimate is read off fewer rounds)."""
        chain = tree.top_chain()
        chain_probs = [tree.path_probs[row - 1] for row in chain]
        tree_ms = self._tree_extra_ms()
        trees = [("parked", [], 0.0)]
        for b in range(len(chain) + 1, min(tree.size, self.cap) + 1):  # the whole chain and b - len(chain) others
            inside = sum(1 for row in chain if row <= b)
            chain_part = self.chain_accepted.get(inside, sum(chain_probs[:inside])) if inside else 0.0
            expected = chain_part + self._gain(b, prior=sum(tree.path_probs[:b]) - sum(chain_probs[:inside]))
            trees.append((f"tree-{b}", list(range(1, b + 1)), (1 + expected) / max(curve.round_ms(b) + tree_ms, 1e-9)))
        length = min(self._length, len(chain))
        if length:
            expected = self.chain_accepted.get(length, sum(chain_probs[:length]))
            best_chain = (f"chain-{length}", chain[:length], (1 + expected) / max(curve.round_ms(length), 1e-9))
        else:  # the chain policy is parked: a tree must beat a plain step
            best_chain = ("parked", [], 1.0 / max(curve.verify_ms[0], 1e-9))
        best_tree = max(trees, key=lambda c: c[2])
        return best_tree if best_tree[2] > best_chain[2] * (1 + self.margin) else best_chain

    def observe(self, tree: Tree, *, verified: list[int], path: list[int], ms: float | None = None) -> None:
        """A tree round (a look, or a tree picked): the tables, and the chain policy told what its chain would
        have accepted, timed as its chain round (what the tree cost beyond that is not the chain's)."""
        chain = tree.top_chain()
        on_chain = next((k for k, (a, c) in enumerate(zip(path, chain)) if a != c), min(len(path), len(chain)))
        curve = self.curve.at(self._position)
        if ms is not None and verified and self.heal:
            self._update(self.overhead_ms, "tree", ms - curve.round_ms(len(verified)))
        held = set(verified)
        prefix = next((b for b in range(len(verified), 0, -1) if all(r in held for r in range(1, b + 1))), 0)
        for b in range(1, prefix + 1):  # the tree's first b rows: the path's rows among them, less the chain's part
            inside = sum(1 for row in chain if row <= b)
            self._update(self.tree_gain, b, sum(1 for row in path if row <= b) - min(on_chain, inside))
        for length in range(1, len(chain) + 1):
            if chain[length - 1] not in held:
                break
            self._update(self.chain_accepted, length, min(on_chain, length))
        length = min(self._length, len(chain))
        if length:
            if ms is not None:
                self.chain.untimed(max(0.0, ms - curve.round_ms(length)))
            self.chain.observe(proposed=length, accepted=min(on_chain, length))
        else:  # a tree while the chain policy is parked: it counted a parked round; this one is not its to time
            self.chain.restart_clock()
        if self._kind == "look":  # what the estimates say now decides the rounds until the next look
            self._trees = self.best(tree, curve=curve)[0].startswith("tree")
            self._look_interval = self.explore_every if self._trees else min(2 * self._look_interval, self.max_explore_every)
            self._until_look = self._look_interval

    def observe_chain(self, *, proposed: int, accepted: int, ms: float | None = None) -> None:
        self.choices[f"chain-{proposed}"] += 1
        if ms is not None and proposed and self.heal:
            self._update(self.overhead_ms, "chain", ms - self.curve.at(self._position).round_ms(proposed))
        for length in range(1, proposed + 1):
            self._update(self.chain_accepted, length, min(accepted, length))
        self.chain.observe(proposed=proposed, accepted=accepted)

    def _worth_a_look(self, position: int, depth: int) -> bool:
        """Whether a tree could beat the chain at all: one accepting every node of the cheapest tree (the chain
        `depth` deep and one more node), at the tree rounds' extra cost seen so far, against the chain's rate."""
        if self._tree_nodes(depth) <= depth:  # no node beside the chain's
            return False
        curve = self.curve.at(position)
        length = self._length
        chain = (1 + self.chain_accepted.get(length, 0.0)) / max(curve.round_ms(length) if length else curve.verify_ms[0], 1e-9)
        perfect = (1 + depth) / max(curve.round_ms(min(depth + 1, self.cap)) + self._tree_extra_ms(), 1e-9)
        return perfect > chain * (1 + self.margin)

    def _tree_nodes(self, depth: int) -> int:
        """A grown tree's nodes: `look_nodes`, and at least the chain `depth` deep and as many others."""
        return min(self.cap, max(self.look_nodes, 2 * depth + 1))

    def _tree_extra_ms(self) -> float:
        """What growing and reading a tree cost a round beyond a chain round (the rounds' own times)."""
        return max(0.0, self.overhead_ms.get("tree", 0.0) - self.overhead_ms.get("chain", 0.0))

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

    def finish(self) -> None:
        self.chain.finish()

    def summary(self) -> dict:
        return {"choices": dict(sorted(self.choices.items())), "chain": self.chain.summary(),
                "overhead_ms": {kind: round(ms, 3) for kind, ms in sorted(self.overhead_ms.items())}}
