"""A tiny random EAGLE-3 draft in vLLM speculators' layout, for any tiny target written by this package.

`config.json` as speculators' `Eagle3SpeculatorConfig` serialises it (`speculators_model_type: eagle3`,
`transformer_layer_config` a one-layer llama config whose vocabulary is the target's, `draft_vocab_size`,
`target_hidden_size`, `norm_before_residual`, `norm_before_fc`, `embed_requires_grad`,
`eagle_aux_hidden_state_layer_ids`, `speculators_config` with the greedy proposal's `speculative_tokens`);
`model.safetensors` with speculators' tensor names (`fc.weight` [C, 3C], `layers.0.*` with q/k/v over 2C and
`hidden_norm`, `norm`, `lm_head` [draft_vocab, C]), `d2t` int64 offsets and `t2d` bool as its
`DraftVocabMixin` saves them, float32, and optionally the frozen copy of the target's `embed_tokens`.
`specforge_names` writes the layer as SpecForge does (`midlayer.*`); `layer_type` "qwen3" a Qwen3 layer
(speculators' `Qwen3DecoderEagle3FirstLayer`: per-head `q_norm` / `k_norm`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from mlx_dspark.testing.tiny import _read_hf_weights
from mlx_dspark.testing.tiny_tokenizer import _write_json


def eagle3_config(
    target_config: dict[str, Any],
    *,
    draft_vocab_size: int,
    aux_layer_ids: Optional[Sequence[int]],
    speculative_tokens: int = 3,
    norm_before_residual: bool = False,
    layer_type: str = "llama",
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 256,
    hidden_size: Optional[int] = None,
    rope: Optional[dict[str, Any]] = None,
    embed_requires_grad: bool = False,
    norm_before_fc: bool = False,
) -> dict[str, Any]:
    """`hidden_size` the draft's width (None: the target's); `rope` replaces the layer's `rope_theta` /
    `rope_scaling`."""
    text = dict(target_config.get("text_config") or target_config)
    hidden = hidden_size or text["hidden_size"]
    layer = {
        "architectures": ["Qwen3ForCausalLM" if layer_type == "qwen3" else "LlamaForCausalLM"], "model_type": layer_type, "hidden_size": hidden,
        "intermediate_size": intermediate_size, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "max_position_embeddings": 4096, "vocab_size": text["vocab_size"], "tie_word_embeddings": False, **(rope or {}),
    }  # fmt: skip
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": text["hidden_size"],
        "norm_before_residual": norm_before_residual,
        "norm_before_fc": norm_before_fc,
        "embed_requires_grad": embed_requires_grad,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"architectures": target_config.get("architectures"), "name_or_path": "target"},
        },
        "torch_dtype": "float32",
    }
    if aux_layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    return config


def eagle3_weights(config: dict[str, Any], *, vocab_ids: np.ndarray, seed: int, hidden_scale: float = 1.0) -> dict[str, np.ndarray]:
    """Random float32 weights under speculators' names; `vocab_ids` (sorted target ids) the draft's rows."""
    rng = np.random.default_rng(seed)
    layer = config["transformer_layer_config"]
    C, H, KV, D, inner = (layer[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"))
    Ct, V = config["target_hidden_size"], layer["vocab_size"]

    def linear(out_dim: int, in_dim: int, scale: float = 1.0) -> np.ndarray:
        return (scale * rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    p = "layers.0."
    weights = {
        "fc.weight": linear(C, 3 * Ct, hidden_scale),
        p + "hidden_norm.weight": norm(C), p + "input_layernorm.weight": norm(C), p + "post_attention_layernorm.weight": norm(C),
        p + "self_attn.q_proj.weight": linear(H * D, 2 * C), p + "self_attn.k_proj.weight": linear(KV * D, 2 * C),
        p + "self_attn.v_proj.weight": linear(KV * D, 2 * C), p + "self_attn.o_proj.weight": linear(C, H * D),
        p + "mlp.gate_proj.weight": linear(inner, C), p + "mlp.up_proj.weight": linear(inner, C), p + "mlp.down_proj.weight": linear(C, inner),
        "norm.weight": norm(C),
        "lm_head.weight": linear(len(vocab_ids), C, 3.0),
    }  # fmt: skip
    if config.get("norm_before_fc"):  # gpt-oss drafts: an RMSNorm over the concatenated taps before fc
        weights["input_norm.weight"] = norm(3 * Ct)
    if layer["model_type"] == "qwen3":  # Qwen3Attention's per-head q/k RMSNorms
        weights.update({p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D)})
    ids = np.asarray(vocab_ids, dtype=np.int64)
    weights["d2t"] = ids - np.arange(ids.size, dtype=np.int64)  # offsets: target id = i + d2t[i]
    t2d = np.zeros(V, dtype=bool)
    t2d[ids] = True
    weights["t2d"] = t2d
    return weights


def write_eagle3_draft(
    path: str | Path,
    *,
    target_path: str | Path,
    seed: int = 0,
    draft_vocab_size: Optional[int] = None,
    aux_layer_ids: Optional[Sequence[int]] = (1, 2, 3),
    speculative_tokens: int = 3,
    norm_before_residual: bool = False,
    layer_type: str = "llama",
    include_embedding: bool = True,
    specforge_names: bool = False,
    hidden_size: Optional[int] = None,
    own_embedding: bool = False,
    rope: Optional[dict[str, Any]] = None,
    with_d2t: bool = True,
    norm_before_fc: bool = False,
) -> Path:
    """Write a random EAGLE-3 draft for the tiny target at `target_path` into `path`; return it.

    `draft_vocab_size` None: a third of the target's vocabulary (its lowest ids, where the tiny tokenizer's
    common bytes are, and a random rest); `aux_layer_ids` None leaves the field out (vLLM's default).
    `hidden_size`: the draft's width when not the target's; `own_embedding`: a random table of the draft's
    width in place of the target's copy (`embed_requires_grad` stays false: a width of its own says it);
    `rope`: the layer's rope fields; `with_d2t` False: no `d2t` / `t2d` (a full-vocabulary draft)."""
    from safetensors.numpy import save_file

    target_path, path = Path(target_path), Path(path)
    path.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((target_path / "config.json").read_text(encoding="utf-8"))
    vocab = (target_config.get("text_config") or target_config)["vocab_size"]
    size = draft_vocab_size or vocab // 3
    rng = np.random.default_rng(seed + 1)
    low = min(size // 2, vocab)
    rest = rng.choice(np.arange(low, vocab), size=size - low, replace=False)
    vocab_ids = np.sort(np.concatenate([np.arange(low), rest]))
    config = eagle3_config(target_config, draft_vocab_size=size, aux_layer_ids=aux_layer_ids,
                           speculative_tokens=speculative_tokens, norm_before_residual=norm_before_residual,
                           layer_type=layer_type, hidden_size=hidden_size, rope=rope, norm_before_fc=norm_before_fc)  # fmt: skip
    weights = eagle3_weights(config, vocab_ids=vocab_ids, seed=seed)
    if not with_d2t:
        weights = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
    if own_embedding:
        C = config["transformer_layer_config"]["hidden_size"]
        weights["embed_tokens.weight"] = (0.5 * np.random.default_rng(seed + 2).standard_normal((vocab, C))).astype(np.float32)
    elif include_embedding:
        target = _read_hf_weights(target_path)
        weights["embed_tokens.weight"] = next(v for k, v in target.items() if k.endswith("embed_tokens.weight"))
    if specforge_names:
        weights = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in weights.items()}
    _write_json(path / "config.json", config)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
