"""Qwen3-style DSpark draft layers: q/k RMSNorm per head before RoPE, SwiGLU MLP, optional sliding layers.

`ModelArgs`, `Attention`, `MLP`, `Norm` build `models/dspark.DecoderLayer`; a qwen3 target is mlx-lm's
own class (`models/target/mlx_lm.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.models.layers.layer_types import FULL_ATTENTION, LAYER_TYPES, SLIDING_ATTENTION, check_layer_types
from mlx_dspark.models.layers.base import FamilyAttention, RoPE, args_from_config, check_rope_default, gelu, rotary_dims

# The tensor that marks a layer of this family (a draft's layer family is read from its tensors).
ATTENTION_TENSOR = "self_attn.q_proj.weight"
# as transformers' Qwen3MLP reads ACT2FN[hidden_act] ("gelu" exact, "gelu_pytorch_tanh" the tanh form)
_ACTIVATIONS = {"silu": nn.silu, "gelu": gelu, "gelu_pytorch_tanh": nn.gelu_approx}
_REQUIRED = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")

Norm = nn.RMSNorm


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
    use_sliding_window: Optional[bool] = None
    sliding_window: Optional[int] = None
    max_window_layers: Optional[int] = None
    layer_types: Optional[list] = None
    model_type: str = "qwen3"
    source: str = field(default="config.json", repr=False)

    @classmethod
    def from_dict(cls, config: dict, *, source: str = "config.json") -> "ModelArgs":
        return args_from_config(cls, config, required=_REQUIRED, source=source, family="qwen3")

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
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"{src}: hidden_act {self.hidden_act!r} is not supported; expected one of {sorted(_ACTIVATIONS)}")
        # The window, in one place for targets and drafts. transformers' Qwen3Config (which always
        # writes use_sliding_window) applies it only with use_sliding_window. Without that field the
        # config was not written by Qwen3Config (e.g. a spark2_5 config copied into a qwen3-style
        # draft): then an explicit layer_types decides, as DSPARK.md section 3 and spark2_5 read it.
        windowed = self.layer_types is not None if self.use_sliding_window is None else self.use_sliding_window
        window = self.sliding_window if windowed else None
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"{src}: sliding_window must be an integer >= 1, got {window!r}")
        if self.layer_types is None:
            # transformers' default: sliding from max_window_layers on, when a window applies
            first_sliding = self.num_hidden_layers if self.max_window_layers is None else self.max_window_layers
            self.layer_types = [
                SLIDING_ATTENTION if window is not None and i >= first_sliding else FULL_ATTENTION
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers, source=src)
        self.window = window
        self.rope_by_type = self._read_rope()

    def _read_rope(self) -> dict[str, tuple[float, int]]:
        """Layer type -> (theta, rotary dims). One RoPE for every layer (`rope_theta`, or a flat
        `rope_parameters`), or one per layer type when `rope_parameters` is keyed by layer type (as
        transformers' rope utilities read it; a spark2_5 config copied into a draft is written so)."""
        src = self.source
        check_rope_default(self.rope_scaling, field="rope_scaling", source=src)
        params = self.rope_parameters or {}
        if any(t in params for t in LAYER_TYPES):
            rope = {}
            for layer_type in sorted(set(self.layer_types)):
                entry = params.get(layer_type)
                if not isinstance(entry, dict) or entry.get("rope_theta") is None:
                    raise ValueError(f"{src}: field 'rope_parameters.{layer_type}.rope_theta' is missing")
                check_rope_default(entry, field=f"rope_parameters.{layer_type}", source=src)
                factor = float(entry.get("partial_rotary_factor", 1.0))
                rope[layer_type] = (float(entry["rope_theta"]), rotary_dims(self.head_dim, factor, source=src))
            return rope
        check_rope_default(params, field="rope_parameters", source=src)
        if self.rope_theta is None:
            self.rope_theta = params.get("rope_theta")
        if self.rope_theta is None:
            raise ValueError(f"{src}: field 'rope_theta' (or 'rope_parameters.rope_theta') is missing")
        dims = rotary_dims(self.head_dim, float(params.get("partial_rotary_factor", 1.0)), source=src)
        return {t: (float(self.rope_theta), dims) for t in LAYER_TYPES}

    def layer_window(self, layer_type: str) -> Optional[int]:
        return self.window if layer_type == SLIDING_ATTENTION else None

    def effective_layer_types(self) -> list[str]:
        """Layer types as computed: a sliding entry without an active window is full attention."""
        return [t if self.window is not None else FULL_ATTENTION for t in self.layer_types]

    def rope(self, layer_type: str) -> RoPE:
        theta, dims = self.rope_by_type[layer_type]
        return RoPE(dims, base=theta)

    def activation(self):
        return _ACTIVATIONS[self.hidden_act]


class Attention(FamilyAttention):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__(args, layer_type)
        dim, head_dim, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)

    def key_values(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(keys, offset), values

    def project(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array, mx.array]:
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        return (self.rope(queries, offset), *self.key_values(x, offset))

    def output(self, out: mx.array, x: mx.array) -> mx.array:
        B, _, L, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.act = args.activation()

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


