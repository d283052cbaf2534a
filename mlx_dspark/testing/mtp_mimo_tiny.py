"""Tiny random MiMo targets with their MTP layers, in the exact Hugging Face layout (`MiMoForCausalLM`).

What a MiMo-7B checkpoint holds: a Qwen2 model (`model.embed_tokens`, `model.layers.<i>.*` with biased
q/k/v projections, `model.norm`, `lm_head`) and `num_nextn_predict_layers` MTP layers
`model.mtp_layers.<i>.*`: `token_layernorm`, `hidden_layernorm`, `input_proj` [C, 2C], `final_layernorm`
and, under the same prefix, one Qwen2 decoder block's tensors (`input_layernorm`, `self_attn.*`,
`post_attention_layernorm`, `mlp.*`). The names come from mlx-lm's own mimo model (its names are HF's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mlx_dspark.testing.mlx_lm_checkpoints import _random
from mlx_dspark.testing.tiny import save_hf_weights, write_target_dir
from mlx_dspark.testing.tiny_tokenizer import VOCAB_SIZE


def tiny_mimo_config(ids: dict[str, Any], *, mtp_layers: int = 1, **overrides: Any) -> dict[str, Any]:
    """config.json of a tiny MiMo target: 2 Qwen2 layers (GQA 4 / 2 heads of 16) and `mtp_layers` MTP layers."""
    config = {
        "architectures": ["MiMoForCausalLM"], "model_type": "mimo",
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_nextn_predict_layers": mtp_layers,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.57.1",
    }  # fmt: skip
    config.update(overrides)
    return dict(sorted(config.items()))


def _hf_weights(config: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """mlx-lm's mimo model built with the MTP blocks as extra layers; those become `model.mtp_layers.<i>.*`,
    beside each layer's own norms and input projection."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import mimo

    first, n, C = config["num_hidden_layers"], config["num_nextn_predict_layers"], config["hidden_size"]
    model = mimo.Model(mimo.ModelArgs.from_dict({**config, "num_hidden_layers": first + n}))
    out = {}
    for name, p in sorted(tree_flatten(model.parameters())):
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if int(index) >= first:
                name = f"model.mtp_layers.{int(index) - first}.{rest}"
        out[name] = _random(rng, name, tuple(p.shape))
    for i in range(n):
        parts = {"token_layernorm.weight": (C,), "hidden_layernorm.weight": (C,), "input_proj.weight": (C, 2 * C), "final_layernorm.weight": (C,)}
        out.update({f"model.mtp_layers.{i}.{k}": _random(rng, k, shape) for k, shape in parts.items()})
    return out


def write_tiny_mimo_target(path: str | Path, *, seed: int = 0, mtp: bool = True, **overrides: Any) -> Path:
    """Write the target (config, HF-layout weights with the MTP layers unless `mtp` is False, tokenizer) into `path`."""
    path, config = write_target_dir(path, lambda ids: tiny_mimo_config(ids, **overrides))
    weights = _hf_weights(config, np.random.default_rng(seed))
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    if not mtp:
        weights = {k: v for k, v in weights.items() if not k.startswith("model.mtp_layers.")}
    save_hf_weights(path, dict(sorted(weights.items())))
    return path
