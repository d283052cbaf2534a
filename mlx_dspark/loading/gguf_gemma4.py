"""A Gemma 4 DSpark draft as upstream llama.cpp writes it (`conversion/gemma.py` `Gemma4DSparkModel`,
read by `src/models/dflash.cpp` through its optional Gemma tensors): the `dflash` architecture with

- `blk.N.post_attention_norm` (post_attention_layernorm), `blk.N.ffn_norm` (pre_feedforward_layernorm:
  a qwen3-style layer's `ffn_norm` is its post_attention_layernorm), `blk.N.post_ffw_norm`
  (post_feedforward_layernorm), `blk.N.layer_output_scale` (layer_scalar);
- no `attn_v` (`attention_k_eq_v`: the values are the raw keys, RMS-normed without a weight; the
  converter refuses other Gemma drafts, and upstream's graph would give `attn_v` no norm);
- `attention.key_length` = `global_head_dim`, `attention.head_count_kv` = `num_global_key_value_heads`,
  `rope.dimension_count` = the whole head, `rope_freqs` (1 for the turning pairs, 1e30 for the rest:
  proportional RoPE) or none (default RoPE), `embedding_scale` = sqrt(hidden) and `attention.scale` = 1
  (our gemma4 layers apply both themselves), `hidden_activation` = `gelu_pytorch_tanh`;
- no logit softcap (the converter refuses one; upstream's DSpark graph would not apply it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mlx_dspark.loading.gguf_metadata import Metadata

# A layer carrying any of these is a Gemma 4 draft layer (qwen3-style layers carry none).
MARKS = ("post_attention_norm", "post_ffw_norm", "layer_output_scale")
LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
ROPE_FREQS = "rope_freqs.weight"
_FAR = 1e29  # upstream's 1e30 divisor: a pair that does not turn


def is_gemma4_draft(meta: Metadata) -> bool:
    return any(f"blk.0.{mark}.weight" in meta.tensors for mark in MARKS)


def layer_names(num_layers: int) -> dict[str, str]:
    names = {}
    for i in range(num_layers):
        names.update({f"blk.{i}.{g}.weight": f"layers.{i}.{h}.weight" for g, h in LAYER.items()})
        names[f"blk.{i}.layer_output_scale.weight"] = f"layers.{i}.layer_scalar"
    return names


def _rope(meta: Metadata, p: str, head_dim: int) -> dict[str, Any]:
    theta = meta.number(p + "rope.freq_base")
    dims = meta.integer(p + "rope.dimension_count", head_dim, low=1)
    if dims != head_dim:
        raise ValueError(f"{meta.path}: key {p + 'rope.dimension_count'!r} is {dims}; a Gemma 4 draft ropes its whole head ({head_dim})")
    if ROPE_FREQS not in meta.tensors:
        return {"rope_type": "default", "rope_theta": theta}
    factors = np.asarray(meta.tensors[ROPE_FREQS].data, dtype=np.float64).reshape(-1)
    turning = int(np.sum(factors == 1.0))
    if factors.size != head_dim // 2 or not (np.all(factors[:turning] == 1.0) and np.all(factors[turning:] >= _FAR)) or turning == 0:
        raise ValueError(
            f"{meta.path}: tensor {ROPE_FREQS!r} is not proportional RoPE (1 for the first pairs, 1e30 for the rest of "
            f"{head_dim // 2}); other frequency factors are not supported for Gemma 4 drafts"
        )
    return {"rope_type": "proportional", "rope_theta": theta, "partial_rotary_factor": 2 * turning / head_dim}


def fields(meta: Metadata, p: str, sizes: dict[str, Any], layer_types: list[str]) -> dict[str, Any]:
    """The gemma4 layer family's config fields of the file (DeepSpec's Gemma4TextConfig names)."""
    if "blk.0.attn_v.weight" in meta.tensors:
        raise ValueError(
            f"{meta.path}: tensor 'blk.0.attn_v.weight' in a Gemma 4 draft: upstream's converter writes only attention_k_eq_v "
            "drafts (values = keys) and its graph gives attn_v no v_norm while DeepSpec's has one; not supported"
        )
    cap = meta.number(p + "final_logit_softcapping", None)
    if cap:
        raise ValueError(f"{meta.path}: key {p + 'final_logit_softcapping'!r} is {cap:g}; upstream's Gemma 4 DSpark converter refuses a softcap")
    hidden, head_dim = sizes["hidden_size"], sizes["head_dim"]
    scale = meta.number(p + "embedding_scale", None)
    if scale is None or not math.isclose(scale, math.sqrt(hidden), rel_tol=1e-5):
        raise ValueError(f"{meta.path}: key {p + 'embedding_scale'!r} is {scale}; a Gemma 4 draft scales its embeddings by sqrt({hidden})")
    attention_scale = meta.number(p + "attention.scale", None)
    if attention_scale != 1.0:
        raise ValueError(f"{meta.path}: key {p + 'attention.scale'!r} is {attention_scale}; a Gemma 4 draft attends with scale 1")
    return {
        "model_type": "gemma4_text",
        "global_head_dim": head_dim,
        "num_global_key_value_heads": sizes["num_key_value_heads"],
        "attention_k_eq_v": True,
        "hidden_activation": meta.get(p + "hidden_activation", "silu"),  # upstream: absent = SiLU
        "rope_parameters": {"full_attention": _rope(meta, p, head_dim)},
        "layer_types": layer_types,
        "final_logit_softcapping": None,
    }


def drop_family_scales(config: dict[str, Any]) -> None:
    """The embedding and attention scales the file carries are the gemma4 layers' own: not packaging."""
    config.pop("input_embedding_scale", None)
    config.pop("attention_scale", None)
