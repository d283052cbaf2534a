"""Tiny random drafts in the published layouts beyond DeepSpec's qwen3 one, each written as its
producer writes it (config fields and tensor names), for the loaders' tests:

- `write_gemma4_draft`: DeepSpec's gemma4 family (`deepspec/modeling/dspark/gemma4/`: a copy of the
  target's `Gemma4TextConfig` with `architectures: ["Gemma4DSparkModel"]`, every layer full attention,
  `global_head_dim`, sandwich norms, `layer_scalar`, frozen `embed_tokens` / `lm_head` copies).
- `repackage`: the same draft as vLLM `speculators` writes it, as LiquidAI's LFM2 heads ship
  (backbone only), as a z-lab DFlash draft (no Markov head), from a DeepSpec-layout directory.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np

from mlx_dspark.testing.tiny import _linear, _norm, _read_hf_weights, _write_json, save_hf_weights


def gemma4_draft_config(
    target_config: dict[str, Any],
    *,
    mask_token_id: int,
    target_layer_ids: list[int],
    num_layers: int = 2,
    block_size: int = 7,
    markov_rank: int = 16,
    attention_k_eq_v: bool = True,  # upstream's converter: the published Gemma 4 drafts are k_eq_v
    final_logit_softcapping: float | None = 30.0,
    partial_rotary_factor: float = 0.25,
) -> dict[str, Any]:
    """DeepSpec's `build_draft_config` on a Gemma 4 text config sized like `target_config` (hidden,
    vocab, heads), whatever that target's own family: a draft's layer family is its own."""
    hidden, heads = target_config["hidden_size"], target_config["num_attention_heads"]
    return {
        "architectures": ["Gemma4DSparkModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": attention_k_eq_v,
        "block_size": block_size,
        "confidence_head_with_markov": True,
        "enable_confidence_head": True,
        "enable_moe_block": False,
        "final_logit_softcapping": final_logit_softcapping,
        "global_head_dim": 64,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden,
        "hidden_size_per_layer_input": 0,
        "initializer_range": 0.02,
        "intermediate_size": 2 * hidden,
        "layer_types": ["full_attention"] * num_layers,
        "markov_head_type": "vanilla",
        "markov_rank": markov_rank,
        "mask_token_id": mask_token_id,
        "max_position_embeddings": 4096,
        "model_type": "gemma4_text",
        "num_anchors": 512,
        "num_attention_heads": heads,
        "num_global_key_value_heads": 1,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": 2,
        "num_kv_shared_layers": 0,
        "num_target_layers": target_config["num_hidden_layers"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": partial_rotary_factor, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": 16,
        "target_layer_ids": list(target_layer_ids),
        "target_model_type": "gemma4",
        "target_text_model_type": "gemma4_text",
        "tie_word_embeddings": False,
        "use_double_wide_mlp": False,
        "vocab_size": target_config["vocab_size"],
    }


def gemma4_draft_weights(config: dict[str, Any], *, target_weights: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Random weights under DeepSpec's Gemma4DSparkModel state-dict names (buffers included)."""
    rng = np.random.default_rng(seed + 2000)
    hidden, inter, rank = config["hidden_size"], config["intermediate_size"], config["markov_rank"]
    heads, head_dim = config["num_attention_heads"], config["global_head_dim"]
    kv = config["num_global_key_value_heads"] if config["attention_k_eq_v"] else config["num_key_value_heads"]
    vocab = config["vocab_size"]
    w = {"fc.weight": _linear(rng, hidden, len(config["target_layer_ids"]) * hidden), "hidden_norm.weight": _norm(rng, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = _linear(rng, heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = _linear(rng, kv * head_dim, hidden)
        if not config["attention_k_eq_v"]:
            w[p + "self_attn.v_proj.weight"] = _linear(rng, kv * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = _linear(rng, hidden, heads * head_dim)
        w[p + "self_attn.q_norm.weight"] = _norm(rng, head_dim)
        w[p + "self_attn.k_norm.weight"] = _norm(rng, head_dim)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            w[p + norm + ".weight"] = _norm(rng, hidden)
        w[p + "mlp.gate_proj.weight"] = _linear(rng, inter, hidden)
        w[p + "mlp.up_proj.weight"] = _linear(rng, inter, hidden)
        w[p + "mlp.down_proj.weight"] = _linear(rng, hidden, inter)
        w[p + "layer_scalar"] = np.array([0.5 + 0.1 * i], dtype=np.float32)  # a buffer (ones when trained from scratch)
    w["norm.weight"] = _norm(rng, hidden)
    w["markov_head.markov_w1.weight"] = (0.3 * rng.standard_normal((vocab, rank))).astype(np.float32)
    w["markov_head.markov_w2.weight"] = (0.3 * rng.standard_normal((vocab, rank))).astype(np.float32)
    w["confidence_head.proj.weight"] = _linear(rng, 1, hidden + rank)
    w["confidence_head.proj.bias"] = (0.1 * rng.standard_normal(1)).astype(np.float32)
    # the frozen copies DeepSpec saves (initialize_embeddings_and_head): the target's table and head
    embedding = target_weights.get("model.embed_tokens.weight", target_weights.get("model.embedding.weight"))
    w["embed_tokens.weight"] = embedding
    w["lm_head.weight"] = target_weights.get("lm_head.weight", embedding)
    return dict(sorted(w.items()))


def _mask_token_id(target_path: Path) -> int:
    tok = json.loads((target_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    mask = tok.get("mask_token") or "<|mask|>"
    return next(int(i) for i, t in tok.get("added_tokens_decoder", {}).items() if t["content"] == mask)


def write_gemma4_draft(path: str | Path, *, target_path: str | Path, seed: int = 0, **options: Any) -> Path:
    """A tiny random Gemma 4 DSpark draft in DeepSpec's layout for the target at `target_path`."""
    target_path, path = Path(target_path), Path(path)
    target_config = json.loads((target_path / "config.json").read_text(encoding="utf-8"))
    layers = target_config["num_hidden_layers"]
    options.setdefault("target_layer_ids", sorted({0, max(0, min(layers // 2, layers - 2))}))
    config = gemma4_draft_config(target_config, mask_token_id=_mask_token_id(target_path), **options)
    weights = gemma4_draft_weights(config, target_weights=_read_hf_weights(target_path), seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    _write_json(path / "config.json", config)
    save_hf_weights(path, weights)
    return path


# -- the same draft in other published packagings --------------------------------------------------------

REPACKAGINGS = ("speculators_dspark", "speculators_dflash_markov", "speculators_dflash", "lfm2_backbone", "zlab_dflash")
# DSpark / DFlash fields that are the draft's, not its layers' (speculators keeps them at the top level)
_DRAFT_FIELDS = (
    "block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
    "confidence_head_with_markov", "num_target_layers", "num_anchors", "sample_from_anchor",
)  # fmt: skip
_HEAD_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
_SHARED = ("embed_tokens.", "embedding.", "lm_head.")
_HEADS = ("markov_head.", "confidence_head.")


def _speculators(config: dict, weights: dict, *, algorithm: str, sample_from_anchor: bool) -> tuple[dict, dict]:
    """vLLM speculators' layout (`speculators/models/dflash`, `.../dspark`): the draft layers' config
    under `transformer_layer_config`, taps as `aux_hidden_state_layer_ids` (target ids + 1), the
    proposal under `speculators_config`, `draft_vocab_size` always written, the DSpark heads' fields
    at the top level; tensors under the module names (`layers.N.*`, `fc`, `hidden_norm`, `norm`,
    `embed_tokens`, `lm_head`, `markov_head.*`, `confidence_head.proj`)."""
    layer = {k: v for k, v in config.items() if k not in _DRAFT_FIELDS and k != "architectures"}
    layer["architectures"] = ["Qwen3ForCausalLM"]
    out = {
        "architectures": ["DSparkSpeculator" if algorithm == "dspark" else "DFlashSpeculator"],
        "speculators_model_type": algorithm,
        "speculators_version": "0.5.0",
        "aux_hidden_state_layer_ids": [i + 1 for i in config["target_layer_ids"]],
        "block_size": config["block_size"],
        "draft_vocab_size": config["vocab_size"],
        "mask_token_id": config["mask_token_id"],
        "sample_from_anchor": sample_from_anchor,
        "sliding_window_non_causal": True,
        "target_hidden_size": None,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config["block_size"] - (0 if sample_from_anchor else 1)}],
            "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "target"},
        },
    }
    if algorithm == "dspark":
        out.update({k: config[k] for k in _HEAD_FIELDS if k in config})
    else:
        weights = {k: v for k, v in weights.items() if not k.startswith(_HEADS)}
    return out, weights


def repackage(source: str | Path, dst: str | Path, packaging: str) -> Path:
    """Write the DeepSpec-layout draft at `source` into `dst` in another packaging (same weights;
    the packagings without Markov / confidence heads leave them out)."""
    if packaging not in REPACKAGINGS:
        raise ValueError(f"packaging {packaging!r} is not one of {REPACKAGINGS}")
    source, dst = Path(source), Path(dst)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    weights = _read_hf_weights(source)
    if packaging == "speculators_dspark":
        config, weights = _speculators(config, weights, algorithm="dspark", sample_from_anchor=True)
    elif packaging == "speculators_dflash_markov":
        config, weights = _speculators(config, weights, algorithm="dspark", sample_from_anchor=False)
    elif packaging == "speculators_dflash":
        config, weights = _speculators(config, weights, algorithm="dflash", sample_from_anchor=False)
    elif packaging == "lfm2_backbone":
        # LiquidAI's heads: no copy of the target's embedding / head; DSpark fields under dflash_config
        weights = {k: v for k, v in weights.items() if not k.startswith(_SHARED)}
        config = copy.deepcopy(config)
        config["architectures"] = ["Lfm2DSparkDraftModel"]
        config["dflash_config"] = {k: config.pop(k) for k in _DRAFT_FIELDS if k in config and k != "num_target_layers"}
    else:
        # z-lab DFlash (`dflash/model.py`): the block draft alone, `block_size` at the top level, taps and
        # mask under dflash_config, no embedding / head copies, drafts from row 1 (not written anywhere)
        weights = {k: v for k, v in weights.items() if not k.startswith(_HEADS + _SHARED)}
        config = {k: v for k, v in config.items() if k not in _HEAD_FIELDS}
        config["architectures"] = ["DFlashDraftModel"]
        config["dflash_config"] = {k: config.pop(k) for k in ("target_layer_ids", "mask_token_id")}
    dst.mkdir(parents=True, exist_ok=True)
    _write_json(dst / "config.json", config)
    save_hf_weights(dst, weights)
    return dst


# -- a Gemma 4 draft as upstream llama.cpp's converter writes it (conversion/gemma.py Gemma4DSparkModel) --

_GEMMA4_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
_GEMMA4_GGUF_GLOBAL = {
    "fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight", "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight", "confidence_head.proj.bias": "conf_proj.bias",
}  # fmt: skip


def write_gemma4_gguf(
    source: str | Path, path: str | Path, *, target_path: str | Path, extra_keys: dict[str, float] | None = None
) -> Path:
    """The DeepSpec-layout Gemma 4 draft at `source` (attention_k_eq_v, no softcap: what upstream's
    converter accepts) as a `dflash` GGUF with upstream's keys and names; no embedding / head copies.
    `extra_keys`: float keys by full name, replacing any written (files that do not fit)."""
    from gguf import GGUFWriter

    from mlx_dspark.testing.gguf_writer import _write, add_tokenizer

    source, path = Path(source), Path(path)
    c = json.loads((source / "config.json").read_text(encoding="utf-8"))
    if not c["attention_k_eq_v"] or c.get("final_logit_softcapping"):
        raise ValueError("upstream's converter writes only attention_k_eq_v Gemma 4 drafts without a softcap")
    p, head_dim = "dflash.", c["global_head_dim"]
    rope = c["rope_parameters"]["full_attention"]
    writer = GGUFWriter(path, "dflash")
    for key, value in (
        ("block_count", c["num_hidden_layers"]), ("context_length", c["max_position_embeddings"]),
        ("embedding_length", c["hidden_size"]), ("feed_forward_length", c["intermediate_size"]),
        ("attention.head_count", c["num_attention_heads"]), ("attention.head_count_kv", c["num_global_key_value_heads"]),
        ("attention.key_length", head_dim), ("attention.value_length", head_dim), ("rope.dimension_count", head_dim),
        ("block_size", c["block_size"]),
    ):  # fmt: skip
        writer.add_uint32(p + key, value)
    writer.add_float32(p + "attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    writer.add_float32(p + "rope.freq_base", rope["rope_theta"])
    writer.add_float32(p + "embedding_scale", c["hidden_size"] ** 0.5)
    writer.add_float32(p + "attention.scale", 1.0)
    writer.add_string(p + "hidden_activation", "gelu_pytorch_tanh")
    writer.add_array(p + "target_layers", [i + 1 for i in c["target_layer_ids"]])
    writer.add_bool(p + "sample_from_anchor", True)
    writer.add_bool(p + "has_confidence_head", True)
    for key, value in (extra_keys or {}).items():
        writer.kv_data[0].pop(key, None)
        writer.add_float32(key, value)
    add_tokenizer(writer, Path(target_path), mask_key="tokenizer.ggml.mask_token_id")
    tensors = {}
    for name, array in _read_hf_weights(source).items():
        if name.startswith(_SHARED):
            continue
        if name in _GEMMA4_GGUF_GLOBAL:
            tensors[_GEMMA4_GGUF_GLOBAL[name]] = array
            continue
        _, i, rest = name.split(".", 2)
        if rest == "layer_scalar":
            tensors[f"blk.{i}.layer_output_scale.weight"] = array
        else:
            tensors[f"blk.{i}.{_GEMMA4_GGUF_LAYER[rest.removesuffix('.weight')]}.weight"] = array
    if rope.get("rope_type") == "proportional":
        turning = int(head_dim * rope.get("partial_rotary_factor", 0.25) / 2)
        tensors["rope_freqs.weight"] = np.array([1.0] * turning + [1e30] * (head_dim // 2 - turning), dtype=np.float32)
    _write(writer, tensors, tensor_type="F32", tensor_types={}, seed=0)
    return path
