"""Token trees from a draft's per-position distributions (issue 37): grow, then mask and positions.

A tree of B nodes hangs under the anchor (row 0); a parent's row is smaller than its children's. Its
value, if the draft were right, is the expected accepted length: the sum over nodes of the product of the
draft probabilities along the node's path. The tree always holds the draft's top-1 chain `chain_depth`
deep (rows 1..chain_depth): under greedy verification a tree that contains the chain accepts at least
what the chain round would, whatever the draft's probabilities say (a flat softmax would otherwise spend
the nodes on siblings and drop the chain's deep nodes, issue 52). The other B - chain_depth nodes are
those of highest path probability, in best-first order: they are prefix-closed (a child's path
probability is at most its parent's), so the tree is grown depth by depth keeping the chain's node and
the B best others of each depth (no node outside them can be among the best overall), and the best over
all depths are taken at the end, as DDTree's best-first expansion would pick them. Growing is lazy on the
device; one host read at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

# children(depth, parents (F,), state) -> (log-probabilities (F or 1, V) of the token at `depth`, state per parent)
Children = Callable[[int, mx.array, Any], tuple[mx.array, Any]]


@dataclass
class Tree:
    """B draft nodes under the anchor; node i (0-based) is row i + 1 of the verify."""

    tokens: list[int]  # (B,) each node's token
    parents: list[int]  # (B,) the row of each node's parent (0: the anchor)
    depths: list[int]  # (B,) 1 for the anchor's children
    path_probs: list[float]  # (B,) product of the draft probabilities along each node's path

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def expected_accepted(self) -> float:
        """The accepted draft tokens the draft itself expects from verifying this tree."""
        return float(sum(self.path_probs))

    def top_chain(self) -> list[int]:
        """Rows of the path that follows each node's most probable child (the chain a chain round verifies)."""
        rows, row = [], 0
        while True:
            child = next((i + 1 for i, p in enumerate(self.parents) if p == row), None)  # best-first: the first
            if child is None:
                return rows
            rows.append(child)
            row = child

    def subtree(self, rows: list[int]) -> "Tree":
        """The tree of these node `rows` (ascending, 1-based, each node's parent among them or the anchor),
        renumbered in their order."""
        new_row = {0: 0, **{row: i + 1 for i, row in enumerate(rows)}}
        if any(self.parents[row - 1] not in new_row or new_row[self.parents[row - 1]] > i for i, row in enumerate(rows)):
            raise ValueError(f"rows {rows} are not prefix-closed in this tree (parents {self.parents})")
        pick = lambda values: [values[row - 1] for row in rows]  # noqa: E731
        return Tree(tokens=pick(self.tokens), parents=[new_row[p] for p in pick(self.parents)], depths=pick(self.depths),
                    path_probs=pick(self.path_probs))  # fmt: skip

    def ancestors(self) -> mx.array:
        """(1 + B, 1 + B) bool: row i sees row j iff j is i or an ancestor of i (the anchor is everyone's)."""
        rows = [[False] * (self.size + 1) for _ in range(self.size + 1)]
        rows[0][0] = True
        for i, parent in enumerate(self.parents):
            rows[i + 1] = list(rows[parent])
            rows[i + 1][i + 1] = True
        return mx.array(rows, dtype=mx.bool_)

    def positions(self, anchor_position: int) -> mx.array:
        """(1 + B,) int32: each row's position, the anchor's plus its depth."""
        return mx.array([anchor_position] + [anchor_position + d for d in self.depths], dtype=mx.int32)


def chain_tree(tokens: list[int]) -> Tree:
    """A chain as a tree (each node the child of the one before): a chain round in tree form."""
    n = len(tokens)
    return Tree(tokens=list(tokens), parents=list(range(n)), depths=list(range(1, n + 1)), path_probs=[1.0] * n)


def grow_tree(children: Children, anchor: mx.array, *, num_nodes: int, max_depth: int, chain_depth: int | None = None) -> Tree:
    """The draft's top-1 chain `chain_depth` deep (default: as deep as `num_nodes` and `max_depth` allow) in rows
    1..chain_depth, then the other nodes of highest path probability, `num_nodes` in all, at most `max_depth`
    deep, under `anchor` (1,)."""
    if num_nodes < 0 or max_depth < 0:
        raise ValueError(f"num_nodes and max_depth must be >= 0, got {num_nodes} and {max_depth}")
    chain_depth = min(num_nodes, max_depth) if chain_depth is None else min(chain_depth, num_nodes, max_depth)
    if num_nodes == 0 or max_depth == 0:
        return Tree(tokens=[], parents=[], depths=[], path_probs=[])
    frontier = anchor.astype(mx.int32).reshape(1)  # (F,) the kept nodes of the depth before; the chain's first
    frontier_logprob = mx.zeros((1,), mx.float32)
    state = None
    levels = []  # per depth: (parent index in the previous level (F,), token (F,), path log-probability (F,))
    for depth in range(1, max_depth + 1):
        logprobs, parent_state = children(depth, frontier, state)
        scores = (frontier_logprob[:, None] + logprobs).reshape(-1)  # (F * V,)
        vocab = logprobs.shape[-1]
        # the nodes beside the chain's: no node outside a depth's best `num_nodes - chain_depth` others can be
        # among the best others overall (past the chain, its node is one of them)
        keep = min(num_nodes - chain_depth + (depth <= chain_depth), scores.shape[0])
        if keep < 1:
            break
        if depth <= chain_depth:  # the chain's node (the top child of the chain's node, index 0) first, then the best others
            top = mx.argmax(logprobs[0]).astype(mx.uint32).reshape(1)
            others = mx.where(mx.arange(scores.shape[0]) == top, -mx.inf, scores)
            rest = mx.argpartition(-others, kth=keep - 2)[: keep - 1] if keep > 1 else top[:0]
            best = mx.concatenate([top, rest.astype(mx.uint32)])
        else:
            best = mx.argpartition(-scores, kth=keep - 1)[:keep] if keep < scores.shape[0] else mx.arange(keep)
        parent, token = best // vocab, (best % vocab).astype(mx.int32)
        frontier, frontier_logprob = token, scores[best]
        state = None if parent_state is None else parent_state[parent]
        levels.append((parent, token, frontier_logprob))
    mx.eval(levels)  # the tree's one host read
    return _best_nodes([(p.tolist(), t.tolist(), lp.tolist()) for p, t, lp in levels], num_nodes, chain_depth)


def _best_nodes(levels: list[tuple[list[int], list[int], list[float]]], num_nodes: int, chain_depth: int) -> Tree:
    """The chain (index 0 of the first `chain_depth` levels), then the best of the other grown nodes, `num_nodes`
    in all, each after its parent, numbered in the order taken."""
    chain = [(-levels[depth - 1][2][0], depth, 0) for depth in range(1, chain_depth + 1)]
    candidates = [
        (-logprob, depth, index)
        for depth, (_, _, logprobs) in enumerate(levels, start=1)
        for index, logprob in enumerate(logprobs)
        if logprob > -math.inf and not (index == 0 and depth <= chain_depth)
    ]
    candidates.sort()  # best first; at a tie the shallower first (a parent ties its child at most)
    row_of: dict[tuple[int, int], int] = {}
    tree = Tree(tokens=[], parents=[], depths=[], path_probs=[])
    for negative, depth, index in chain + candidates:
        if tree.size == num_nodes:
            break
        parents, tokens, _ = levels[depth - 1]
        parent_row = 0 if depth == 1 else row_of.get((depth - 1, parents[index]))
        if parent_row is None:  # its parent lost a tie: not prefix-closed, skip it
            continue
        row_of[(depth, index)] = tree.size + 1
        tree.tokens.append(tokens[index])
        tree.parents.append(parent_row)
        tree.depths.append(depth)
        tree.path_probs.append(math.exp(-negative))
    return tree
