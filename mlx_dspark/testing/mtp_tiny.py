"""A tiny random Qwen3.5 target with its own MTP layers, in the exact Hugging Face layout.

What a Hugging Face `Qwen3_5ForConditionalGeneration` checkpoint holds (text part): the language model
under `model.language_model.*`, `lm_head.weight`, GatedDeltaNet `conv1d.weight` as (C, 1, K), the
zero-centred RMSNorm weights stored as w - 1, and the 15 `mtp.*` tensors of one MTP layer (`mtp.fc`
[C, 2C], `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.layers.0.*` a full-attention layer with gated q,
`mtp.norm`), their norms zero-centred too. `config.json` carries `text_config.mtp_num_hidden_layers`.
`family="qwen3_5_moe"` writes a Qwen3.5-MoE one (`Qwen3_5MoeForConditionalGeneration`): every MLP, the MTP
layer's too, a sparse MoE with its experts fused as Hugging Face stores them (`mlp.experts.gate_up_proj`
(E, 2I, C), gate rows first, and `mlp.experts.down_proj` (E, C, I)), `mlp.gate`, `mlp.shared_expert.*`,
`mlp.shared_expert_gate`.
mlx-lm's own `sanitize` turns the language model into its layout (and drops `mtp.*`), so loading goes
through the family's real code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mlx_dspark.testing.mlx_lm_checkpoints import _random, tiny_mlx_lm_config
from mlx_dspark.testing.tiny import save_hf_weights, write_target_dir

# mlx-lm's qwen3_5 sanitize adds 1 to these (raw HF checkpoints store w - 1)
_TARGET_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight", ".k_norm.weight")


def tiny_qwen3_5_mtp_config(ids: dict[str, Any], *, family: str = "qwen3_5", mtp_layers: int = 1, **text: Any) -> dict[str, Any]:
    """config.json of a tiny qwen3_5 (or qwen3_5_moe) target (2 GatedDeltaNet + 2 attention layers) declaring
    MTP layers; `text` replaces text_config fields (vocab_size, hidden_size, ...)."""
    config = tiny_mlx_lm_config(family, ids)
    config["text_config"].update(mtp_num_hidden_layers=mtp_layers, mtp_use_dedicated_embeddings=False, **text)
    return config


def _fused_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """mlx-lm's stacked `switch_mlp` back to Hugging Face's fused experts (the inverse of its qwen3_5_moe sanitize)."""
    out = {k: v for k, v in weights.items() if ".switch_mlp." not in k}
    for key in [k for k in weights if k.endswith(".switch_mlp.gate_proj.weight")]:
        mlp = key[: -len(".switch_mlp.gate_proj.weight")]
        up, down = weights[f"{mlp}.switch_mlp.up_proj.weight"], weights[f"{mlp}.switch_mlp.down_proj.weight"]
        out[f"{mlp}.experts.gate_up_proj"] = np.concatenate([weights[key], up], axis=-2)
        out[f"{mlp}.experts.down_proj"] = down
    return out


def _target_weights(config: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    out = {}
    for name, p in sorted(tree_flatten(model.parameters())):
        value = _random(rng, name, tuple(p.shape))
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        elif name == "language_model.lm_head.weight":
            name = "lm_head.weight"
        if "conv1d.weight" in name:
            value = np.ascontiguousarray(np.moveaxis(value, 1, 2))  # mlx-lm's (C, K, 1) -> HF's (C, 1, K)
        if name.endswith(_TARGET_OFFSET_NORMS) and value.ndim == 1:
            value = value - 1.0
        out[name] = value
    return _fused_experts(out)


def _mtp_weights(config: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    from mlx.utils import tree_flatten

    from mlx_dspark.models.heads.mtp.qwen3_5 import MTP, OFFSET_NORMS, MTPArgs

    module = MTP(MTPArgs.from_dict(config))
    out = {}
    for name, p in sorted(tree_flatten(module.parameters())):
        value = _random(rng, name, tuple(p.shape))
        if name.endswith(OFFSET_NORMS) and value.ndim == 1:
            value = value - 1.0
        out["mtp." + name] = value
    return _fused_experts(out)


def write_tiny_qwen3_5_mtp_target(path: str | Path, *, seed: int = 0, mtp: bool = True, family: str = "qwen3_5", **text: Any) -> Path:
    """Write the target (config, HF-layout weights with `mtp.*` unless `mtp` is False, tokenizer) into `path`."""
    path, config = write_target_dir(path, lambda ids: tiny_qwen3_5_mtp_config(ids, family=family, **text))
    rng = np.random.default_rng(seed)
    weights = _target_weights(config, rng)
    if mtp:
        weights.update(_mtp_weights(config, rng))
    save_hf_weights(path, dict(sorted(weights.items())))
    return path
