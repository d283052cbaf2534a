"""One target forward over a token tree, and committing its accepted path (issue 37), for mlx-lm targets.

The tree's rows (the anchor, then its nodes) run as one forward of mlx-lm's own `__call__`, laid out as
a packed forward (models/packed/mlx_lm.py) of one sequence: T single-position rows, each layer given a
`TreeView` of its cache whose `offset` is every row's position (the anchor's plus its depth: RoPE puts
each node where it would sit on its own path) and whose `make_mask` is the tree mask (each row sees the
cache and its own ancestors). The dispatcher runs the attention as one sequence (1, heads, T, D) over the
cache's keys with that mask. Nothing of mlx-lm changes.

Attention-only full-KV targets first: every cache must be a plain `KVCache` (no rotating windows, no
recurrent states, no quantized caches), because committing the path copies KV rows. After the forward
the caches hold the anchor and all B nodes at positions start .. start + B; `keep_path` rolls back the
B nodes and appends the accepted path's own rows again (their keys were rotated at their path
positions already), leaving exactly what the chain forward of those tokens leaves.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_dspark.models.layers.base import check_tap_ids, gather_taps
from mlx_dspark.models.caches.kv import trim_caches
from mlx_dspark.models.target.mlx_lm import MLXLMTarget, feature_dtype, is_mlx_lm_target
from mlx_dspark.models.packed.mlx_lm import PackedMask, PackedView, _begin_recording, _CURRENT, _Forward, install_dispatch

REFUSAL = "tree verification runs on attention-only full-KV targets first (every cache a plain KVCache)"


class TreeView(PackedView):
    """One layer's view of a tree forward: its cache, the rows' positions, the tree mask."""

    def __init__(self, cache: Any, positions: mx.array, mask: mx.array, forward: _Forward, lists: Any):
        super().__init__([cache], [positions.shape[0]], positions, forward, [lists])
        self.tree_mask = mask  # (T, offset + T) bool

    def make_mask(self, N: int = 1, *, return_array: bool = False, window_size: Optional[int] = None) -> PackedMask:
        if N != 1 or window_size is not None:
            raise ValueError(f"a tree forward runs full attention over single-position rows (N {N}, window {window_size})")
        return PackedMask([self.tree_mask])


def tree_problem(target: Any, caches: Sequence[Any]) -> Optional[str]:
    """Why a tree cannot be verified on this target and these caches, or None."""
    if not is_mlx_lm_target(target):
        return f"{REFUSAL}; this target is not run through mlx-lm's model class"
    kinds = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    if kinds:
        return f"{REFUSAL}; model_type {target.mlx_lm_model_type!r} has {', '.join(kinds)} caches"
    if getattr(target, "_dspark_packed_dispatch", None) is None:  # once per target (the packed forward's too)
        object.__setattr__(target, "_dspark_packed_dispatch", install_dispatch(target))
    if not target._dspark_packed_dispatch:
        return f"model_type {target.mlx_lm_model_type!r}: its attention does not call mlx-lm's scaled_dot_product_attention"
    return None


def tree_target_forward(
    target: MLXLMTarget,
    tokens: mx.array,
    caches: Sequence[Any],
    *,
    positions: mx.array,
    ancestors: mx.array,
    tap_ids: Sequence[int] = (),
) -> tuple[mx.array, Optional[mx.array]]:
    """tokens (T,) = [anchor, nodes] at `positions` (T,), `ancestors` (T, T) bool -> (logits (T, V),
    features (1, T, F) or None). The caches take all T rows (`keep_path` keeps the accepted ones)."""
    problem = tree_problem(target, caches)
    if problem is not None:
        raise ValueError(problem)
    total = tokens.shape[0]
    tap_ids = check_tap_ids(tap_ids, target.args.num_hidden_layers)
    offset = caches[0].offset
    mask = mx.concatenate([mx.ones((total, offset), dtype=mx.bool_), ancestors], axis=1)  # (T, offset + T)
    forward = _Forward()
    views = [TreeView(c, positions, mask, forward, caches) for c in caches]
    _begin_recording(caches, total)
    capture = target._capture
    capture.start("forward", tap_ids=tap_ids)
    _CURRENT.append(forward)
    try:
        super(MLXLMTarget, target).__call__(tokens.reshape(total, 1), cache=views)  # its logits: never evaluated
        final, taps, bad = capture.final, dict(capture.taps), capture.bad_output
    finally:
        _CURRENT.remove(forward)
        capture.start("off")
    if bad or final is None:
        raise ValueError(f"model_type {target.mlx_lm_model_type!r}: the tree forward was not recorded ({bad})")
    logits = target.model_head_logits(final)[:, 0]  # (T, V): mlx-lm's own head code
    if not tap_ids:
        return logits, None
    features = gather_taps(taps, tap_ids, feature_dtype(target, taps[tap_ids[0]]))  # (T, 1, F)
    return logits, features.reshape(1, total, -1)


def keep_path(caches: Sequence[Any], *, width: int, rows: Sequence[int]) -> None:
    """After a tree forward of `width` rows: keep the anchor and the accepted path's node `rows` (ascending,
    1-based), in that order, and nothing of the other branches."""
    trim_caches(caches, width - 1)  # the anchor's row stays
    if not rows:
        return
    for cache in caches:
        anchor = cache.offset - 1
        picked = mx.array([anchor + r for r in rows], dtype=mx.int32)
        cache.update_and_fetch(cache.keys[..., picked, :], cache.values[..., picked, :])
