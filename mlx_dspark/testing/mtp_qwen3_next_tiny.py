"""A tiny random Qwen3-Next target with its MTP layer, in the exact Hugging Face layout (`Qwen3NextForCausalLM`).

What a Qwen3-Next checkpoint holds: `model.embed_tokens`, `model.layers.<i>.*` (GatedDeltaNet `linear_attn.*`
with `conv1d.weight` as (C, 1, K), or gated-q `self_attn.*`, every MLP a sparse MoE with experts one by one,
`mlp.experts.<e>.{gate,up,down}_proj`, a shared expert and its gate), `model.norm`, `lm_head`, the zero-centred
norms stored as w - 1, and the MTP layer `mtp.*`: `fc` [C, 2C], `pre_fc_norm_{embedding,hidden}`, `norm` and
`mtp.layers.0.*` (a full-attention layer with the same MoE MLP). The published configs carry no MTP field
(`mtp_layers` None leaves it out). mlx-lm's own sanitize turns the target into its layout, so loading goes
through the family's real code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np

from mlx_dspark.testing.mlx_lm_checkpoints import _random
from mlx_dspark.testing.tiny import save_hf_weights, write_target_dir
from mlx_dspark.testing.tiny_tokenizer import VOCAB_SIZE

# what mlx-lm's qwen3_next sanitize adds 1 to (raw HF stores w - 1), and the MTP's own zero-centred norms
_OFFSET_NORMS = (
    ".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight", "model.norm.weight",
    "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
)  # fmt: skip  (GatedDeltaNet's gated `linear_attn.norm` is stored as it acts)


def tiny_qwen3_next_config(ids: dict[str, Any], *, mtp_layers: Optional[int] = None, **overrides: Any) -> dict[str, Any]:
    """config.json of a tiny Qwen3-Next target: 4 layers (GatedDeltaNet, attention, x2), 4 experts, top 2."""
    config = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.25,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 2, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "max_position_embeddings": 4096, "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "float32", "transformers_version": "4.57.1",
    }  # fmt: skip
    if mtp_layers is not None:
        config["num_nextn_predict_layers"] = mtp_layers
    config.update(overrides)
    return dict(sorted(config.items()))


def _hf(name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """One mlx-lm tensor -> its HF tensor(s): experts one by one, conv1d (C, 1, K), norms w - 1."""
    if ".mlp.switch_mlp." in name:
        prefix, proj = name.split(".mlp.switch_mlp.")
        return {f"{prefix}.mlp.experts.{e}.{proj}": value[e] for e in range(value.shape[0])}
    if "conv1d.weight" in name:
        value = np.ascontiguousarray(np.moveaxis(value, 2, 1))  # (C, K, 1) -> (C, 1, K)
    if name.endswith(_OFFSET_NORMS) and value.ndim == 1:
        value = value - 1.0
    return {name: value}


def _hf_weights(config: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_next

    from mlx_dspark.models.heads.mtp import qwen3_next as mtp_qwen3_next

    target = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(config))
    mtp = mtp_qwen3_next.MTP(mtp_qwen3_next.mtp_args({**config, "num_nextn_predict_layers": config.get("num_nextn_predict_layers") or 1}))
    out: dict[str, np.ndarray] = {}
    for prefix, module in (("", target), ("mtp.", mtp)):
        for name, p in sorted(tree_flatten(module.parameters())):
            out.update(_hf(prefix + name, _random(rng, name, tuple(p.shape))))
    return out


def write_tiny_qwen3_next_target(path: str | Path, *, seed: int = 0, mtp: bool = True, mtp_layers: Optional[int] = None,
                                 **overrides: Any) -> Path:
    """Write the target (config, HF-layout weights with `mtp.*` unless `mtp` is False, tokenizer) into `path`."""
    path, config = write_target_dir(path, lambda ids: tiny_qwen3_next_config(ids, mtp_layers=mtp_layers, **overrides))
    weights = _hf_weights(config, np.random.default_rng(seed))
    if not mtp:
        weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    save_hf_weights(path, dict(sorted(weights.items())))
    return path
