"""Tiny random DeepSeek-V3 / GLM-4.5 targets with their next-n (MTP) layer, in the exact Hugging Face layout.

What a Hugging Face `DeepseekV3ForCausalLM` / `Glm4MoeForCausalLM` checkpoint holds: `model.embed_tokens`,
`model.layers.<i>.*` (DeepSeek: MLA attention `q_a_proj` / `q_a_layernorm` / `q_b_proj` /
`kv_a_proj_with_mqa` / `kv_a_layernorm` / `kv_b_proj` / `o_proj`; GLM: `q/k/v_proj` with biases and
`o_proj`; MoE layers from `first_k_dense_replace` on with `gate.weight`, `gate.e_score_correction_bias`,
one tensor per expert `experts.<e>.{gate,up,down}_proj` and `shared_experts`), `model.norm`, `lm_head`,
and, after the last layer, `num_nextn_predict_layers` next-n layers `model.layers.<num_hidden_layers + i>.*`:
a decoder block of the same kind plus `embed_tokens`, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`,
`shared_head.head`. The two copies are written with values of their own (not the target's), so a test
sees which table is read. mlx-lm's own sanitize turns the target into its layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mlx_dspark.testing.mlx_lm_checkpoints import _random
from mlx_dspark.testing.tiny import save_hf_weights, write_target_dir
from mlx_dspark.testing.tiny_tokenizer import VOCAB_SIZE

FAMILIES = ("deepseek_v3", "glm4_moe")


def tiny_nextn_config(family: str, ids: dict[str, Any], *, nextn_layers: int = 1, **overrides: Any) -> dict[str, Any]:
    """config.json of a tiny `family` target: 2 layers (layer 0 dense, layer 1 MoE, 8 experts in 2 groups,
    2 per token, one shared expert) and `nextn_layers` next-n layers."""
    config = {
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_nextn_predict_layers": nextn_layers, "num_attention_heads": 4,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "first_k_dense_replace": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.57.1",
    }  # fmt: skip
    if family == "deepseek_v3":
        config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=4,
                      q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      moe_layer_freq=1, attention_bias=False)  # fmt: skip
    elif family == "glm4_moe":
        config.update(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_key_value_heads=2, head_dim=16,
                      partial_rotary_factor=0.5, use_qk_norm=False, attention_bias=True)  # fmt: skip
    else:
        raise ValueError(f"family {family!r} is not one of {FAMILIES}")
    config.update(overrides)
    return dict(sorted(config.items()))


def _hf_weights(config: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The target's layers and the next-n blocks (mlx-lm's model built with them all as layers), in HF names."""
    import importlib

    from mlx.utils import tree_flatten

    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    layers = config["num_hidden_layers"] + config["num_nextn_predict_layers"]
    model = family.Model(family.ModelArgs.from_dict({**config, "num_hidden_layers": layers}))
    out = {}
    for name, p in sorted(tree_flatten(model.parameters())):
        shape = tuple(p.shape)
        if ".mlp.switch_mlp." in name:  # (experts, out, in) stacked by mlx-lm -> one tensor per expert
            prefix, proj = name.split(".mlp.switch_mlp.")
            for e in range(shape[0]):
                key = f"{prefix}.mlp.experts.{e}.{proj}"
                out[key] = _random(rng, key, shape[1:])
        elif name.endswith("self_attn.embed_q.weight"):  # mlx-lm's split of HF's kv_b_proj
            heads = config["num_attention_heads"]
            key = name.replace("embed_q", "kv_b_proj")
            out[key] = _random(rng, key, (heads * (config["qk_nope_head_dim"] + config["v_head_dim"]), config["kv_lora_rank"]))
        elif not name.endswith("self_attn.unembed_out.weight"):
            out[name] = _random(rng, name, shape)
    return out


def _nextn_parts(config: dict[str, Any], rng: np.random.Generator, *, own_embedding: bool, own_head: bool) -> dict[str, np.ndarray]:
    C, V = config["hidden_size"], config["vocab_size"]
    out = {}
    for i in range(config["num_nextn_predict_layers"]):
        p = f"model.layers.{config['num_hidden_layers'] + i}."
        parts = {"enorm.weight": (C,), "hnorm.weight": (C,), "eh_proj.weight": (C, 2 * C), "shared_head.norm.weight": (C,)}
        if own_embedding:
            parts["embed_tokens.weight"] = (V, C)
        if own_head:
            parts["shared_head.head.weight"] = (V, C)
        out.update({p + k: _random(rng, p + k, shape) for k, shape in parts.items()})
        if own_head:
            out[p + "shared_head.head.weight"] *= 3.0  # a head of its own, sharper than the target's
    return out


def _as_fp8(weights: dict[str, np.ndarray], names: Sequence[str]) -> None:
    """DeepSeek-V3's FP8 layout for the named matrices: e4m3 bytes (uint8) of 2w and a `weight_scale_inv`
    of 0.5 per 128 x 128 block, so the dequantized matrix is w rounded to e4m3."""
    import mlx.core as mx

    for name in names:
        rows, cols = weights[name].shape
        weights[name] = np.array(mx.to_fp8(mx.array(2.0 * weights[name])))
        weights[name.removesuffix("weight") + "weight_scale_inv"] = np.full((-(-rows // 128), -(-cols // 128)), 0.5, np.float32)


def write_tiny_nextn_target(
    path: str | Path,
    *,
    family: str = "deepseek_v3",
    seed: int = 0,
    nextn: bool = True,
    own_embedding: bool = True,
    own_head: bool = True,
    fp8_parts: Sequence[str] = (),
    **overrides: Any,
) -> Path:
    """Write the target (config, HF-layout weights with the next-n layers unless `nextn` is False,
    tokenizer) into `path`; `own_embedding` / `own_head`: whether the next-n layers carry those copies;
    `fp8_parts`: the next-n layer's matrices (names after its prefix) stored in FP8 with their scales."""
    path, config = write_target_dir(path, lambda ids: tiny_nextn_config(family, ids, **overrides))
    rng = np.random.default_rng(seed)
    weights = _hf_weights(config, rng)
    weights.update(_nextn_parts(config, rng, own_embedding=own_embedding, own_head=own_head))
    _as_fp8(weights, [f"model.layers.{config['num_hidden_layers']}.{name}" for name in fp8_parts])
    if not nextn:
        prefixes = tuple(f"model.layers.{config['num_hidden_layers'] + i}." for i in range(config["num_nextn_predict_layers"]))
        weights = {k: v for k, v in weights.items() if not k.startswith(prefixes)}
    save_hf_weights(path, dict(sorted(weights.items())))
    return path
