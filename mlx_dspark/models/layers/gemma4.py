"""Gemma 4 DSpark draft layers, as DeepSpec's `deepspec/modeling/dspark/gemma4/modeling.py` defines them.

A draft layer family only (Gemma 4 targets run through the generic mlx-lm target): `ModelArgs` reads
the draft's config (a copy of the target's `Gemma4TextConfig` plus the DSpark fields), `Attention`,
`MLP` and `Norm` build `models/dspark.DecoderLayer`. Where Gemma's draft differs from the qwen3-style one:

- every draft layer is a global layer: `global_head_dim`, `full_attention` RoPE (proportional: the
  first `partial_rotary_factor` of the rotate-half pairs turn, at `theta ** (-2i / head_dim)`), no window;
- softmax scale 1 (q_norm / k_norm carry it); values pass a scale-free RMSNorm (`v_norm`);
  `attention_k_eq_v`: no `v_proj`, values are the raw `k_proj` output (before `k_norm`), over
  `num_global_key_value_heads`;
- sandwich norms: `post_attention_layernorm` on the attention output, `pre_feedforward_layernorm` /
  `post_feedforward_layernorm` around the MLP, the block's output times `layer_scalar` (`SANDWICH_NORMS`);
- RMSNorm without Gemma 3's +1 offset (`Gemma4RMSNorm`: `x * rsqrt(mean(x^2) + eps) * weight`);
- GELU-tanh MLP (`hidden_activation`), the block's token embeddings times sqrt(hidden_size)
  (`embedding_scale`), base logits soft-capped `tanh(z / c) * c` before the Markov bias
  (`final_logit_softcapping`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import ProportionalRoPE

from mlx_dspark.models.layers.base import FamilyAttention, RoPE, args_from_config, gelu
from mlx_dspark.models.layers.layer_types import FULL_ATTENTION, check_layer_types
from mlx_dspark.models.layers.qwen3 import MLP  # noqa: F401  (the same gated MLP; `args.activation()` picks GELU-tanh)

# Tensors that all mark a draft layer of this family (qwen3-style layers have only the first).
DRAFT_MARKS = ("self_attn.q_proj.weight", "pre_feedforward_layernorm.weight")
ATTENTION_TENSOR = DRAFT_MARKS[1]
# The draft layer's residual form (models/dspark.DecoderLayer): norms after attention and MLP, a scalar.
SANDWICH_NORMS = True
_ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": gelu, "silu": nn.silu}
_REQUIRED = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size", "rope_parameters")

Norm = nn.RMSNorm


class ScalelessNorm(nn.Module):
    """`Gemma4RMSNorm(with_scale=False)`: the values' norm, no weight."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, None, self.eps)


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rope_parameters: dict
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    global_head_dim: Optional[int] = None
    num_global_key_value_heads: Optional[int] = None
    attention_k_eq_v: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: Optional[float] = None
    layer_types: Optional[list] = None
    use_double_wide_mlp: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    hidden_size_per_layer_input: Optional[int] = 0
    tie_word_embeddings: bool = False
    model_type: str = "gemma4_text"
    source: str = field(default="config.json", repr=False)

    @classmethod
    def from_dict(cls, config: dict, *, source: str = "config.json") -> "ModelArgs":
        return args_from_config(cls, config, required=_REQUIRED, source=source, family="gemma4")

    def __post_init__(self):
        src = self.source
        # DeepSpec asserts these away (its prototype has neither); so do we, by name.
        if self.enable_moe_block:
            raise ValueError(f"{src}: enable_moe_block is true; Gemma 4 DSpark draft layers have no MoE block")
        if self.hidden_size_per_layer_input:
            raise ValueError(
                f"{src}: hidden_size_per_layer_input is {self.hidden_size_per_layer_input}; Gemma 4 DSpark draft layers "
                "have no per-layer input gates (expected 0)"
            )
        if self.use_double_wide_mlp and 0 < self.num_kv_shared_layers < self.num_hidden_layers:
            raise ValueError(f"{src}: use_double_wide_mlp with num_kv_shared_layers {self.num_kv_shared_layers}: double-wide draft MLPs are not supported")
        if self.hidden_activation not in _ACTIVATIONS:
            raise ValueError(f"{src}: hidden_activation {self.hidden_activation!r} is not supported; expected one of {sorted(_ACTIVATIONS)}")
        cap = self.final_logit_softcapping
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
            raise ValueError(f"{src}: final_logit_softcapping must be a positive number, got {cap!r}")
        if self.layer_types is None:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers, source=src)
        if any(t != FULL_ATTENTION for t in self.layer_types):
            raise ValueError(f"{src}: layer_types {self.layer_types}: every Gemma 4 DSpark draft layer is a full_attention layer")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.global_head_dim = self.global_head_dim or self.head_dim or self.hidden_size // self.num_attention_heads
        # DeepSpec's draft attention: the global head size, and the global KV heads with k_eq_v
        if self.attention_k_eq_v and self.num_global_key_value_heads is None:
            raise ValueError(f"{src}: attention_k_eq_v is true but num_global_key_value_heads is missing")
        self.draft_kv_heads = self.num_global_key_value_heads if self.attention_k_eq_v else self.num_key_value_heads
        if self.num_attention_heads % self.draft_kv_heads:
            raise ValueError(f"{src}: num_attention_heads {self.num_attention_heads} is not a multiple of the {self.draft_kv_heads} key/value heads")
        self.window = None
        self._rope = self._read_rope()

    def _read_rope(self) -> tuple[str, float, float]:
        params = self.rope_parameters.get(FULL_ATTENTION) if isinstance(self.rope_parameters, dict) else None
        if not isinstance(params, dict) or params.get("rope_theta") is None:
            raise ValueError(f"{self.source}: field 'rope_parameters.full_attention.rope_theta' is missing")
        kind = params.get("rope_type", "default")
        if kind not in ("default", "proportional"):
            raise ValueError(f"{self.source}: rope_parameters.full_attention has rope_type {kind!r}; expected 'default' or 'proportional'")
        if params.get("factor", 1.0) != 1.0 and kind == "default":
            raise ValueError(f"{self.source}: rope_parameters.full_attention.factor is only read for proportional RoPE")
        return kind, float(params["rope_theta"]), float(params.get("partial_rotary_factor", 1.0))

    @property
    def embedding_scale(self) -> float:
        """The block's token embeddings times this (`Gemma4TextScaledWordEmbedding`)."""
        return self.hidden_size**0.5

    def layer_window(self, layer_type: str) -> Optional[int]:
        return None

    def rope(self, layer_type: str) -> nn.Module:
        kind, theta, factor = self._rope
        dims = self.global_head_dim
        if kind == "default":  # transformers' default RoPE turns the whole head
            return RoPE(dims, base=theta)
        scale = float(self.rope_parameters[FULL_ATTENTION].get("factor", 1.0))
        # transformers: int(factor * head_dim // 2) turning pairs; mlx-lm's class takes twice that in dims
        return ProportionalRoPE(dims, 2 * int(factor * dims // 2), base=theta, factor=scale)

    def activation(self):
        return _ACTIVATIONS[self.hidden_activation]


class Attention(FamilyAttention):
    def __init__(self, args: ModelArgs, layer_type: str):
        nn.Module.__init__(self)
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.draft_kv_heads, args.global_head_dim
        self.scale = 1.0
        self.window = None
        self.rope = args.rope(layer_type)
        dim, head_dim, bias = args.hidden_size, self.head_dim, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        if not args.attention_k_eq_v:
            self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.q_norm = Norm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = Norm(head_dim, eps=args.rms_norm_eps)
        self.v_norm = ScalelessNorm(args.rms_norm_eps)
        self.k_eq_v = args.attention_k_eq_v

    def key_values(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        raw_keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        raw_values = raw_keys if self.k_eq_v else self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        keys = self.k_norm(raw_keys).transpose(0, 2, 1, 3)
        values = self.v_norm(raw_values).transpose(0, 2, 1, 3)
        return self.rope(keys, offset), values

    def project(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array, mx.array]:
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        return (self.rope(queries, offset), *self.key_values(x, offset))

    def output(self, out: mx.array, x: mx.array) -> mx.array:
        B, _, L, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

