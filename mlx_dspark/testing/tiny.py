"""Random tiny checkpoints in the exact Hugging Face / DeepSpec layouts, with a real tokenizer.

`write_tiny_target` writes a target directory of either family (config.json, safetensors, a byte-level
BPE tokenizer with the family's special tokens and chat template, generation_config.json);
`write_tiny_draft` writes a random DSpark draft for it. Weights come from a seeded numpy RNG at small
scales so that logits are neither flat nor one-hot. Sizes keep every linear input dim divisible by
128, so 4/8-bit quantization with group sizes 32/64/128 applies to every target linear layer.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np

# FAMILIES and write_tokenizer are re-exported for scripts/ and tests.
from mlx_dspark.testing.tiny_tokenizer import FAMILIES, VOCAB_SIZE, _check_family, _write_json, write_tokenizer  # noqa: F401
# the Hugging Face file helpers, re-exported for the other tiny writers, scripts/ and tests
from mlx_dspark.testing.hf_files import _read_hf_weights, save_hf_weights, write_target_dir  # noqa: F401

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")

# --------------------------------------------------------------------------------------------------
# configs


def _layer_types(family: str, num_layers: int) -> list[str]:
    if family == "spark2_5":
        # three sliding then one full, repeated (the published pattern)
        return ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(num_layers)]
    return ["full_attention"] * num_layers


def tiny_target_config(
    *, family: str, vocab_size: int, ids: dict[str, Any], tie_word_embeddings: bool, dtype: str, **overrides
) -> dict[str, Any]:
    """The config.json of a tiny target, in the family's Hugging Face field layout."""
    _check_family(family)
    if family == "spark2_5":
        config: dict[str, Any] = {
            "architectures": ["Spark2_5ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "auto_map": {
                "AutoConfig": "configuration_spark.Spark2_5Config",
                "AutoModel": "modeling_spark.Spark2_5Model",
                "AutoModelForCausalLM": "modeling_spark.Spark2_5ForCausalLM",
            },
            "bos_token_id": ids["bos"],
            "dtype": dtype,
            "eos_token_id": ids["eos"],
            "gate_attn_act_mode": "sigmoid",
            "head_dim": 64,
            "headwise_attn_output_gate": True,
            "hidden_act": "gelu",
            "hidden_size": 128,  # != heads * head_dim (256), like the real 4B
            "initializer_range": 0.02,
            "intermediate_size": 256,
            "max_position_embeddings": 4096,
            "mlp_bias": False,
            "model_type": "spark2_5",
            "num_attention_heads": 4,
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "pad_token_id": ids["pad"],
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 5000000},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000},
            },
            "sliding_window": 16,
            "tie_word_embeddings": tie_word_embeddings,
            "transformers_version": "4.57.1",
            "use_cache": True,
            "vocab_size": vocab_size,
        }
    else:
        config = {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": ids["bos"],
            "dtype": dtype,
            "eos_token_id": ids["eos"],
            "head_dim": 32,
            "hidden_act": "silu",
            "hidden_size": 128,
            "initializer_range": 0.02,
            "intermediate_size": 256,
            "max_position_embeddings": 4096,
            "model_type": "qwen3",
            "num_attention_heads": 4,
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "pad_token_id": ids["pad"],
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "sliding_window": None,
            "tie_word_embeddings": tie_word_embeddings,
            "torch_dtype": dtype,
            "transformers_version": "5.10.2",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": vocab_size,
        }
    config.update(overrides)
    if "layer_types" not in overrides:
        config["layer_types"] = _layer_types(family, config["num_hidden_layers"])
    if family == "qwen3":
        config.setdefault("max_window_layers", config["num_hidden_layers"])
    return dict(sorted(config.items()))


# --------------------------------------------------------------------------------------------------
# weights


def _linear(rng: np.random.Generator, out_dim: int, in_dim: int) -> np.ndarray:
    # 1 / sqrt(fan_in) with a small embedding: the layers, not the input token, dominate the residual
    # stream, so a tied head does not just repeat the last token (varied continuations = stronger tests)
    return (rng.standard_normal((out_dim, in_dim)) * (1.0 / np.sqrt(in_dim))).astype(np.float32)


def _norm(rng: np.random.Generator, dim: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)


def _decoder_layer(rng: np.random.Generator, config: dict[str, Any], *, family: str, prefix: str) -> dict[str, np.ndarray]:
    hidden = config["hidden_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inter = config["intermediate_size"]
    w = {f"{prefix}input_layernorm.weight": _norm(rng, hidden)}
    if family == "spark2_5":
        w[f"{prefix}self_attn.q_k_v_proj.weight"] = _linear(rng, (heads + 2 * kv_heads) * head_dim, hidden)
        w[f"{prefix}self_attn.g_proj.weight"] = _linear(rng, heads, hidden)
        w[f"{prefix}self_attn.out_proj.weight"] = _linear(rng, hidden, heads * head_dim)
    else:
        w[f"{prefix}self_attn.q_proj.weight"] = _linear(rng, heads * head_dim, hidden)
        w[f"{prefix}self_attn.k_proj.weight"] = _linear(rng, kv_heads * head_dim, hidden)
        w[f"{prefix}self_attn.v_proj.weight"] = _linear(rng, kv_heads * head_dim, hidden)
        w[f"{prefix}self_attn.o_proj.weight"] = _linear(rng, hidden, heads * head_dim)
        w[f"{prefix}self_attn.q_norm.weight"] = _norm(rng, head_dim)
        w[f"{prefix}self_attn.k_norm.weight"] = _norm(rng, head_dim)
    w[f"{prefix}post_attention_layernorm.weight"] = _norm(rng, hidden)
    w[f"{prefix}mlp.gate_proj.weight"] = _linear(rng, inter, hidden)
    w[f"{prefix}mlp.up_proj.weight"] = _linear(rng, inter, hidden)
    w[f"{prefix}mlp.down_proj.weight"] = _linear(rng, hidden, inter)
    return w


def tiny_target_weights(config: dict[str, Any], *, seed: int) -> dict[str, np.ndarray]:
    """Random float32 target weights under the Hugging Face names of the config's family."""
    family = config["model_type"]
    rng = np.random.default_rng(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    embed_name = "model.embedding.weight" if family == "spark2_5" else "model.embed_tokens.weight"
    weights = {embed_name: (0.02 * rng.standard_normal((vocab, hidden))).astype(np.float32)}
    for i in range(config["num_hidden_layers"]):
        weights.update(_decoder_layer(rng, config, family=family, prefix=f"model.layers.{i}."))
    weights["model.norm.weight"] = _norm(rng, hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = (0.1 * rng.standard_normal((vocab, hidden))).astype(np.float32)
    return dict(sorted(weights.items()))


# --------------------------------------------------------------------------------------------------
# files



def write_tiny_target(
    path: str | Path,
    *,
    family: str = "spark2_5",
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    dtype: str = "float32",
    num_shards: int = 1,
    **overrides: Any,
) -> Path:
    """Write a random tiny target of `family` into `path` (created) and return the path.

    Defaults: spark2_5 is tied, 4 layers (3 sliding + 1 full), window 16, hidden 128 with 4 x 64 heads;
    qwen3 is untied, 4 full layers, hidden 128. `overrides` replace config.json fields (e.g.
    num_hidden_layers=8); `layer_types` follows num_hidden_layers unless given.
    """
    _check_family(family)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tie_word_embeddings is None:
        tie_word_embeddings = family == "spark2_5"
    ids = write_tokenizer(path, family=family)
    config = tiny_target_config(
        family=family, vocab_size=VOCAB_SIZE, ids=ids, tie_word_embeddings=tie_word_embeddings, dtype=dtype, **overrides
    )
    _write_json(path / "config.json", config)
    _write_json(
        path / "generation_config.json",
        {
            "_from_model_config": True,
            "bos_token_id": ids["bos"],
            "eos_token_id": ids["gen_eos"],
            "pad_token_id": ids["pad"],
            "transformers_version": config["transformers_version"],
        },
    )
    save_hf_weights(path, tiny_target_weights(config, seed=seed), dtype=dtype, num_shards=num_shards)
    return path


def _default_tap_ids(num_target_layers: int) -> list[int]:
    # two taps spread over the target, never its last layer: [0, 2] for 4 layers
    return sorted({0, max(0, min(num_target_layers // 2, num_target_layers - 2))})


PACKAGINGS = ("deepspec", "dflash_config", "model_prefix")
# DSpark fields a `dflash_config` packaging nests (SpecForge / LiquidAI exports).
_NESTED_FIELDS = (
    "block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
    "enable_confidence_head", "confidence_head_with_markov",
)  # fmt: skip


def tiny_draft_config(
    target_config: dict[str, Any],
    *,
    layer_family: str,
    mask_token_id: int,
    markov_head_type: str,
    markov_rank: int,
    enable_confidence_head: bool,
    confidence_head_with_markov: bool,
    layer_types: list[str],
    sliding_window: int | None,
    target_layer_ids: list[int],
    block_size: int = 7,
) -> dict[str, Any]:
    """A DSpark draft config: a copy of the target's plus the DSpark fields (DeepSpec layout).

    A draft whose layer family is not the target's keeps the copied config (as a DSpark training run
    on that target writes it), adding only what its own family's reading requires and the copy lacks:
    per-layer-type `rope_parameters` and GELU for spark2_5-style layers on a qwen3 config."""
    target_family = target_config["model_type"]
    config = copy.deepcopy(target_config)
    config.pop("auto_map", None)  # names the target's custom code, not a draft class
    config.update(
        {
            "architectures": ["Spark2_5DSparkModel" if layer_family == "spark2_5" else "Qwen3DSparkModel"],
            "block_size": block_size,
            "confidence_head_with_markov": confidence_head_with_markov,
            "enable_confidence_head": enable_confidence_head,
            "layer_types": list(layer_types),
            "markov_head_type": markov_head_type,
            "markov_rank": markov_rank,
            "mask_token_id": mask_token_id,
            "num_hidden_layers": len(layer_types),
            "num_target_layers": target_config["num_hidden_layers"],
            "sliding_window": sliding_window,
            "target_layer_ids": list(target_layer_ids),
        }
    )
    if target_family == "qwen3":
        config["use_sliding_window"] = "sliding_attention" in layer_types
    if layer_family == "spark2_5" and target_family == "qwen3":
        theta = config["rope_theta"]
        config["rope_parameters"] = {t: {"rope_theta": theta, "partial_rotary_factor": 1.0} for t in ("full_attention", "sliding_attention")}
        config.update(hidden_act="gelu", gate_attn_act_mode="sigmoid", headwise_attn_output_gate=True)
    return dict(sorted(config.items()))


def tiny_draft_weights(
    config: dict[str, Any], *, layer_family: str, target_weights: dict[str, np.ndarray] | None, seed: int
) -> dict[str, np.ndarray]:
    """Random draft weights (DeepSpec names); the shared embedding / lm_head are copied from
    `target_weights` when given (as `embed_tokens` for qwen3-style layers, `embedding` for spark2_5)."""
    rng = np.random.default_rng(seed + 1000)
    hidden, vocab, rank = config["hidden_size"], config["vocab_size"], config["markov_rank"]
    num_taps = len(config["target_layer_ids"])
    w = {
        "fc.weight": _linear(rng, hidden, num_taps * hidden),
        "hidden_norm.weight": _norm(rng, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        w.update(_decoder_layer(rng, config, family=layer_family, prefix=f"layers.{i}."))
    w["norm.weight"] = _norm(rng, hidden)
    w["markov_head.markov_w1.weight"] = (0.3 * rng.standard_normal((vocab, rank))).astype(np.float32)
    w["markov_head.markov_w2.weight"] = (0.3 * rng.standard_normal((vocab, rank))).astype(np.float32)
    head = config["markov_head_type"]
    if head == "gated":
        w["markov_head.gate_proj.weight"] = _linear(rng, rank, hidden + rank)
        w["markov_head.gate_proj.bias"] = (0.1 * rng.standard_normal(rank)).astype(np.float32)
    elif head == "rnn":
        w["markov_head.joint_proj.weight"] = _linear(rng, 3 * rank, 2 * rank + hidden)
        w["markov_head.joint_proj.bias"] = (0.1 * rng.standard_normal(3 * rank)).astype(np.float32)
    if config["enable_confidence_head"]:
        in_dim = hidden + rank if config["confidence_head_with_markov"] else hidden
        w["confidence_head.proj.weight"] = _linear(rng, 1, in_dim)
        w["confidence_head.proj.bias"] = (0.1 * rng.standard_normal(1)).astype(np.float32)
    if target_weights is not None:
        embedding = target_weights.get("model.embedding.weight", target_weights.get("model.embed_tokens.weight"))
        w["embedding.weight" if layer_family == "spark2_5" else "embed_tokens.weight"] = embedding
        if "lm_head.weight" in target_weights:
            w["lm_head.weight"] = target_weights["lm_head.weight"]
    return dict(sorted(w.items()))


def package_draft(config: dict[str, Any], weights: dict[str, np.ndarray], packaging: str) -> tuple[dict, dict]:
    """The same draft in another published packaging: DSpark fields nested under `dflash_config`, or
    a `model.` prefix on every tensor name."""
    if packaging not in PACKAGINGS:
        raise ValueError(f"packaging {packaging!r} is not one of {PACKAGINGS}")
    if packaging == "dflash_config":
        config = dict(config)
        config["dflash_config"] = {k: config.pop(k) for k in _NESTED_FIELDS if k in config}
    elif packaging == "model_prefix":
        weights = {f"model.{k}": v for k, v in weights.items()}
    return config, weights


def write_tiny_draft(
    path: str | Path,
    *,
    target_path: str | Path,
    layer_family: str | None = None,
    markov_head_type: str = "vanilla",
    markov_rank: int = 16,
    enable_confidence_head: bool = True,
    confidence_head_with_markov: bool = True,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    target_layer_ids: list[int] | None = None,
    seed: int = 0,
    include_shared: bool = True,
    dtype: str | None = None,
    num_shards: int = 1,
    packaging: str = "deepspec",
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random tiny DSpark draft for the target at `target_path` into `path`; return it.

    `layer_family` (default: the target's) is the family of the draft's layers: "qwen3" writes
    q_proj/k_proj/v_proj/o_proj + q_norm/k_norm, "spark2_5" the fused q_k_v_proj + g_proj + out_proj;
    the config stays a copy of the target's either way. Defaults: 2 sliding layers with the target's
    window (16 when it has none), taps [0, L/2], mask token = the tokenizer's `<|mask|>`, the shared
    embedding / lm_head copied from the target (`include_shared=False` leaves them out, as our converter
    does). `packaging` writes the same draft as DeepSpec does, with its DSpark fields nested under
    `dflash_config`, or with a `model.` prefix on every tensor. `config_overrides` replace config fields
    before the weights are drawn (e.g. `head_dim`, `num_key_value_heads`, `block_size`: the weights take
    their shapes).
    """
    target_path = Path(target_path)
    target_config = json.loads((target_path / "config.json").read_text(encoding="utf-8"))
    if isinstance(target_config.get("text_config"), dict):  # a multimodal wrapper's (qwen3_5): its text model
        target_config = {**target_config, **target_config["text_config"]}
    layer_family = layer_family or target_config["model_type"]
    _check_family(layer_family)
    if markov_head_type not in MARKOV_HEAD_TYPES:
        raise ValueError(f"markov_head_type {markov_head_type!r} is not one of {MARKOV_HEAD_TYPES}")
    if layer_types is None:
        layer_types = ["sliding_attention", "sliding_attention"]
    if sliding_window is None and "sliding_attention" in layer_types:
        sliding_window = target_config.get("sliding_window") or 16
    if target_layer_ids is None:
        target_layer_ids = _default_tap_ids(target_config["num_hidden_layers"])
    tok_config = json.loads((target_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    mask_token = tok_config.get("mask_token") or "<|mask|>"
    mask_ids = [int(i) for i, t in tok_config.get("added_tokens_decoder", {}).items() if t["content"] == mask_token]
    if not mask_ids:
        raise ValueError(f"{target_path / 'tokenizer_config.json'}: no mask token {mask_token!r} among the added tokens")
    config = tiny_draft_config(
        target_config,
        layer_family=layer_family,
        mask_token_id=mask_ids[0],
        markov_head_type=markov_head_type,
        markov_rank=markov_rank,
        enable_confidence_head=enable_confidence_head,
        confidence_head_with_markov=confidence_head_with_markov,
        layer_types=layer_types,
        sliding_window=sliding_window,
        target_layer_ids=target_layer_ids,
    )
    config = dict(sorted({**config, **(config_overrides or {})}.items()))
    target_weights = _read_hf_weights(target_path) if include_shared else None
    weights = tiny_draft_weights(config, layer_family=layer_family, target_weights=target_weights, seed=seed)
    config, weights = package_draft(config, weights, packaging)
    dtype = dtype or target_config.get("dtype", "float32")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_json(path / "config.json", config)
    save_hf_weights(path, weights, dtype=dtype, num_shards=num_shards)
    return path


def write_tiny_pair(
    root: str | Path, *, family: str = "spark2_5", seed: int = 0, **draft_options: Any
) -> tuple[Path, Path]:
    """Write `root/target` and `root/draft` for `family`; returns (target_path, draft_path)."""
    root = Path(root)
    target = write_tiny_target(root / "target", family=family, seed=seed)
    draft = write_tiny_draft(root / "draft", target_path=target, seed=seed, **draft_options)
    return target, draft
