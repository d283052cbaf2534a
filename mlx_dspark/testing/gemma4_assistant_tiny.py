"""A tiny random Gemma 4 assistant drafter in the Hugging Face layout, for a tiny gemma4_text target.

`config.json` as transformers' `Gemma4AssistantConfig` serialises it (`architectures:
["Gemma4AssistantForCausalLM"]`, `model_type: gemma4_assistant`, `backbone_hidden_size`,
`use_ordered_embeddings`, `num_centroids`, `centroid_intermediate_top_k`, `tie_word_embeddings`, a Gemma 4
`text_config` with every layer KV-shared); `model.safetensors` under the checkpoint's names: `model.embed_tokens`
(the tied head's table), `model.layers.<i>.*` (q_proj, q_norm, o_proj, the sandwich norms, the GELU MLP,
`layer_scalar`; with `unused_kv`, also the k_proj / v_proj / k_norm a shared layer never reads), `model.norm`,
`pre_projection`, `post_projection`, and with ordered embeddings `masked_embedding.centroids` and the int64
`masked_embedding.token_ordering`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mlx_dspark.testing.tiny_tokenizer import _write_json

ASSISTANT_LAYERS = ("sliding_attention", "full_attention")


def assistant_config(target_config: dict[str, Any], *, hidden_size: int = 64, layer_types: Sequence[str] = ASSISTANT_LAYERS,
                     ordered: bool = False, num_centroids: int = 8, top_k: int = 3) -> dict[str, Any]:  # fmt: skip
    text = dict(target_config.get("text_config") or target_config)
    layers = list(layer_types)
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": text["hidden_size"],
        "use_ordered_embeddings": ordered,
        "num_centroids": num_centroids,
        "centroid_intermediate_top_k": top_k,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "gemma4_text", "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": len(layers), "layer_types": layers, "num_attention_heads": 4,
            "num_key_value_heads": text["num_key_value_heads"], "num_global_key_value_heads": text.get("num_global_key_value_heads"),
            "head_dim": text["head_dim"], "global_head_dim": text["global_head_dim"], "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "enable_moe_block": False,
            "use_double_wide_mlp": False, "attention_k_eq_v": text.get("attention_k_eq_v", False),
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "vocab_size": text["vocab_size"],
            "sliding_window": text["sliding_window"], "rope_parameters": text["rope_parameters"],
            "max_position_embeddings": text.get("max_position_embeddings", 4096), "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
        },
    }  # fmt: skip


def assistant_weights(config: dict[str, Any], *, seed: int, unused_kv: bool = True, table_scale: float = 1.0) -> dict[str, np.ndarray]:
    """Random float32 weights under the checkpoint's names (`table_scale` sharpens the tied head's logits)."""
    rng = np.random.default_rng(seed)
    text = config["text_config"]
    C, Cb, V, H = text["hidden_size"], config["backbone_hidden_size"], text["vocab_size"], text["num_attention_heads"]
    KV, inner = text["num_key_value_heads"], text["intermediate_size"]

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": (table_scale * rng.standard_normal((V, C)) / np.sqrt(C)).astype(np.float32),
        "model.norm.weight": norm(C), "pre_projection.weight": linear(C, 2 * Cb), "post_projection.weight": linear(Cb, C),
    }  # fmt: skip
    for i, kind in enumerate(text["layer_types"]):
        D = text["global_head_dim"] if kind == "full_attention" else text["head_dim"]
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": norm(C), p + "post_attention_layernorm.weight": norm(C),
            p + "pre_feedforward_layernorm.weight": norm(C), p + "post_feedforward_layernorm.weight": norm(C),
            p + "self_attn.q_proj.weight": linear(H * D, C), p + "self_attn.q_norm.weight": norm(D),
            p + "self_attn.o_proj.weight": linear(C, H * D), p + "layer_scalar": norm(1),
            p + "mlp.gate_proj.weight": linear(inner, C), p + "mlp.up_proj.weight": linear(inner, C),
            p + "mlp.down_proj.weight": linear(C, inner),
        })  # fmt: skip
        if unused_kv:
            weights.update({p + "self_attn.k_proj.weight": linear(KV * D, C), p + "self_attn.v_proj.weight": linear(KV * D, C),
                            p + "self_attn.k_norm.weight": norm(D)})  # fmt: skip
    if config["use_ordered_embeddings"]:
        weights["masked_embedding.centroids.weight"] = linear(config["num_centroids"], C)
        weights["masked_embedding.token_ordering"] = rng.permutation(V).astype(np.int64)
    return dict(sorted(weights.items()))


def write_assistant(path: str | Path, *, target_path: str | Path, seed: int = 0, unused_kv: bool = True, table_scale: float = 1.0,
                    **options: Any) -> Path:  # fmt: skip
    """Write a random assistant for the tiny Gemma 4 target at `target_path` into `path`; return it."""
    from safetensors.numpy import save_file

    target_path, path = Path(target_path), Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = assistant_config(json.loads((target_path / "config.json").read_text(encoding="utf-8")), **options)
    _write_json(path / "config.json", config)
    save_file(assistant_weights(config, seed=seed, unused_kv=unused_kv, table_scale=table_scale), str(path / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return path
