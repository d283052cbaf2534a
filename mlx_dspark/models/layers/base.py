"""Model pieces shared by the draft layer families and the target adapter: partial-rotary RoPE, GELU,
tap checks, the draft attention's call over given context K/V."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

# Exact (erf) GELU, as the reference's `ACT2FN["gelu"]`; never the tanh approximation.
gelu = nn.gelu


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


FINAL_TAP = -2  # not a layer: the final normed hidden state (what the LM head reads), for heads that read it


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
    """What the draft layer families' attention share: the call over given context K/V. A family supplies
    `project` (queries, keys, values with RoPE from `offset`, each (B, heads, L, head_dim)) and `output`
    (attention result (B, H, L, D) -> hidden)."""

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
