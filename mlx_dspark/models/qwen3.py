"""Qwen3ForCausalLM target: q/k RMSNorm per head before RoPE, SwiGLU MLP, tied or untied head.

Numerically the same as `mlx_lm.models.qwen3`; this one also honours sliding layers, rolls back its
caches and returns the tapped features the DSpark draft is conditioned on.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.cache import make_target_cache
from mlx_dspark.models.base import (
    FULL_ATTENTION,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    RoPE,
    attention_mask,
    check_rope_default,
    check_tap_ids,
    gather_taps,
)


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    rope_theta: Optional[float] = None
    rope_scaling: Optional[dict] = None
    rope_parameters: Optional[dict] = None
    use_sliding_window: bool = False
    sliding_window: Optional[int] = None
    max_window_layers: Optional[int] = None
    layer_types: Optional[list] = None
    model_type: str = "qwen3"
    source: str = field(default="config.json", repr=False)

    @classmethod
    def from_dict(cls, config: dict, *, source: str = "config.json") -> "ModelArgs":
        names = inspect.signature(cls).parameters
        missing = [k for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size") if k not in config]
        if missing:
            raise ValueError(f"{source}: missing field(s) {missing} for a Qwen3ForCausalLM target")
        return cls(**{k: v for k, v in config.items() if k in names and k != "source"}, source=source)

    def __post_init__(self):
        src = self.source
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{src}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"{src}: hidden_act {self.hidden_act!r} is not supported; Qwen3 uses 'silu'")
        check_rope_default(self.rope_scaling, field="rope_scaling", source=src)
        check_rope_default(self.rope_parameters, field="rope_parameters", source=src)
        if self.rope_theta is None:
            self.rope_theta = (self.rope_parameters or {}).get("rope_theta")
        if self.rope_theta is None:
            raise ValueError(f"{src}: field 'rope_theta' (or 'rope_parameters.rope_theta') is missing")
        # As transformers' Qwen3Config: the window applies only with use_sliding_window.
        window = self.sliding_window if self.use_sliding_window else None
        if self.layer_types is None:
            first_sliding = self.num_hidden_layers if self.max_window_layers is None else self.max_window_layers
            self.layer_types = [
                SLIDING_ATTENTION if window is not None and i >= first_sliding else FULL_ATTENTION
                for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"{src}: layer_types has {len(self.layer_types)} entries; expected num_hidden_layers = {self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"{src}: layer_types has unknown entries {unknown}; expected {list(LAYER_TYPES)}")
        if window is not None and window < 1:
            raise ValueError(f"{src}: sliding_window must be >= 1, got {window}")
        self.window = window

    def effective_layer_types(self) -> list[str]:
        """Layer types as computed: a sliding entry without an active window is full attention."""
        return [t if self.window is not None else FULL_ATTENTION for t in self.layer_types]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, *, window: Optional[int]):
        super().__init__()
        dim, head_dim = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = head_dim**-0.5
        self.window = window
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.rope = RoPE(head_dim, base=args.rope_theta)

    def __call__(self, x: mx.array, cache: Optional[Any] = None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = 0 if cache is None else cache.offset
        queries = self.rope(queries, offset)  # (B, H, L, D)
        keys = self.rope(keys, offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)  # (B, Hkv, K, D)
        mask = attention_mask(offset, L, keys.shape[2], window=self.window)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, *, window: Optional[int]):
        super().__init__()
        self.self_attn = Attention(args, window=window)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: Optional[Any] = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            DecoderLayer(args, window=args.window if t == SLIDING_ATTENTION else None)
            for t in args.effective_layer_types()
        ]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Qwen3Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    @property
    def layer_types(self) -> list[str]:
        return self.args.effective_layer_types()

    def make_cache(self, *, max_rollback: int = 8) -> list[Any]:
        return make_target_cache(self.layer_types, window=self.args.window, max_rollback=max_rollback)

    def embed(self, ids: mx.array) -> mx.array:
        return self.model.embed_tokens(ids)

    def lm_head_logits(self, h: mx.array) -> mx.array:
        """Logits from final-normed hidden states; works for tied, untied and quantized heads."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(
        self,
        inputs: mx.array,
        cache: Optional[list[Any]] = None,
        *,
        tap_ids: tuple[int, ...] = (),
        last_only: bool = False,
    ) -> tuple[mx.array, Optional[mx.array]]:
        tap_ids = check_tap_ids(tap_ids, self.args.num_hidden_layers)
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} caches (one per layer), got {len(cache)}")
        h = self.embed(inputs)  # (B, L, hidden)
        taps = {-1: h}
        for i, layer in enumerate(self.layers):
            h = layer(h, None if cache is None else cache[i])
            if i in tap_ids:
                taps[i] = h
        features = gather_taps(taps, tap_ids, h.dtype)
        if last_only:
            h = h[:, -1:]
        return self.lm_head_logits(self.model.norm(h)), features

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights
