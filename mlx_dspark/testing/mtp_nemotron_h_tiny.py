"""A tiny random Nemotron-H target with its MTP block, in the exact Hugging Face layout (`NemotronHForCausalLM`).

What a Nemotron 3 checkpoint holds: `backbone.embeddings`, `backbone.layers.<i>.{norm, mixer.*}` (Mamba-2 with
`conv1d.weight` as (C, 1, K), attention, MoE with experts one by one `mixer.experts.<e>.{up,down}_proj`, a
sigmoid router `mixer.gate.{weight, e_score_correction_bias}` and `mixer.shared_experts.*`), `backbone.norm_f`,
`lm_head`, and the MTP block `mtp.layers.<j>.*`: layer 0 with `enorm`, `hnorm`, `eh_proj` [C, 2C], the last with
`final_layernorm`, each a Nemotron-H block of the kind `mtp_layers_block_type` names. Norms are stored as they
act. The names are mlx-lm's nemotron_h model's (HF's) with its sanitize undone (experts, conv axis).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mlx_dspark.testing.mlx_lm_checkpoints import _random
from mlx_dspark.testing.tiny import save_hf_weights, write_target_dir
from mlx_dspark.testing.tiny_tokenizer import VOCAB_SIZE

_EXPERT_NAMES = {"fc1": "up_proj", "fc2": "down_proj"}  # mlx-lm's stacked name -> HF's per-expert name


def tiny_nemotron_h_config(ids: dict[str, Any], *, mtp_layers: int = 1, **overrides: Any) -> dict[str, Any]:
    """config.json of a tiny Nemotron-H target: Mamba-2, attention, Mamba-2, MoE (4 experts, top 2, a shared
    expert); the MTP block [attention, moe] when `mtp_layers` is 1."""
    config = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "hybrid_override_pattern": "M*ME",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False,
        "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4,
        "n_groups": 2, "use_conv_bias": True, "mlp_bias": False, "use_bias": False, "layer_norm_epsilon": 1e-5,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
        "moe_shared_expert_intermediate_size": 32, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "num_nextn_predict_layers": mtp_layers, "mtp_layers_block_type": ["attention", "moe"],
        "torch_dtype": "float32", "transformers_version": "4.57.1",
    }  # fmt: skip
    config.update(overrides)
    return dict(sorted(config.items()))


def _hf(name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """One mlx-lm tensor -> its HF tensor(s): experts one by one, conv1d (C, 1, K)."""
    if ".mixer.switch_mlp." in name:
        prefix, rest = name.split(".mixer.switch_mlp.")
        proj = _EXPERT_NAMES[rest.split(".")[0]]
        return {f"{prefix}.mixer.experts.{e}.{proj}.weight": value[e] for e in range(value.shape[0])}
    if "conv1d.weight" in name:
        value = np.ascontiguousarray(np.moveaxis(value, 2, 1))  # (C, K, 1) -> (C, 1, K)
    return {name: value}


def _hf_weights(config: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    from mlx.utils import tree_flatten
    from mlx_lm.models import nemotron_h

    from mlx_dspark.models.heads.mtp import nemotron_h as mtp_nemotron_h

    modules = [("", nemotron_h.Model(nemotron_h.ModelArgs.from_dict(config)))]
    if config.get("num_nextn_predict_layers"):
        modules.append(("mtp.", mtp_nemotron_h.MTP(mtp_nemotron_h.NemotronHMTPArgs.from_dict(config))))
    out: dict[str, np.ndarray] = {}
    for prefix, module in modules:
        for name, p in sorted(tree_flatten(module.parameters())):
            out.update(_hf(prefix + name, _random(rng, name, tuple(p.shape))))
    return out


def write_tiny_nemotron_h_target(path: str | Path, *, seed: int = 0, mtp: bool = True, **overrides: Any) -> Path:
    """Write the target (config, HF-layout weights with `mtp.layers.*` unless `mtp` is False, tokenizer) into `path`."""
    path, config = write_target_dir(path, lambda ids: tiny_nemotron_h_config(ids, **overrides))
    weights = _hf_weights(config, np.random.default_rng(seed))
    if not mtp:
        weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    save_hf_weights(path, dict(sorted(weights.items())))
    return path
