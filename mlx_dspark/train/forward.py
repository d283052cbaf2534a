"""The training forward of a DSpark draft, as DeepSpec trains it (DSPARK.md 3).

For a batch of sequences: one frozen target forward gives the tapped features of every position and
the target's logits; anchors are sampled per sequence; for every anchor `p` the block
`[token at p, mask x (block_size - 1)]` at positions `p .. p+block_size-1` attends to the fused
context `c(t)` of the positions `t < p` it may see (the window rule of each draft layer) and to its
whole block. All anchors of the batch run as one batch of blocks, each with its own RoPE offset;
each block gathers the context rows it may see, so no (blocks x sequence) mask is ever built.

The Markov head is teacher-forced: the previous token of block position k is the data token at
`p+k-1` (the anchor for k = 1), as in DeepSpec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_dspark.train.data import Batch, Chunk, sequential_batches


@dataclass
class Anchors:
    seq: np.ndarray  # (N,) sequence of each anchor in the batch
    pos: np.ndarray  # (N,) anchor position p


@dataclass
class BlockTargets:
    """What the loss compares the draft's block outputs with (no gradient)."""

    labels: mx.array  # (N, bs) data tokens at p+1 .. p+bs
    prev: mx.array  # (N, bs) the Markov head's previous token: the anchor, then labels[:, :-1]
    valid: mx.array  # (N, bs) float32 1/0: inside the sequence, trainable, and all earlier positions too
    target_logits: mx.array  # (N, bs, V) float32 target logits at p+k-1, i.e. its prediction of p+k


@dataclass
class DraftOutputs:
    hidden: mx.array  # (N, bs, H) o(1..bs) = norm(h) of each block
    logits: mx.array  # (N, bs, V) float32: z(k) + Markov bias, teacher-forced
    confidence_logits: Optional[mx.array]  # (N, bs) float32 uncalibrated, None without a confidence head


def sample_anchors(
    loss_mask: np.ndarray, *, num_anchors: int, rng: np.random.Generator | Sequence[np.random.Generator]
) -> Anchors:
    """Up to `num_anchors` distinct anchors per sequence, where the anchor and the token after it are trainable.

    `rng` is one generator for the whole batch, or one per sequence (training keys each by the
    sequence's index in the global batch, so a data-parallel rank draws the anchors one process would)."""
    valid = loss_mask[:, :-1] & loss_mask[:, 1:]  # (B, S-1)
    rngs = [rng] * valid.shape[0] if isinstance(rng, np.random.Generator) else list(rng)
    if len(rngs) != valid.shape[0]:
        raise ValueError(f"{len(rngs)} anchor generators for {valid.shape[0]} sequences")
    seqs, positions = [], []
    for b in range(valid.shape[0]):
        candidates = np.flatnonzero(valid[b])
        if len(candidates) > num_anchors:
            candidates = np.sort(rngs[b].choice(candidates, size=num_anchors, replace=False))
        seqs.append(np.full(len(candidates), b, dtype=np.int32))
        positions.append(candidates.astype(np.int32))
    return Anchors(np.concatenate(seqs), np.concatenate(positions))


def target_pass(target: Any, tokens: mx.array, tap_ids: tuple[int, ...]) -> tuple[mx.array, mx.array]:
    """(logits (B, S, V), features (B, S, F)) of the frozen target, evaluated and cut from any graph."""
    logits, features = target(tokens, tap_ids=tap_ids)
    logits, features = mx.stop_gradient(logits), mx.stop_gradient(features)
    mx.eval(logits, features)
    return logits, features


def block_targets(batch: Batch, anchors: Anchors, target_logits: mx.array, *, block_size: int) -> BlockTargets:
    B, S = batch.tokens.shape
    label_pos = anchors.pos[:, None] + np.arange(1, block_size + 1)[None]  # (N, bs)
    inside = label_pos < S
    clipped = np.minimum(label_pos, S - 1)
    labels = batch.tokens[anchors.seq[:, None], clipped]
    valid = inside & batch.loss_mask[anchors.seq[:, None], clipped]
    valid = np.cumprod(valid, axis=1).astype(np.float32)  # a block stops at its first untrainable position
    prev = np.concatenate([batch.tokens[anchors.seq, anchors.pos][:, None], labels[:, :-1]], axis=1)
    rows = anchors.seq[:, None] * S + (clipped - 1)  # the target's prediction of p+k sits at p+k-1
    V = target_logits.shape[-1]
    aligned = mx.take(target_logits.reshape(B * S, V), mx.array(rows.reshape(-1)), axis=0)
    return BlockTargets(
        labels=mx.array(labels.astype(np.int32)),
        prev=mx.array(prev.astype(np.int32)),
        valid=mx.array(valid),
        target_logits=aligned.reshape(len(anchors.pos), block_size, V).astype(mx.float32),
    )


class _AnchorContext:
    """Duck-typed draft context for a batch of blocks: per-block RoPE offsets and gathered context K/V."""

    def __init__(self, offset: mx.array, keys: Optional[mx.array], values: Optional[mx.array]):
        self.offset = offset  # (N,) anchor positions: RoPE offsets of the blocks
        self._kv = None if keys is None else (keys, values)

    def fetch(self) -> Optional[tuple[mx.array, mx.array]]:
        return self._kv


def _layer_over_blocks(
    layer: nn.Module, *, seq: mx.array, pos: mx.array, window: Optional[int], num_context: int
) -> Callable[[mx.array, mx.array], mx.array]:
    """One draft layer over all blocks: the only code that knows how a draft layer takes its context.

    It uses the layer's own pieces: `self_attn.key_values(x, offset)` for the context K/V of the
    whole sequence (RoPE at 0..S-1), then the layer's call with a context object whose `offset` is
    the (N,) anchor positions and whose `fetch()` returns each block's `num_context` context rows
    (positions p-num_context .. p-1, masked where < 0 or outside the window).
    """

    # The anchors are constants of the closure: a checkpointed function differentiates all its inputs.
    def run(h: mx.array, context: mx.array) -> mx.array:
        N, size = h.shape[:2]
        B, S = context.shape[:2]
        view = _AnchorContext(pos, None, None)
        mask = None
        if num_context > 0:
            keys, values = layer.self_attn.key_values(context, 0)  # (B, kv_heads, S, D)
            t = pos[:, None] - num_context + mx.arange(num_context)[None]  # (N, n) context positions
            rows = seq[:, None] * S + mx.maximum(t, 0)

            def gather(x: mx.array) -> mx.array:
                flat = x.transpose(0, 2, 1, 3).reshape(B * S, x.shape[1], x.shape[3])
                return mx.take(flat, rows.reshape(-1), axis=0).reshape(N, num_context, x.shape[1], x.shape[3]).transpose(0, 2, 1, 3)

            view = _AnchorContext(pos, gather(keys), gather(values))
            q = pos[:, None] + mx.arange(size)[None]  # (N, bs) query positions
            seen = mx.broadcast_to((t >= 0)[:, None, :], (N, size, num_context))
            if window is not None:
                seen = seen & (t[:, None, :] > q[:, :, None] - window)  # q - t < window
            mask = mx.concatenate([seen, mx.ones((N, size, size), dtype=mx.bool_)], axis=-1)[:, None]
        return layer(h, view, mask)

    return run


def draft_forward(
    draft: nn.Module,
    target: Any,
    features: mx.array,
    tokens: mx.array,
    anchors: Anchors,
    prev: mx.array,
    *,
    checkpoint: bool = False,
) -> DraftOutputs:
    """Block outputs of every anchor; differentiable in the draft's parameters only.

    features (B, S, F) and tokens (B, S) come from `target_pass`; prev (N, bs) from `block_targets`.
    """
    args = draft.args
    size = args.block_size
    dtype = draft.hidden_norm.weight.dtype
    target_dtype = features.dtype
    seq, pos = mx.array(anchors.seq), mx.array(anchors.pos)
    context = draft.hidden_norm(draft.fc(features.astype(dtype)))  # c(t) for every position, (B, S, H)
    anchor_tokens = tokens[seq, pos]
    ids = mx.concatenate(
        [anchor_tokens[:, None], mx.full((len(anchors.pos), size - 1), args.mask_token_id, dtype=tokens.dtype)], axis=1
    )
    h = draft.embed_block(ids, target=target).astype(dtype)  # (N, bs, H), with the draft's own rows and scales
    last_anchor = int(anchors.pos.max()) if len(anchors.pos) else 0
    for i, layer in enumerate(draft.layers):
        window = args.layer_window(i)
        # rows a block may see: window - 1 before its anchor, or every earlier position for full attention
        num_context = last_anchor if window is None else min(window - 1, last_anchor)
        run = _layer_over_blocks(layer, seq=seq, pos=pos, window=window, num_context=num_context)
        if checkpoint:
            run = nn.utils.checkpoint(layer, run)
        h = run(h, context)
    hidden = draft.norm(h)  # o(1..bs), (N, bs, H)
    base = draft.cap_logits(target.lm_head_logits(hidden.astype(target_dtype)).astype(mx.float32))  # z(1..bs)

    markov = getattr(draft, "markov_head", None)
    logits, prev_embeddings = base, []
    if markov is not None:
        state, steps = None, []
        for k in range(size):
            embedding = markov.prev_embedding(prev[:, k])  # W1[x(k-1)], (N, r)
            if k == 0:
                state = markov.initial_state(embedding)
            bias, state = markov.step(embedding, hidden[:, k], state)
            steps.append(base[:, k] + bias.astype(mx.float32))
            prev_embeddings.append(embedding)
        logits = mx.stack(steps, axis=1)

    confidence = None
    head = getattr(draft, "confidence_head", None)
    if head is not None:
        head_features = hidden
        if args.confidence_head_with_markov:
            head_features = mx.concatenate([hidden, mx.stack(prev_embeddings, axis=1).astype(hidden.dtype)], axis=-1)
        confidence = head.logits(head_features)
    return DraftOutputs(hidden=hidden, logits=logits, confidence_logits=confidence)


def held_out_blocks(
    draft: Any,
    target: Any,
    chunks: list[Chunk],
    *,
    batch_size: int,
    anchors: int,
    rng: np.random.Generator,
    pad_id: int,
) -> Iterator[tuple[Anchors, BlockTargets, DraftOutputs]]:
    """The draft's blocks over held-out chunks, batch by batch, with anchors drawn from `rng` (no gradients):
    what evaluation and calibration both read."""
    tap_ids = tuple(draft.args.target_layer_ids)
    for batch in sequential_batches(chunks, batch_size=batch_size, pad_id=pad_id):
        picked = sample_anchors(batch.loss_mask, num_anchors=anchors, rng=rng)
        tokens = mx.array(batch.tokens)
        target_logits, features = target_pass(target, tokens, tap_ids)
        targets = block_targets(batch, picked, target_logits, block_size=draft.args.block_size)
        yield picked, targets, draft_forward(draft, target, features, tokens, picked, targets.prev)
