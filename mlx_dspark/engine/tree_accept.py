"""Greedy verification of a token tree (issue 37), as a pure (lazy) function of arrays.

The target scored every row of the tree (the anchor, then the B nodes) with each row seeing the cache
and its own ancestors only. A node is right when its token is the target's argmax at its parent; the
accepted path is the longest root-to-node path of right nodes (siblings hold distinct tokens, so at most
one child of a node is right: the path is unique). The committed tokens are the target's argmax along
it: its nodes' tokens, then the bonus at its last node. Sampled trees are not verified here (refused by
the options: engine/options.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class TreeAcceptance:
    accepted: mx.array  # () int32: the accepted path's depth a
    rows: mx.array  # (max_depth + 1,) int32: the path's rows, anchor first; the first a + 1 are meaningful
    tokens: mx.array  # (max_depth + 1,) int32: committed tokens; the first a + 1 are meaningful


def accept_tree_greedy(
    *, node_tokens: mx.array, parents: mx.array, depths: mx.array, ancestors: mx.array, target_logits: mx.array, max_depth: int
) -> TreeAcceptance:
    """node_tokens, parents (rows), depths: (B,); ancestors: (1 + B, 1 + B) bool (engine/tree.Tree.ancestors);
    target_logits: (1 + B, V) for [anchor, nodes]; max_depth: the deepest node's depth."""
    num_rows = target_logits.shape[0]
    target_tokens = mx.argmax(target_logits, axis=-1).astype(mx.int32)  # (1 + B,)
    right = mx.concatenate([mx.array([True]), node_tokens.astype(mx.int32) == target_tokens[parents]])  # (1 + B,)
    # a row is reached when it and all its ancestors are right
    reached = ~mx.any(ancestors & ~right[None, :], axis=1)
    row_depths = mx.concatenate([mx.zeros((1,), mx.int32), depths.astype(mx.int32)])
    leaf = mx.argmax(mx.where(reached, row_depths, -1))  # the deepest reached row (the anchor: 0)
    accepted = row_depths[leaf]
    # the leaf's ancestors in row order are its path from the anchor (a parent's row is smaller)
    on_path = ancestors[leaf]
    order = mx.argsort(mx.where(on_path, mx.arange(num_rows), num_rows + mx.arange(num_rows)))
    rows = order[: max_depth + 1].astype(mx.int32)
    return TreeAcceptance(accepted=accepted, rows=rows, tokens=target_tokens[rows])
