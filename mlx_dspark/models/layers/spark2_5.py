"""Spark2_5-style DSpark draft layers (Spark-X2.5 / X2.6): fused QKV, head-wise sigmoid output gate, GELU MLP.

Layers are sliding or full attention (`layer_types`), each type with its own `rope_parameters`
(theta and a partial rotary factor). As the reference, the residual stream, the norms and the gate are
computed in float32 and the projections in the weights' dtype (`compute dtype`, the embedding's).
`ModelArgs`, `Attention`, `MLP`, `Norm` build `models/dspark.DecoderLayer`; a spark2_5 target is mlx-lm's
class (`models/target/spark2_5.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.models.layers.layer_types import SLIDING_ATTENTION, check_layer_types
from mlx_dspark.models.layers.base import (
    FamilyAttention,
    Float32RMSNorm,
    RoPE,
    args_from_config,
    check_rope_default,
    gelu,
    rotary_dims,
)

# As mlx-lm's spark2_5: the tiny per-head gate stays in source precision when quantizing.
KEEP_IN_SOURCE_PRECISION = ("self_attn.g_proj",)
# The tensor that marks a layer of this family (a draft's layer family is read from its tensors).
ATTENTION_TENSOR = "self_attn.q_k_v_proj.weight"
Norm = Float32RMSNorm

_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "layer_types",
    "rope_parameters",
)


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    layer_types: list
    rope_parameters: dict
    sliding_window: Optional[int] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "gelu"
    gate_attn_act_mode: str = "sigmoid"
    headwise_attn_output_gate: bool = True
    rope_scaling: Optional[dict] = None
    model_type: str = "spark2_5"
    source: str = field(default="config.json", repr=False)

    @classmethod
    def from_dict(cls, config: dict, *, source: str = "config.json") -> "ModelArgs":
        return args_from_config(cls, config, required=_REQUIRED, source=source, family="spark2_5")

    def __post_init__(self):
        src = self.source
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers, source=src)
        missing = sorted(set(self.layer_types) - set(self.rope_parameters or {}))
        if missing:
            raise ValueError(f"{src}: rope_parameters has no entry for layer type(s) {missing}")
        check_rope_default(self.rope_scaling, field="rope_scaling", source=src)
        for layer_type in set(self.layer_types):
            params = self.rope_parameters[layer_type]
            check_rope_default(params, field=f"rope_parameters.{layer_type}", source=src)
            if "rope_theta" not in params:
                raise ValueError(f"{src}: rope_parameters.{layer_type} has no 'rope_theta'")
            rotary_dims(self.head_dim, params.get("partial_rotary_factor", 1.0), source=f"{src}: rope_parameters.{layer_type}")
        if SLIDING_ATTENTION in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"{src}: sliding_window must be a positive integer with sliding layers, got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{src}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.hidden_act != "gelu":
            raise ValueError(f"{src}: hidden_act {self.hidden_act!r} is not supported; Spark2_5 uses 'gelu' (exact)")
        if self.gate_attn_act_mode != "sigmoid":
            raise ValueError(f"{src}: gate_attn_act_mode {self.gate_attn_act_mode!r} is not supported; expected 'sigmoid'")
        if not self.headwise_attn_output_gate:
            raise ValueError(f"{src}: headwise_attn_output_gate is false; only the gated Spark2_5 layout is supported")

    @property
    def window(self) -> Optional[int]:
        return self.sliding_window if SLIDING_ATTENTION in self.layer_types else None

    def layer_window(self, layer_type: str) -> Optional[int]:
        return self.sliding_window if layer_type == SLIDING_ATTENTION else None

    def effective_layer_types(self) -> list[str]:
        return list(self.layer_types)

    def rope(self, layer_type: str) -> RoPE:
        params = self.rope_parameters[layer_type]
        dims = rotary_dims(self.head_dim, params.get("partial_rotary_factor", 1.0))
        return RoPE(dims, base=params["rope_theta"])


class Attention(FamilyAttention):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__(args, layer_type)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_k_v_proj = nn.Linear(args.hidden_size, q_size + 2 * kv_size, bias=args.attention_bias)
        self.g_proj = nn.Linear(args.hidden_size, self.n_heads, bias=args.attention_bias)
        self.out_proj = nn.Linear(q_size, args.hidden_size, bias=args.attention_bias)

    def project(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array, mx.array]:
        # Fused rows: Q (heads x head_dim), then K, then V.
        B, L, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        queries, keys, values = mx.split(self.q_k_v_proj(x), [q_size, q_size + kv_size], axis=-1)
        queries = queries.reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return self.rope(queries, offset), self.rope(keys, offset), values

    def output(self, out: mx.array, x: mx.array) -> mx.array:
        # Head-wise sigmoid gate from the layer's (normed) input, in float32, before out_proj.
        B, _, L, _ = out.shape
        out = out.transpose(0, 2, 1, 3)  # (B, L, H, D)
        gate = mx.sigmoid(self.g_proj(x).astype(mx.float32)).astype(out.dtype)  # (B, L, H)
        return self.out_proj((out * gate[..., None]).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gelu(self.gate_proj(x)) * self.up_proj(x))


