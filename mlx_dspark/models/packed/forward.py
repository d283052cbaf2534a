"""Packed forwards: the rows of several sequences in one target (or draft) forward, each with its own caches.

Continuous batching puts B requests in one forward. Their rows (a verify block, a plain decode token, a
prefill chunk) differ in length and in position, and each request rolls back on its own, so instead of
padding them into a (B, L) batch with one shared cache, the rows are packed side by side as a
(T, 1, hidden) batch of single-row sequences: the matmuls (projections, MLP, heads) see T rows at once,
RoPE takes one position per row (`mx.fast.rope` with an array offset), and only the attention splits the
rows again, per sequence, over that sequence's own caches (`KVCache`, `RotatingKVCache`, quantized): the
same call as a forward of that sequence alone. Nothing is padded, rollback stays `trim_caches` on each
sequence's cache list, and on a BLAS whose matmul rows do not depend on the other rows (the bundled
one) every row is bitwise the row of its sequence's own forward.

mlx-lm's `BatchKVCache` / `BatchRotatingKVCache` keep one left-padded (B, H, L, D) buffer with one
trim for all rows, and `BatchRotatingKVCache` cannot roll back once it wrapped: ragged acceptance and
the sliding layers' rollback need per-sequence caches, which is what this layout keeps.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx

from mlx_dspark.models.packed import mlx_lm as packed_mlx_lm
from mlx_dspark.models.target.mlx_lm import is_mlx_lm_target
from mlx_dspark.models.heads.dspark.model import block_mask


def positions(offsets: Sequence[int], lengths: Sequence[int]) -> mx.array:
    """The position of every packed row: sequence i's rows continue from its cache offset -> (T,)."""
    return mx.array([o + j for o, n in zip(offsets, lengths) for j in range(n)], dtype=mx.int32)


PACKED_DRAFT_FAMILIES = ("qwen3", "spark2_5", "gemma4")  # the draft layer families packed_block_hidden runs


def packing_problem(model: Any) -> Optional[str]:
    """Why a loaded pair cannot run packed (continuous batching), or None: the packed forwards follow
    mlx-lm's models where its load-time probe passes (models/packed/mlx_lm.py) and the draft layer
    families (`DecoderLayer`), nothing else. A chained head drafts over each
    row's own cache (engine/batch/chains.py: packed where its own probe passes, else per row), a Gemma 4
    assistant per row over the row's own target caches, so they need nothing packed but the target."""
    if not is_mlx_lm_target(model.target):
        return f"the target ({type(model.target).__name__}) is not an mlx-lm model"
    problem = packed_mlx_lm.target_packing_problem(model.target)
    if problem is not None:
        return problem
    heads = [name for name, module in model.heads.items() if module is not None]
    if len(heads) > 1:  # engine/policy/head_choice.py picks per round over single-request costs; a batch row does not
        return f"a pair with several draft heads ({', '.join(heads)}) chooses its head per round, which batched rows do not; load one head"
    draft = model.draft
    if draft is not None and draft.args.family not in PACKED_DRAFT_FAMILIES:
        return f"the draft's layer family {draft.args.family!r} is not packed (only {', '.join(PACKED_DRAFT_FAMILIES)})"
    return None


def packed_target_forward(
    target: Any,
    tokens: Sequence[int] | mx.array,
    caches: Sequence[list],
    lengths: Sequence[int],
    *,
    tap_ids: Sequence[int] = (),
    head_rows: Optional[Sequence[int]] = None,
) -> tuple[mx.array, Optional[mx.array]]:
    """One target forward over the packed rows of several sequences.

    tokens: (T,) the rows of sequence 0, then 1, ...; `caches[i]` is sequence i's cache list (one per
    layer), advanced by `lengths[i]` positions. `head_rows`: the packed rows that need logits (default
    all; a prefill chunk needs only its last). Returns logits (R, V) for those rows and the tapped
    features (T, F) of every row (None without tap ids): models/packed/mlx_lm.py.
    """
    tokens = mx.array(tokens, dtype=mx.int32) if not isinstance(tokens, mx.array) else tokens
    total = sum(lengths)
    if tokens.shape != (total,) or len(caches) != len(lengths):
        raise ValueError(f"packed forward: {tokens.shape} tokens for {len(lengths)} sequences of {list(lengths)} rows")
    return packed_mlx_lm.packed_mlx_lm_forward(target, tokens, caches, lengths, tap_ids=tap_ids, head_rows=head_rows)


def packed_block_hidden(draft: Any, anchors: mx.array, contexts: Sequence[list], *, target: Any) -> mx.array:
    """`DSparkDraft.block_hidden` for B sequences at once: anchors (B,), contexts[i] sequence i's context
    caches -> o = norm(h) (B, block_size, hidden). Each layer runs its own `forward` over the (B, block_size)
    rows (its embedding, norms, MLP, residual form; a DFlash 2 layer's convolutions along each block's own
    rows); only its attention is packed as in the target's forward: the rows as (T, 1, hidden), each at its
    own position, split per sequence to attend to that sequence's own context (`_attend`)."""
    size, num = draft.args.block_size, anchors.shape[0]
    ids = mx.concatenate(
        [anchors.reshape(num, 1), mx.full((num, size - 1), draft.args.mask_token_id, dtype=anchors.dtype)], axis=1
    )
    h = draft.embed_block(ids, target=target)  # (B, size, hidden)
    row_positions = positions([ctx[0].offset for ctx in contexts], [size] * num)
    for index, layer in enumerate(draft.layers):
        caches = [ctx[index] for ctx in contexts]
        h = layer.forward(h, lambda x, attention=layer.self_attn, caches=caches: _attend(attention, x, caches, row_positions))
    return draft.norm(h)


def _attend(attention: Any, x: mx.array, caches: Sequence[Any], row_positions: mx.array) -> mx.array:
    """The attention output of blocks x (B, size, hidden), block b over its context cache `caches[b]`."""
    num, size, hidden = x.shape
    rows = x.reshape(num * size, 1, hidden)
    queries, keys, values = attention.project(rows, row_positions)  # (T, heads, 1, D)
    outs = []
    for b, cache in enumerate(caches):
        block = slice(b * size, (b + 1) * size)
        q, k, v = (a[block].transpose(2, 1, 0, 3) for a in (queries, keys, values))  # (1, heads, size, D)
        context = cache.fetch()
        if context is not None:
            k = mx.concatenate([context[0].astype(k.dtype), k], axis=2)
            v = mx.concatenate([context[1].astype(v.dtype), v], axis=2)
        mask = block_mask(cache.offset, size, cache.length, cache.window)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=attention.scale, mask=mask)
        outs.append(out.transpose(2, 1, 0, 3))
    return attention.output(mx.concatenate(outs, axis=0), rows).reshape(num, size, -1)
