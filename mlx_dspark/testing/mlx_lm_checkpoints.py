"""Tiny random checkpoints of families we run through mlx-lm (`models/target/mlx_lm.py`), in the
Hugging Face layout: config.json in the family's HF fields, safetensors under HF names, the tiny
byte-level tokenizer (qwen3's specials and chat template; vocabulary 384).

The tensor list comes from mlx-lm's own model of the config (its parameter names and shapes), turned
back into HF names where mlx-lm's `sanitize` renames them (qwen3_moe's stacked experts), so a
checkpoint is what a Hugging Face export of that architecture holds and loading goes through the
family's real `sanitize`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mlx_dspark.testing.tiny import save_hf_weights, write_target_dir
from mlx_dspark.testing.tiny_tokenizer import VOCAB_SIZE, _write_json

MLX_LM_FAMILIES = ("llama", "gemma4_text", "qwen3_moe")
# Hybrids (recurrent / convolution state beside attention), written in mlx-lm's own layout (its
# parameter names, which its `sanitize` leaves as they are): their HF layouts differ in ways only
# mlx-lm's sanitize knows (norm offsets, conv axes).
HYBRID_FAMILIES = ("qwen3_5", "lfm2", "nemotron_h")
# A MoE hybrid (GatedDeltaNet + attention, MoE MLPs with a shared expert), mlx-lm's layout too.
MOE_HYBRID_FAMILIES = ("qwen3_5_moe",)
# Families that stress one target contract point each: gemma3_text's head is tied by its sanitize,
# youtu_llm keeps its ModelArgs as `config` (MLA attention).
CONTRACT_FAMILIES = ("gemma3_text", "youtu_llm")
# Held-out families (issue 52), mlx-lm's layout: baichuan_m1 normalizes its head at load (its sanitize) and keeps
# a conv state beside each layer's K/V (a CacheList), plamo2 nests its layer list under the backbone (Mamba +
# attention), rwkv7 is recurrent only, its layers handing a second tensor (v_first) from layer to layer.
HELD_OUT_FAMILIES = ("baichuan_m1", "plamo2", "rwkv7")
# Small causal LMs written only as draft models (the GGUF draft model's families beside llama): qwen2's q / k / v
# biases, its head tied.
DRAFT_MODEL_FAMILIES = ("qwen2",)


def _base(ids: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "vocab_size": VOCAB_SIZE,
        "torch_dtype": "float32",
        "transformers_version": "4.57.1",
    }


def tiny_mlx_lm_config(family: str, ids: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """config.json of a tiny target of `family` (one of MLX_LM_FAMILIES) in its HF fields."""
    config = _base(ids)
    if family == "llama":  # MiniCPM5's architecture
        config.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rope_theta=10000.0,
                      attention_bias=False, mlp_bias=False, tie_word_embeddings=False)  # fmt: skip
    elif family == "gemma4_text":
        config.update(
            architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", hidden_activation="gelu_pytorch_tanh",
            global_head_dim=64, num_global_key_value_heads=1, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
            sliding_window=512, layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            final_logit_softcapping=30.0, use_double_wide_mlp=False, attention_k_eq_v=False, tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"},
            },
        )  # fmt: skip
    elif family == "gemma3_text":  # tied head that mlx-lm's sanitize ties (its args never name it)
        config.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
                      query_pre_attn_scalar=32, sliding_window=512, sliding_window_pattern=2, rope_theta=1000000.0,
                      rope_local_base_freq=10000.0, tie_word_embeddings=True)  # fmt: skip
    elif family == "youtu_llm":  # mlx-lm keeps its args as `self.config`
        config.update(architectures=["YoutuLLMForCausalLM"], model_type="youtu_llm", kv_lora_rank=32, q_lora_rank=64,
                      qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, rope_theta=10000.0, tie_word_embeddings=True,
                      attention_bias=False, mlp_bias=False)  # fmt: skip
    elif family == "qwen3_moe":
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu", rope_theta=10000.0,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                      moe_intermediate_size=128, norm_topk_prob=True, tie_word_embeddings=False, rope_scaling=None)  # fmt: skip
    elif family in ("qwen3_5", "qwen3_5_moe"):  # 2 GatedDeltaNet + 2 full-attention layers, under the multimodal wrapper
        text = {k: config.pop(k) for k in list(config) if k not in ("bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "torch_dtype")}
        text.update(model_type="qwen3_5_text", linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_conv_kernel_dim=4, full_attention_interval=2, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0, "partial_rotary_factor": 0.25})  # fmt: skip
        if family == "qwen3_5_moe":
            text.update(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                        moe_intermediate_size=64, shared_expert_intermediate_size=64)  # fmt: skip
        architecture = "Qwen3_5MoeForConditionalGeneration" if family == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
        config.update(architectures=[architecture], model_type=family, text_config=text, tie_word_embeddings=False)
    elif family == "lfm2":  # short convolutions + attention
        config.update(architectures=["Lfm2ForCausalLM"], model_type="lfm2", norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                      block_dim=128, block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                      block_ff_dim=256, rope_theta=10000.0, tie_word_embeddings=True,
                      layer_types=["conv", "full_attention", "conv", "full_attention"])  # fmt: skip
    elif family == "nemotron_h":  # Mamba-2 + attention + MLP blocks
        config.update(architectures=["NemotronHForCausalLM"], model_type="nemotron_h", attention_bias=False, mamba_num_heads=4,
                      mamba_head_dim=32, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False,
                      layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
                      layers_block_type=["mamba", "mlp", "attention", "mlp"])  # fmt: skip
    elif family == "baichuan_m1":  # layers 0 and 2 slide (a RotatingKVCache), 1 and 3 attend fully
        config.update(architectures=["BaichuanM1ForCausalLM"], model_type="baichuan_m1", rope_theta=10000.0, sliding_window=8,
                      sliding_window_layers=[0, 2], conv_window=2, num_swa_attention_heads=4, num_swa_key_value_heads=2,
                      tie_word_embeddings=False)  # fmt: skip
    elif family == "plamo2":  # Mamba layers 0 and 2, attention layers 1 and 3
        config.update(architectures=["Plamo2ForCausalLM"], model_type="plamo2", hidden_size_per_head=32, mamba_d_state=16,
                      mamba_d_conv=4, mamba_num_heads=4, mamba_step=2, mamba_chunk_size=16, tie_word_embeddings=True)  # fmt: skip
    elif family == "qwen2":
        config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rope_theta=10000.0,
                      tie_word_embeddings=True)  # fmt: skip
    elif family == "rwkv7":
        config.update(architectures=["RWKV7ForCausalLM"], model_type="rwkv7", norm_eps=1e-5, a_low_rank_dim=16, v_low_rank_dim=16,
                      gate_low_rank_dim=32, decay_low_rank_dim=16, tie_word_embeddings=False)  # fmt: skip
    else:
        known = MLX_LM_FAMILIES + HYBRID_FAMILIES + MOE_HYBRID_FAMILIES + CONTRACT_FAMILIES + HELD_OUT_FAMILIES + DRAFT_MODEL_FAMILIES
        raise ValueError(f"family {family!r} is not one of {known}")
    config.update(overrides)
    return dict(sorted(config.items()))


def _random(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if "norm" in name or name.endswith("layer_scalar"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if "embed_tokens" in name:
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    if name == "lm_head.weight":
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".bias") or len(shape) == 1:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)  # 1 / sqrt(fan_in)


def _hf_names(family: str, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """mlx-lm's parameter names back to the HF checkpoint's (the inverse of the family's `sanitize`)."""
    if family != "qwen3_moe":
        return weights
    out = {}
    for name, value in weights.items():
        if ".mlp.switch_mlp." in name:  # (experts, out, in) stacked -> one tensor per expert
            prefix, proj = name.split(".mlp.switch_mlp.")
            for e in range(value.shape[0]):
                out[f"{prefix}.mlp.experts.{e}.{proj}"] = value[e]
        else:
            out[name] = value
    return out


def tiny_mlx_lm_weights(config: dict[str, Any], *, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights under the HF names of the config's family."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    weights = {k: _random(rng, k, shape) for k, shape in sorted(shapes.items())}
    if config.get("tie_word_embeddings") or config.get("text_config", {}).get("tie_word_embeddings"):
        weights = {k: v for k, v in weights.items() if not k.endswith("lm_head.weight")}  # a tied checkpoint has none
    return dict(sorted(_hf_names(config["model_type"], weights).items()))


def write_tiny_mlx_lm_target(path: str | Path, *, family: str, seed: int = 0, **overrides: Any) -> Path:
    """Write a random tiny `family` target (config, weights, tokenizer) into `path`; return it."""
    path, config = write_target_dir(path, lambda ids: tiny_mlx_lm_config(family, ids, **overrides))
    save_hf_weights(path, tiny_mlx_lm_weights(config, seed=seed))
    return path


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))


def write_draft_for(
    path: str | Path, *, target_path: str | Path, seed: int = 0, draft_sizes: dict[str, Any] | None = None, **options: Any
) -> Path:
    """A random qwen3-layer DSpark draft (`testing/tiny.write_tiny_draft`) for any tiny target written here,
    hybrids under a multimodal wrapper included: the draft's config is a copy of the target's text fields
    with default RoPE (the draft's own layers), without the shared embedding / head (the draft uses the
    target's). `draft_sizes` replace the draft's own sizes (head_dim 32, intermediate_size 256); `options`
    go to `write_tiny_draft`."""
    from mlx_dspark.testing.tiny import write_tiny_draft

    target_path, path = Path(target_path), Path(path)
    config = read_config(target_path)
    text = dict(config.get("text_config") or config)
    base = path.parent / f"{path.name}.target-text"  # what the draft's config is copied from
    base.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (target_path / name).exists():
            (base / name).write_bytes((target_path / name).read_bytes())
    fields = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
    draft_config = {k: text.get(k, config.get(k)) for k in fields}
    draft_config.update(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="silu", rope_theta=10000.0, head_dim=32,
        intermediate_size=256, num_hidden_layers=text.get("num_hidden_layers", len(text.get("layers_block_type", []))),
        rms_norm_eps=text.get("rms_norm_eps") or 1e-6, num_attention_heads=text.get("num_attention_heads") or 4,
        num_key_value_heads=text.get("num_key_value_heads") or 2, torch_dtype="float32",
    )  # fmt: skip
    draft_config.update(draft_sizes or {})
    _write_json(base / "config.json", dict(sorted(draft_config.items())))
    return write_tiny_draft(path, target_path=base, layer_family="qwen3", seed=seed, include_shared=False, **options)
