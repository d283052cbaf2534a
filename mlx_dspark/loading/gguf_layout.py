"""GGUF metadata -> our config layout and tensor names, for the four kinds of file: spark2_5 and qwen3
targets (Hugging Face names), and DSpark drafts (`dflash` / `dspark`) of either layer family
(DeepSpec names). Upstream's converters map names only, so no tensor is permuted (GGUF.md)."""

from __future__ import annotations

import re
from typing import Any, Optional

import numpy as np

from mlx_dspark.loading import gguf_dflash2, gguf_gemma4
from mlx_dspark.loading.gguf_metadata import Metadata

TARGET_ARCHITECTURES = {"spark2_5": "Spark2_5ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DRAFT_CLASSES = {"qwen3": "Qwen3DSparkModel", "spark2_5": "Spark2_5DSparkModel", "gemma4": "Gemma4DSparkModel"}

# Tensor names, without the `.weight` / `.bias` suffix.
LAYER_COMMON = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_QWEN3 = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
LAYER_SPARK = {
    "attn_qkv": "self_attn.q_k_v_proj",
    "attn_gate": "self_attn.g_proj",
    "attn_output": "self_attn.out_proj",
}
SEPARATE_QKV = ("attn_q", "attn_k", "attn_v")  # a spark2_5 target may store these instead of attn_qkv
DRAFT_GLOBAL = {
    "fc": "fc",
    "enc.output_norm": "hidden_norm",
    "output_norm": "norm",
    "markov_w1": "markov_head.markov_w1",
    "markov_w2": "markov_head.markov_w2",
    "conf_proj": "confidence_head.proj",
    "token_embd": "embed_tokens",  # the target's copies: compared with the target's, then shared
    "output": "lm_head",
}
DRAFT_SHARED = ("token_embd", "output")


def size_fields(meta: Metadata, arch: str) -> dict[str, Any]:
    """The size fields every family shares, from `<arch>.*` keys."""
    p = f"{arch}."
    hidden = meta.integer(p + "embedding_length", low=1)
    heads = meta.integer(p + "attention.head_count", low=1)
    kv_heads = meta.integer(p + "attention.head_count_kv", heads, low=1)
    head_dim = meta.integer(p + "attention.key_length", hidden // heads, low=1)
    value_dim = meta.integer(p + "attention.value_length", head_dim, low=1)
    if value_dim != head_dim:
        raise ValueError(f"{meta.path}: {p}attention.value_length {value_dim} differs from key_length {head_dim}; not supported")
    if heads % kv_heads:
        raise ValueError(f"{meta.path}: {p}attention.head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    sizes = {
        "hidden_size": hidden,
        "intermediate_size": meta.integer(p + "feed_forward_length", low=1),
        "num_hidden_layers": meta.integer(p + "block_count", low=1),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.number(p + "attention.layer_norm_rms_epsilon"),
        "attention_bias": False,
    }
    context = meta.integer(p + "context_length", None, low=1)
    if context is not None:
        sizes["max_position_embeddings"] = context
    return sizes


def _layer_types(meta: Metadata, arch: str, num_layers: int) -> tuple[list[str], Optional[int]]:
    """(layer_types, sliding_window) from `attention.sliding_window` and its pattern (a bool per layer,
    true = sliding; or llama.cpp's period n: every n-th layer is full)."""
    p = f"{arch}."
    window = meta.integer(p + "attention.sliding_window", None, low=0)
    if not window:
        return ["full_attention"] * num_layers, None
    key = p + "attention.sliding_window_pattern"
    pattern = meta.require(key, why=f"{p}attention.sliding_window is {window}; the pattern says which layers slide")
    if isinstance(pattern, list):
        if len(pattern) != num_layers or not all(isinstance(v, bool) for v in pattern):
            raise ValueError(f"{meta.path}: key {key!r} must hold {num_layers} bools (one per layer), got {pattern!r}")
        sliding = pattern
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers)]
    else:
        raise ValueError(f"{meta.path}: key {key!r} must be a bool array or a period, got {pattern!r}")
    return ["sliding_attention" if s else "full_attention" for s in sliding], window


def _family_fields(meta: Metadata, arch: str, family: str, sizes: dict[str, Any], layer_types: list[str], window: Optional[int]) -> dict[str, Any]:
    """RoPE, window and activation fields in the family's config.json layout."""
    p = f"{arch}."
    head_dim = sizes["head_dim"]
    theta = meta.number(p + "rope.freq_base")
    dims = meta.integer(p + "rope.dimension_count", head_dim, low=1)
    if family == "qwen3":
        theta_swa = meta.number(p + "rope.freq_base_swa", theta)
        dims_swa = meta.integer(p + "rope.dimension_count_swa", dims, low=1)  # as llama.cpp: n_rot_swa defaults to n_rot
        if dims == head_dim and dims_swa == head_dim and theta_swa == theta:
            rope_fields = {"rope_theta": theta, "rope_parameters": {"rope_theta": theta, "rope_type": "default"}}
        else:
            # upstream's graph ropes n_rot dims per layer type: per-type parameters, as a copied spark config has
            rope_fields = {"rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": dims / head_dim},
                "sliding_attention": {"rope_type": "default", "rope_theta": theta_swa, "partial_rotary_factor": dims_swa / head_dim},
            }}  # fmt: skip
        return {
            "model_type": "qwen3",
            # upstream's key for the draft MLP (absent: SiLU); a qwen3-style draft of a spark2_5 target may be GELU
            "hidden_act": meta.get(p + "hidden_activation", "silu"),
            **rope_fields,
            "rope_scaling": None,
            "layer_types": layer_types,
            "sliding_window": window,
            "use_sliding_window": window is not None,
            "max_window_layers": sizes["num_hidden_layers"],
        }
    rope = {"full_attention": {"rope_theta": theta, "partial_rotary_factor": dims / head_dim}}
    if "sliding_attention" in layer_types:
        # as llama.cpp's loader: the sliding layers' RoPE keys default to the full layers' (a Spark-style draft
        # converted from a copy of a Qwen3 config has one RoPE for every layer)
        rope["sliding_attention"] = {
            "rope_theta": meta.number(p + "rope.freq_base_swa", theta),
            "partial_rotary_factor": meta.integer(p + "rope.dimension_count_swa", dims, low=1) / head_dim,
        }
    return {
        "model_type": "spark2_5",
        "hidden_act": "gelu",
        "gate_attn_act_mode": "sigmoid",
        "headwise_attn_output_gate": True,
        "mlp_bias": False,
        "rope_parameters": rope,
        "layer_types": layer_types,
        "sliding_window": window,
    }


def special_ids(meta: Metadata, config: dict[str, Any]) -> None:
    for field_name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[field_name] = value


def target_layout(meta: Metadata, arch: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(config, GGUF tensor name -> our name) of a target."""
    sizes = size_fields(meta, arch)
    num_layers = sizes["num_hidden_layers"]
    embed_shape = meta.tensor_or_fail("token_embd.weight", "every target has its token embedding")
    layer_types, window = _layer_types(meta, arch, num_layers)
    config: dict[str, Any] = {"architectures": [TARGET_ARCHITECTURES[arch]], **sizes}
    config.update(_family_fields(meta, arch, arch, sizes, layer_types, window))
    config["vocab_size"] = embed_shape[0]
    config["tie_word_embeddings"] = "output.weight" not in meta.tensors
    special_ids(meta, config)

    embed = "model.embedding" if arch == "spark2_5" else "model.embed_tokens"
    names = {"token_embd.weight": f"{embed}.weight", "output_norm.weight": "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names["output.weight"] = "lm_head.weight"
    for i in range(num_layers):
        table = dict(LAYER_COMMON)
        if arch == "qwen3":
            table.update(LAYER_QWEN3)
        else:
            table.update(LAYER_SPARK)
            if f"blk.{i}.attn_qkv.weight" not in meta.tensors and f"blk.{i}.attn_q.weight" in meta.tensors:
                # separate Q/K/V: fused into q_k_v_proj when read (rows Q, then K, then V)
                del table["attn_qkv"]
                table.update({k: f"self_attn.q_k_v_proj#{j}" for j, k in enumerate(SEPARATE_QKV)})
        names.update({f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight" for g, h in table.items()})
    return dict(sorted(config.items())), names


def _draft_family(meta: Metadata) -> str:
    has_q, has_qkv = "blk.0.attn_q.weight" in meta.tensors, "blk.0.attn_qkv.weight" in meta.tensors
    if has_q == has_qkv:
        found = sorted(n for n in meta.tensors if n.startswith("blk.0.attn"))
        raise ValueError(
            f"{meta.path}: cannot tell the draft's layer family: expected blk.0.attn_q.weight (Qwen3-style layers) "
            f"or blk.0.attn_qkv.weight (Spark2_5-style layers), found {found}"
        )
    return "qwen3" if has_q else "spark2_5"


def draft_layout(meta: Metadata, arch: str, *, tap_ids: Optional[list[int]]) -> tuple[dict[str, Any], dict[str, str]]:
    """(config, GGUF tensor name -> our name) of a DSpark draft, in DeepSpec's config layout."""
    p = f"{arch}."
    family = "gemma4" if gguf_gemma4.is_gemma4_draft(meta) else _draft_family(meta)
    sizes = size_fields(meta, arch)
    hidden, num_layers = sizes["hidden_size"], sizes["num_hidden_layers"]
    layer_types, window = _layer_types(meta, arch, num_layers)
    config: dict[str, Any] = {"architectures": [DRAFT_CLASSES[family]], **sizes}
    if family == "gemma4":
        config.update(gguf_gemma4.fields(meta, p, sizes, layer_types))
    else:
        config.update(_family_fields(meta, arch, family, sizes, layer_types, window))

    layers = meta.require(p + "target_layers", why="the target layers the draft is conditioned on")
    if not isinstance(layers, list) or not layers or not all(isinstance(v, int) and not isinstance(v, bool) for v in layers):
        raise ValueError(f"{meta.path}: key {p + 'target_layers'!r} must be a non-empty integer array, got {layers!r}")
    if tap_ids is None:
        taps = [v - 1 for v in layers]  # upstream writes HF id + 1
        if min(taps) < -1:
            raise ValueError(f"{meta.path}: {p}target_layers {layers} holds values below 0; expected HF layer ids + 1")
    else:
        taps = list(tap_ids)
        if len(taps) != len(layers) or not all(isinstance(v, int) and v >= -1 for v in taps):
            raise ValueError(
                f"{meta.path}: tap_ids {tap_ids!r} must be {len(layers)} layer ids >= -1, one per entry of "
                f"{p}target_layers {layers}"
            )
    fc_shape = meta.tensor_or_fail("fc.weight", "the draft's fusion of the target features")
    if fc_shape != (hidden, len(taps) * hidden):
        raise ValueError(
            f"{meta.path}: tensor 'fc.weight' has shape {fc_shape}; expected {(hidden, len(taps) * hidden)} for "
            f"{len(taps)} target layers ({p}target_layers {layers}) of hidden size {hidden}"
        )
    # upstream: the Markov head (DSpark) is switched on by markov_w1's presence; without it a DFlash draft
    w1 = meta.shape("markov_w1.weight") if "markov_w1.weight" in meta.tensors else None
    vocab, rank = w1 if w1 is not None else (_vocab_size(meta, p), 0)
    head_type = meta.get(p + "markov_head_type", "vanilla")
    if head_type not in ("vanilla", 0):
        raise ValueError(f"{meta.path}: key {p + 'markov_head_type'!r} is {head_type!r}; only the vanilla Markov head is supported")
    declared_rank = meta.get(p + "markov_rank")
    if declared_rank is not None and declared_rank != rank:
        raise ValueError(f"{meta.path}: key {p + 'markov_rank'!r} is {declared_rank} but markov_w1.weight has shape {w1}")
    if meta.flag(p + "attention.causal", False):
        raise ValueError(f"{meta.path}: key {p + 'attention.causal'!r} is true; DSpark blocks attend without a causal mask")
    dflash2 = gguf_dflash2.is_dflash2_draft(meta, p)
    _refuse_other_drafts(meta, p, dflash2=dflash2)
    config.update(_packaging(meta, p, family, dflash2=dflash2))
    if dflash2:
        config.update(gguf_dflash2.fields(meta, p))
    if not rank:
        # upstream runs a file without markov_w1 as DFlash (common/speculative.cpp): drafts from the mask
        # rows 1.., whatever sample_from_anchor says
        config["sample_from_anchor"] = False
    if family == "gemma4":
        gguf_gemma4.drop_family_scales(config)
    confidence = meta.flag(p + "has_confidence_head", True)
    with_markov = False
    if confidence:
        conf = meta.tensor_or_fail("conf_proj.weight", f"{p}has_confidence_head is true")
        if conf not in ((1, hidden), (1, hidden + rank)):
            raise ValueError(
                f"{meta.path}: tensor 'conf_proj.weight' has shape {conf}; expected (1, {hidden}) or "
                f"(1, {hidden + rank}) (hidden size, plus the Markov rank when it reads the Markov feature)"
            )
        with_markov = conf[1] == hidden + rank
    mask = meta.get("tokenizer.ggml.mask_token_id", meta.get(p + "mask_token_id"))
    if mask is None:
        raise ValueError(f"{meta.path}: no mask token: neither 'tokenizer.ggml.mask_token_id' nor {p + 'mask_token_id'!r} is set")
    if "d2t" in meta.tensors:
        # a reduced vocabulary: markov_w2 and the draft's own `output` have one row per d2t entry
        (draft_vocab,) = meta.shape("d2t")
        config["draft_vocab_size"] = draft_vocab
        for name in ("markov_w2.weight", "output.weight"):
            shape = meta.tensor_or_fail(name, f"tensor 'd2t' gives the draft a vocabulary of {draft_vocab} rows")
            if shape[0] != draft_vocab:
                raise ValueError(f"{meta.path}: tensor {name!r} has shape {shape}; expected {draft_vocab} rows, one per entry of 'd2t'")
    config.update(
        {
            "vocab_size": vocab,
            "block_size": meta.integer(p + "block_size", 16, low=1),
            "target_layer_ids": taps,
            "mask_token_id": mask,
            "markov_rank": rank,
            "markov_head_type": "vanilla" if rank else None,
            "enable_confidence_head": confidence,
            "confidence_head_with_markov": with_markov,
        }
    )
    special_ids(meta, config)

    markov = () if rank else ("markov_w1", "markov_w2")
    names = {f"{g}.weight": f"{h}.weight" for g, h in DRAFT_GLOBAL.items() if g not in ("conf_proj", *DRAFT_SHARED, *markov)}
    if confidence:
        names["conf_proj.weight"] = "confidence_head.proj.weight"
        if "conf_proj.bias" in meta.tensors:  # optional upstream (absent: no bias, filled with 0 by gguf_checkpoint)
            names["conf_proj.bias"] = "confidence_head.proj.bias"
    for g in DRAFT_SHARED:  # optional: absent means "share the target's" (a reduced vocabulary's output is its own)
        if f"{g}.weight" in meta.tensors:
            names[f"{g}.weight"] = f"{DRAFT_GLOBAL[g]}.weight"
    for name in DRAFT_VALUES:  # read into the config / as offsets by gguf_checkpoint
        if name in meta.tensors:
            names[name] = name
    if dflash2:
        names.update(gguf_dflash2.tensor_names(num_layers))
    if family == "gemma4":
        names.update(gguf_gemma4.layer_names(num_layers))
        return dict(sorted(config.items())), names
    table = {**LAYER_COMMON, **(LAYER_QWEN3 if family == "qwen3" else LAYER_SPARK)}
    for i in range(num_layers):
        names.update({f"blk.{i}.{g}.weight": f"layers.{i}.{h}.weight" for g, h in table.items()})
    return dict(sorted(config.items())), names


def _vocab_size(meta: Metadata, p: str) -> int:
    """A DFlash draft's vocabulary (no markov_w1 to read it from): the key, the tokenizer, or a shared copy."""
    size = meta.get(p + "vocab_size")
    if size is None and isinstance(meta.get("tokenizer.ggml.tokens"), list):
        size = len(meta.get("tokenizer.ggml.tokens"))
    for name in ("output.weight", "token_embd.weight"):
        if size is None and name in meta.tensors:
            size = meta.shape(name)[0]
    if size is None:
        raise ValueError(f"{meta.path}: no vocabulary size: no markov_w1.weight, {p}vocab_size, tokenizer.ggml.tokens or token_embd")
    return size


# Draft tensors that are not weights: the Markov bias scale (one value, into the config) and the d2t table.
DRAFT_VALUES = ("markov_w2.scale", "d2t", gguf_gemma4.ROPE_FREQS)
# dflash.hidden_activation -> our hidden_act (upstream: absent = silu; "gelu" and "gelu_pytorch_tanh"
# both run ggml's tanh GELU there; we follow the Hugging Face names: "gelu" is the exact erf form)
_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_pytorch_tanh"}


def _refuse_other_drafts(meta: Metadata, p: str, *, dflash2: bool) -> None:
    """DeepSeek-V4 DSpark drafts share the architecture name, not the graph; so do DFlash2 drafts (read by
    gguf_dflash2), whose conv keys without the selector are a file we cannot tell apart."""
    if meta.get(p + "hyper_connection_count") is not None:
        raise ValueError(f"{meta.path}: key {p + 'hyper_connection_count'!r} is set: this is a DeepSeek-V4 DSpark draft, a different graph; not supported")
    for key in ("conv_kernel_size", "selector_rank"):
        if meta.get(p + key) is not None and not dflash2:
            raise ValueError(
                f"{meta.path}: key {p + key!r} is set but the file has no DFlash2 selector (tensor 'selector_hidden.weight', "
                f"key {p + 'selector_top_k'!r} > 0); not a graph we run"
            )


def _packaging(meta: Metadata, p: str, family: str, *, dflash2: bool = False) -> dict[str, Any]:
    """The draft keys beyond DeepSpec's layout, as config fields (models/heads/dspark/packaging.py)."""
    fields: dict[str, Any] = {"sample_from_anchor": meta.flag(p + "sample_from_anchor", True)}
    act = meta.get(p + "hidden_activation")
    if act is not None:
        if act not in _ACTIVATIONS:
            raise ValueError(f"{meta.path}: key {p + 'hidden_activation'!r} is {act!r}; expected one of {sorted(_ACTIVATIONS)}")
        if family == "spark2_5" and act != "gelu":
            raise ValueError(f"{meta.path}: key {p + 'hidden_activation'!r} is {act!r}; Spark2_5-style draft layers use 'gelu'")
        fields["hidden_act"] = _ACTIVATIONS[act]
    for key, identity in (("logit_scale", 1.0), ("final_logit_softcapping", 0.0)):
        value = meta.number(p + key, None)
        if value is not None and value != identity and not dflash2:  # DFlash2's selector applies them (gguf_dflash2)
            raise ValueError(
                f"{meta.path}: key {p + key!r} is {value:g}; not supported: upstream's DSpark graph reads it but applies "
                "it nowhere (only DFlash2's does), so how the draft was trained with it is unknown"
            )
    for key, name in (
        ("attention.value_scale", "attention_value_scale"),
        ("attention.scale", "attention_scale"),
        ("embedding_scale", "input_embedding_scale"),
    ):
        value = meta.number(p + key, None)
        if value is not None:
            fields[name] = value
    if "markov_w2.scale" in meta.tensors:
        values = np.asarray(meta.tensors["markov_w2.scale"].data, dtype=np.float32).reshape(-1)
        if values.size != 1:
            raise ValueError(f"{meta.path}: tensor 'markov_w2.scale' holds {values.size} values; expected one")
        fields["markov_w2_scale"] = float(str(values[0]))  # as a float key is read: the shortest decimal of the float32
    return fields


def check_names(meta: Metadata, names: dict[str, str]) -> None:
    missing = sorted(set(names) - set(meta.tensors), key=natural_order)
    unexpected = sorted(set(meta.tensors) - set(names), key=natural_order)
    problems = []
    if missing:
        problems.append(f"missing tensor(s) {short_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensor(s) {short_list(unexpected)}")
    if problems:
        raise ValueError(
            f"{meta.path}: the {meta.architecture} GGUF's tensors do not match its metadata "
            f"({meta.architecture}.block_count {meta.get(meta.architecture + '.block_count')}): " + "; ".join(problems)
        )


def natural_order(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def short_list(names: list[str], limit: int = 12) -> str:
    return str(names if len(names) <= limit else names[:limit] + [f"... {len(names) - limit} more"])
