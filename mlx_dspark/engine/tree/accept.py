"""Verification of a token tree (issue 37), greedy and sampled, as pure (lazy) functions of arrays.

The target scored every row of the tree (the anchor, then the B nodes) with each row seeing the cache
and its own ancestors only.

Greedy: a node is right when its token is the target's argmax at its parent; the accepted path is the
longest root-to-node path of right nodes (siblings hold distinct tokens, so at most one child of a node
is right: the path is unique). The committed tokens are the target's argmax along it: its nodes' tokens,
then the bonus at its last node.

Sampled: multi-candidate recursive rejection (SpecInfer's, Sequoia's) over each node's children, in row
order. Our trees are grown deterministically (the best-first nodes of the draft's distributions,
engine/tree/grow.py), not sampled, so each child is a draft whose distribution is a point mass on its token,
q = 1{x = child}. With the target's (residual) distribution p at the node, child c is accepted with
probability min(1, p(c) / q(c)) = p(c); after a rejection the residual is normalize(max(p - q, 0)): p with
c's mass removed. So the i-th child is accepted with probability p(c_i) / (1 - p(c_1) - ... - p(c_(i-1)))
given its earlier siblings were rejected, and when all are rejected the bonus is drawn from p without
the children. Each token t is then committed with probability p(t) exactly (a child: the product of the
rejections before it and its own acceptance telescopes to p(c_i); another token: (1 - sum p(c)) times
p(t) / (1 - sum p(c))), at every node of the path, whatever the tree: lossless. It is also the most a
set of fixed candidates can accept (a node is left for a child with probability sum p(c), the target's
whole mass on them). Children sampled from the draft's q (SpecInfer, Sequoia: residual max(p - q, 0)
after each rejection) are not built here; they can accept more where p is flat and q close to it.
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


def accept_tree_sampled(
    *, node_tokens: mx.array, parents: mx.array, depths: mx.array, ancestors: mx.array, target_probs: mx.array, max_depth: int
) -> TreeAcceptance:
    """Recursive rejection over each node's children (the module's docstring): lossless sampling.

    node_tokens, parents (rows), depths: (B,); ancestors: (1 + B, 1 + B) bool; target_probs: (1 + B, V) the
    target's sampling distributions at [anchor, nodes], or (N, 1 + B, V) for N independent trials of the same
    tree (then every field of the result has a leading N). Siblings must hold distinct tokens.
    """
    batched = target_probs.ndim == 3
    probs = target_probs if batched else target_probs[None]  # (N, R, V)
    trials, num_rows, vocab = probs.shape
    num_nodes = num_rows - 1
    node_tokens, parents = node_tokens.astype(mx.int32), parents.astype(mx.int32)
    if num_nodes:
        flat = probs.reshape(trials, num_rows * vocab)
        target_at_node = mx.take(flat, parents * vocab + node_tokens, axis=1)  # (N, B): p at the parent, of the node
        index = mx.arange(num_nodes)
        earlier = (parents[:, None] == parents[None, :]) & (index[None, :] < index[:, None])  # (B, B) earlier siblings
        before = target_at_node @ earlier.T.astype(probs.dtype)  # (N, B): the mass the earlier siblings took
        # accepted with probability p(c) / (1 - before), written without a division
        uniforms = mx.random.uniform(shape=(trials, num_nodes))
        accepts = uniforms * mx.maximum(1.0 - before, 0.0) < target_at_node
        chosen = accepts & ~mx.any(earlier[None] & accepts[:, None, :], axis=-1)  # the first accepted sibling
        right = mx.concatenate([mx.ones((trials, 1), mx.bool_), chosen], axis=1)  # (N, R)
    else:
        right = mx.ones((trials, 1), mx.bool_)
    reached = ~mx.any(ancestors[None] & ~right[:, None, :], axis=-1)  # (N, R): it and its ancestors accepted
    row_depths = mx.concatenate([mx.zeros((1,), mx.int32), depths.astype(mx.int32)])
    leaf = mx.argmax(mx.where(reached, row_depths[None], -1), axis=1)  # (N,)
    accepted = row_depths[leaf]
    # the bonus: the leaf's distribution without its children (all of them rejected, or none)
    leaf_probs = mx.take_along_axis(probs, leaf[:, None, None], axis=1)[:, 0]  # (N, V)
    if num_nodes:
        is_child = (parents[None, :] == leaf[:, None]).astype(probs.dtype)  # (N, B)
        slots = (mx.arange(trials)[:, None] * vocab + node_tokens[None, :]).reshape(-1)
        removed = mx.zeros((trials * vocab,), probs.dtype).at[slots].add(is_child.reshape(-1)).reshape(trials, vocab)
        residual = mx.where(removed > 0, 0.0, leaf_probs)
        # the children cannot all be rejected where they hold all of p; guard the 0/0 anyway
        residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, leaf_probs)
    else:
        residual = leaf_probs
    bonus = mx.random.categorical(mx.log(residual), axis=-1).astype(mx.int32)  # (N,)
    on_path = ancestors[leaf]  # (N, R)
    order = mx.arange(num_rows)[None]
    rows = mx.argsort(mx.where(on_path, order, num_rows + order), axis=1)[:, : max_depth + 1].astype(mx.int32)
    row_tokens = mx.concatenate([mx.zeros((1,), mx.int32), node_tokens])
    following = mx.concatenate([row_tokens[rows[:, 1:]], mx.zeros((trials, 1), mx.int32)], axis=1)  # the path's next node
    tokens = mx.where(mx.arange(max_depth + 1)[None] < accepted[:, None], following, bonus[:, None])
    if not batched:
        return TreeAcceptance(accepted=accepted[0], rows=rows[0], tokens=tokens[0])
    return TreeAcceptance(accepted=accepted, rows=rows, tokens=tokens)
