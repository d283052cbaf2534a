"""Model pieces shared by the targets and the draft: masks, partial-rotary RoPE, GELU, tap checks,
the attention call both families share.

Position convention (ARCHITECTURE.md, "Caches"): an attention call has `L` queries at positions
`q_start .. q_start + L - 1` and `K` keys at positions `q_start + L - K .. q_start + L - 1` (the keys
always end with the queries' own positions, as mlx-lm's `KVCache` and our `SlidingKVCache` return them).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

# Exact (erf) GELU, as the reference's `ACT2FN["gelu"]`; never the tanh approximation.
gelu = nn.gelu


def attention_mask(
    q_start: int, num_queries: int, num_keys: int, *, window: Optional[int] = None
) -> Optional[mx.array | str]:
    """Mask for `mx.fast.scaled_dot_product_attention`: None when nothing is masked, "causal" when only
    causality masks (sdpa aligns it to the last key, and can skip building a boolean array), else a
    boolean (L, K) array.

    Key `j` sits at position `q_start + L - K + j`. Query `q` sees key `k` iff `k <= q` and, with a
    window, `q - window < k` (the window counts the query itself).
    """
    L, K = num_queries, num_keys
    if K < L:
        raise ValueError(f"attention_mask: {K} keys cannot cover {L} queries (keys end with the queries' positions)")
    # The window cuts nothing iff the last query sees the first key (K <= window); then only
    # causality masks: nothing for one query, sdpa's "causal" for several.
    window_cuts = window is not None and K > window
    if not window_cuts:
        return None if L == 1 else "causal"
    q_pos = mx.arange(q_start, q_start + L)[:, None]
    k_pos = mx.arange(q_start + L - K, q_start + L)[None]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return mask


def rotary_dims(head_dim: int, partial_rotary_factor: float, *, source: str = "config.json") -> int:
    """Number of rotated dims `r = head_dim * partial_rotary_factor`; must be even and in (0, head_dim]."""
    dims = int(head_dim * partial_rotary_factor)
    if dims <= 0 or dims > head_dim or dims % 2:
        raise ValueError(
            f"{source}: partial_rotary_factor {partial_rotary_factor} with head_dim {head_dim} gives {dims} "
            "rotary dims; expected an even number in (0, head_dim]"
        )
    return dims


class RoPE(nn.Module):
    """Non-interleaved (rotate-half) RoPE on the first `dims` dims of each head; the rest passes through.

    Frequencies are `base ** (-2i / dims)` for `i < dims / 2`, the Hugging Face `rotate_half` form.
    """

    def __init__(self, dims: int, *, base: float):
        super().__init__()
        self.dims = dims
        self.base = float(base)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        # x: (B, H, L, D); positions offset .. offset + L - 1
        return mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=1.0, offset=offset)


class Float32RMSNorm(nn.RMSNorm):
    """RMSNorm computed in float32 (as the Spark reference does), returned in `dtype`."""

    def __call__(self, x: mx.array, dtype: Optional[mx.Dtype] = None) -> mx.array:
        out = mx.fast.rms_norm(x.astype(mx.float32), self.weight.astype(mx.float32), self.eps)
        return out.astype(dtype or x.dtype)


FINAL_TAP = -2  # not a layer: the final normed hidden state (what the LM head reads), for MTP heads


def check_tap_ids(tap_ids: Sequence[int], num_hidden_layers: int, *, final: bool = False) -> tuple[int, ...]:
    """Validate tapped layer ids: each in [-1, num_hidden_layers - 2] (the last layer is never tapped);
    `final`: the target also records FINAL_TAP."""
    ids = tuple(int(i) for i in tap_ids)
    bad = [i for i in ids if not -1 <= i <= num_hidden_layers - 2 and not (final and i == FINAL_TAP)]
    if bad:
        raise ValueError(
            f"tap ids {bad} are out of range: expected ids in [-1, {num_hidden_layers - 2}] "
            f"for a target with {num_hidden_layers} layers (-1 is the embedding output)"
        )
    return ids


def gather_taps(taps: dict[int, mx.array], tap_ids: Sequence[int], dtype: mx.Dtype) -> Optional[mx.array]:
    """Concatenate the tapped hidden states in the order of `tap_ids` -> (B, L, len(ids) * hidden)."""
    if not tap_ids:
        return None
    return mx.concatenate([taps[i].astype(dtype) for i in tap_ids], axis=-1)


def args_from_config(cls: type, config: dict, *, required: Sequence[str], source: str, family: str) -> Any:
    """A family's `ModelArgs` from a config: its own fields only (unknown keys ignored), required ones
    present; the dataclass's `__post_init__` validates the values."""
    missing = [k for k in required if config.get(k) is None]
    if missing:
        raise ValueError(f"{source}: missing field(s) {missing} for {family}-family layers")
    names = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in config.items() if k in names and k != "source"}, source=source)


def check_rope_default(params: Optional[dict], *, field: str, source: str = "config.json") -> None:
    """Refuse any RoPE scaling: only the default (unscaled) RoPE is implemented."""
    if not params:
        return
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"{source}: {field} has rope_type {kind!r}; only 'default' RoPE (no scaling) is supported")


class FamilyAttention(nn.Module):
    """What both families' attention share: the target's cached causal call and the draft's call over
    given context K/V. A family supplies `project` (queries, keys, values with RoPE from `offset`,
    each (B, heads, L, head_dim)) and `output` (attention result (B, H, L, D) -> hidden)."""

    def __init__(self, args: Any, layer_type: str):
        # args: the family's ModelArgs (head counts, head_dim, `layer_window`, `rope` per layer type)
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.head_dim**-0.5
        self.window = args.layer_window(layer_type)
        self.rope = args.rope(layer_type)

    def project(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array, mx.array]:
        raise NotImplementedError

    def output(self, out: mx.array, x: mx.array) -> mx.array:
        raise NotImplementedError

    def key_values(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Keys (RoPE from `offset`) and values of rows x (B, n, hidden) -> (B, kv_heads, n, head_dim)."""
        _, keys, values = self.project(x, offset)
        return keys, values

    def __call__(self, x: mx.array, cache: Optional[Any] = None) -> mx.array:
        offset = 0 if cache is None else cache.offset  # a packed forward's cache gives one position per row
        queries, keys, values = self.project(x, offset)
        if getattr(cache, "packed", False):  # rows of several sequences side by side (models/packed.py)
            return self.output(cache.attend(self, queries, keys, values), x)
        return self.output(self.cached_attention(queries, keys, values, cache, offset), x)

    def cached_attention(
        self, queries: mx.array, keys: mx.array, values: mx.array, cache: Optional[Any], offset: int
    ) -> mx.array:
        """Attention of L queries at `offset ..` (B, H, L, D) over the cache's keys and their own -> (B, H, L, D)."""
        L = queries.shape[2]
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)  # (B, Hkv, K, D)
        num_keys = (keys[0] if isinstance(keys, tuple) else keys).shape[2]  # a quantized cache returns (w, scales, biases)
        mask = attention_mask(offset, L, num_keys, window=self.window)
        # mlx-lm's call: the fast kernel, or its quantized-KV attention for a QuantizedKVCache
        return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)

    def attend(
        self,
        x: mx.array,
        *,
        offset: int,
        context: Optional[tuple[mx.array, mx.array]],
        mask: Optional[mx.array],
    ) -> mx.array:
        """Rows x at `offset ..` attend to the given context K/V followed by their own, under `mask`
        (None: everything visible); no cache is touched."""
        queries, keys, values = self.project(x, offset)
        if context is not None:
            keys = mx.concatenate([context[0].astype(keys.dtype), keys], axis=2)
            values = mx.concatenate([context[1].astype(values.dtype), values], axis=2)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.output(out, x)
