"""GGUF files in upstream llama.cpp's layouts, written from tiny checkpoint directories (test fixtures).

`write_gguf_target` converts a tiny Hugging Face causal LM (a spark2_5 or qwen3 target; a llama, qwen2 or
qwen3 draft model) and `write_gguf_draft` a tiny DeepSpec draft into a GGUF with `gguf.GGUFWriter`, as
upstream's converter would: names mapped (the table of GGUF.md, restated here so that the reader is checked
against an independent copy), no permutes but llama's (its converter reorders each q / k head's rows for
llama.cpp's interleaved RoPE: `llama_permute`), sizes and windows as `<arch>.*` keys, the tokenizer as
`tokenizer.ggml.*` keys. Options
cover the variations real files have: the `dflash` / `dspark` prefix, `target_layers` as HF id + 1 or
unchanged, with or without `token_embd` / `output`, the mask id under either key, tensor types F32,
F16, BF16, Q8_0, Q4_0, Q4_1 (quantized from the weights by `gguf.quants`) and K-quants (random but
valid blocks: gguf cannot quantize to them, so those tensors do NOT hold the source's values).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

from mlx_dspark.testing.tiny import _read_hf_weights

TOKEN_TYPES = {"normal": 1, "control": 3, "user_defined": 4, "unused": 5}
# K-quant blocks: byte offsets of their float16 super-block scales (the rest may be any bytes)
_KQUANT_FP16 = {"Q2_K": (-4, -2), "Q3_K": (-2,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (-2,)}

_COMMON = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_QWEN3 = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_SPARK = {"self_attn.q_k_v_proj": "attn_qkv", "self_attn.g_proj": "attn_gate", "self_attn.out_proj": "attn_output"}
_DRAFT = {
    "fc": "fc",
    "hidden_norm": "enc.output_norm",
    "norm": "output_norm",
    "markov_head.markov_w1": "markov_w1",
    "markov_head.markov_w2": "markov_w2",
    "confidence_head.proj": "conf_proj",
    "embed_tokens": "token_embd",
    "embedding": "token_embd",
    "lm_head": "output",
}
_TARGET = {"model.embed_tokens": "token_embd", "model.embedding": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(name: str, *, layer_prefix: str, globals_: dict[str, str]) -> str:
    """Our tensor name -> upstream's GGUF name (KeyError for a name upstream has none for)."""
    stem, suffix = name.rsplit(".", 1)
    if stem.startswith(layer_prefix):
        index, rest = stem[len(layer_prefix) :].split(".", 1)
        return f"blk.{index}.{({**_COMMON, **_QWEN3, **_SPARK})[rest]}.{suffix}"
    return f"{globals_[stem]}.{suffix}"


def llama_permute(array: np.ndarray, heads: int) -> np.ndarray:
    """upstream's `LlamaModel.permute` (convert_hf_to_gguf.py), restated: each head's rows (rotate-half order:
    the first halves of the rotated pairs, then the second halves) interleaved (pair members side by side)."""
    return array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def encode(array: np.ndarray, kind: str, *, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    """(data, raw_dtype) for GGUFWriter.add_tensor. 1-D tensors always stay F32, as upstream's."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
    from gguf.quants import quantize

    array = np.ascontiguousarray(array, dtype=np.float32)
    if kind == "F32" or array.ndim == 1:
        return array, None
    if kind == "F16":
        return array.astype(np.float16), None
    qtype = T[kind]
    if kind in _KQUANT_FP16:
        block, size = GGML_QUANT_SIZES[qtype]
        rows, cols = array.shape
        blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        for offset in _KQUANT_FP16[kind]:
            d = rng.uniform(1e-3, 1e-2, size=(rows, cols // block)).astype(np.float16)
            end = offset + 2 if offset + 2 != 0 else None
            blocks[..., offset:end] = d.view(np.uint8).reshape(rows, cols // block, 2)
        return blocks.reshape(rows, -1), qtype
    return quantize(array, qtype), qtype


def _looks_special(token: str) -> bool:
    """Added tokens upstream's converter marks as control even when the tokenizer says not special."""
    return token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or any(
        token.startswith(a) and token.endswith(b) for a, b in (("<|", "|>"), ("<｜", "｜>"), ("<unused", ">"))
    )


def tokenizer_metadata(directory: Path) -> dict[str, Any]:
    """`tokenizer.ggml.*` values of a Hugging Face tokenizer directory, as llama.cpp's converter writes
    them: every id's token (added tokens by content, holes as "[PAD<i>]" unused), its type, the
    merges, the special ids, add_bos and the chat template."""
    tok = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    tok_config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    by_id = {i: (t, "normal") for t, i in tok["model"]["vocab"].items()}
    for added in tok["added_tokens"]:
        by_id[added["id"]] = (added["content"], "control" if added["special"] or _looks_special(added["content"]) else "user_defined")
    size = max(by_id) + 1
    tokens = [by_id.get(i, (f"[PAD{i}]", "unused")) for i in range(size)]
    content_ids = {t: i for i, (t, _) in enumerate(tokens)}
    pre = tok["pre_tokenizer"]
    if pre["type"] == "ByteLevel" and pre.get("use_regex", True):
        pre_name = "gpt-2"
    else:
        # upstream names the pre-tokenizer by hashing an encoding of a probe text; the split regexes
        # identify the same families here
        from mlx_dspark.loading.gguf_tokenizer import PRE_TOKENIZERS

        splits = tuple(p["pattern"]["Regex"] for p in pre["pretokenizers"] if p["type"] == "Split")
        names = {v[0]: k for k, v in reversed(PRE_TOKENIZERS.items())}  # first name of each split list
        names[PRE_TOKENIZERS["llama-bpe"][0]] = "llama-bpe"
        pre_name = names[splits]
    eos = config["eos_token_id"]
    meta = {
        "model": "gpt2",
        "pre": pre_name,
        "tokens": [t for t, _ in tokens],
        "token_type": [TOKEN_TYPES[k] for _, k in tokens],
        "merges": [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]],
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": eos[0] if isinstance(eos, list) else eos,
        "padding_token_id": config.get("pad_token_id"),
        "add_bos_token": bool(tok_config.get("add_bos_token", False)),
        "chat_template": tok_config.get("chat_template"),
    }
    if tok_config.get("mask_token"):
        meta["mask_token_id"] = content_ids[tok_config["mask_token"]]
    return meta


def add_tokenizer(
    writer: Any, directory: Path, *, mask_key: Optional[str] = "tokenizer.ggml.mask_token_id", pre: Optional[str] = None
) -> dict[str, Any]:
    """pre: the `tokenizer.ggml.pre` name to write instead of the one the directory's tokenizer has."""
    meta = tokenizer_metadata(directory)
    if pre is not None:
        meta["pre"] = pre
    writer.add_tokenizer_model(meta["model"])
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["token_type"])
    writer.add_token_merges(meta["merges"])
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if meta[key] is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}", meta[key])
    writer.add_add_bos_token(meta["add_bos_token"])
    if meta["chat_template"]:
        writer.add_chat_template(meta["chat_template"])
    if mask_key is not None and "mask_token_id" in meta:
        writer.add_uint32(mask_key, meta["mask_token_id"])
    return meta


def _add_sizes(writer: Any, arch: str, config: dict[str, Any]) -> None:
    p = f"{arch}."
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_uint32(p + "block_count", config["num_hidden_layers"])
    writer.add_uint32(p + "context_length", config.get("max_position_embeddings", 4096))
    writer.add_uint32(p + "embedding_length", config["hidden_size"])
    writer.add_uint32(p + "feed_forward_length", config["intermediate_size"])
    writer.add_uint32(p + "attention.head_count", config["num_attention_heads"])
    writer.add_uint32(p + "attention.head_count_kv", config["num_key_value_heads"])
    writer.add_uint32(p + "attention.key_length", head_dim)
    writer.add_uint32(p + "attention.value_length", head_dim)
    writer.add_float32(p + "attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    if config["model_type"] == "spark2_5":
        rope = config["rope_parameters"]
        full = rope["full_attention"]
        writer.add_float32(p + "rope.freq_base", full["rope_theta"])
        writer.add_uint32(p + "rope.dimension_count", int(head_dim * full.get("partial_rotary_factor", 1.0)))
        if "sliding_attention" in rope:
            swa = rope["sliding_attention"]
            writer.add_float32(p + "rope.freq_base_swa", swa["rope_theta"])
            writer.add_uint32(p + "rope.dimension_count_swa", int(head_dim * swa.get("partial_rotary_factor", 1.0)))
    else:
        writer.add_float32(p + "rope.freq_base", config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
        writer.add_uint32(p + "rope.dimension_count", head_dim)
    types = config.get("layer_types") or []
    if "sliding_attention" in types:
        writer.add_uint32(p + "attention.sliding_window", config["sliding_window"])
        writer.add_array(p + "attention.sliding_window_pattern", [t == "sliding_attention" for t in types])


def _add_keys(writer: Any, keys: dict[str, Any]) -> None:
    """More key/values by full name (bool, int as u32, float as f32, str), each replacing one written before."""
    for key, value in keys.items():
        writer.kv_data[0].pop(key, None)
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)


def _write(writer: Any, tensors: dict[str, np.ndarray], *, tensor_type: str, tensor_types: dict[str, str], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for name, array in tensors.items():
        if array.dtype.kind in "iu":  # e.g. d2t (I64): written as is
            writer.add_tensor(name, array)
            continue
        data, raw = encode(array, tensor_types.get(name, tensor_type), rng=rng)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf_target(
    source: str | Path,
    path: str | Path,
    *,
    tensor_type: str = "F32",
    tensor_types: Optional[dict[str, str]] = None,
    separate_qkv: bool = False,
    tokenizer: bool = True,
    tokenizer_pre: Optional[str] = None,
    extra_keys: Optional[dict[str, Any]] = None,
    extra_tensors: Optional[dict[str, np.ndarray]] = None,
    seed: int = 0,
) -> Path:
    """A GGUF of a causal LM (architecture = the family) from the tiny Hugging Face model at `source`.

    tensor_type: the type of every 2-D tensor; tensor_types: per-GGUF-name overrides; separate_qkv:
    a spark2_5 target's fused q_k_v_proj stored as attn_q / attn_k / attn_v; tokenizer: write the
    `tokenizer.ggml.*` keys; tokenizer_pre: another `tokenizer.ggml.pre` name (as a vendor's converter
    may write for its own pre-tokenizer); extra_keys / extra_tensors (GGUF names): as `write_gguf_draft`'s."""
    from gguf import GGUFWriter

    source, path = Path(source), Path(path)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    arch = config["model_type"]
    writer = GGUFWriter(path, arch)
    _add_sizes(writer, arch, config)
    if arch == "llama":
        writer.add_uint32(f"{arch}.vocab_size", config["vocab_size"])
    _add_keys(writer, extra_keys or {})
    if tokenizer:
        add_tokenizer(writer, source, mask_key=None, pre=tokenizer_pre)
    tensors = {}
    for name, array in _read_hf_weights(source).items():
        gname = gguf_name(name, layer_prefix="model.layers.", globals_=_TARGET)
        kind = gname.split(".")[-2]
        if arch == "llama" and kind in ("attn_q", "attn_k"):  # weight and bias alike, as upstream
            array = llama_permute(array, config["num_key_value_heads" if kind == "attn_k" else "num_attention_heads"])
        if separate_qkv and gname.endswith("attn_qkv.weight"):
            heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
            q, k, v = np.split(array, [heads * hd, (heads + kv) * hd])
            for part, arr in (("attn_q", q), ("attn_k", k), ("attn_v", v)):
                tensors[gname.replace("attn_qkv", part)] = arr
            continue
        tensors[gname] = array
    tensors.update(extra_tensors or {})
    _write(writer, tensors, tensor_type=tensor_type, tensor_types=tensor_types or {}, seed=seed)
    return path


def write_gguf_draft(
    source: str | Path,
    path: str | Path,
    *,
    target_path: str | Path,
    arch: str = "dflash",
    tap_convention: str = "plus_one",
    include_shared: bool = True,
    mask_key: str = "tokenizer",
    tensor_type: str = "F32",
    tensor_types: Optional[dict[str, str]] = None,
    extra_tensors: Optional[dict[str, np.ndarray]] = None,
    drop_tensors: tuple[str, ...] = (),
    extra_keys: Optional[dict[str, Any]] = None,
    seed: int = 0,
) -> Path:
    """A DSpark draft GGUF from the tiny DeepSpec draft at `source` (tokenizer keys from its target).

    arch: "dflash" (current upstream) or "dspark" (PR era: also writes markov_rank / markov_head_type);
    tap_convention: "plus_one" (target_layers = HF id + 1, current converters) or "hf" (unchanged, older
    ones); include_shared: write the draft's copies of the target's embedding / head as token_embd /
    output; mask_key: "tokenizer" (tokenizer.ggml.mask_token_id) or "arch" (<arch>.mask_token_id);
    extra_tensors / drop_tensors (GGUF names): for files that do not fit (extra ones replace same-named);
    extra_keys: more key/values, by full name (bool, int as u32, float as f32, str), e.g. upstream's
    `dflash.sample_from_anchor` or `dflash.attention.value_scale`."""
    from gguf import GGUFWriter

    source, path, target_path = Path(source), Path(path), Path(target_path)
    if tap_convention not in ("plus_one", "hf"):
        raise ValueError(f"tap_convention {tap_convention!r} is not 'plus_one' or 'hf'")
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    p = f"{arch}."
    writer = GGUFWriter(path, arch)
    _add_sizes(writer, arch, config)
    shift = 1 if tap_convention == "plus_one" else 0
    writer.add_array(p + "target_layers", [i + shift for i in config["target_layer_ids"]])
    writer.add_uint32(p + "block_size", config["block_size"])
    writer.add_bool(p + "attention.causal", False)
    writer.add_bool(p + "has_confidence_head", bool(config["enable_confidence_head"]))
    if arch == "dspark":
        writer.add_uint32(p + "markov_rank", config["markov_rank"])
        writer.add_string(p + "markov_head_type", config["markov_head_type"])
    _add_keys(writer, extra_keys or {})  # may replace a key written above (e.g. rope.dimension_count)
    meta = add_tokenizer(writer, target_path, mask_key="tokenizer.ggml.mask_token_id" if mask_key == "tokenizer" else None)
    if mask_key == "arch":
        writer.add_uint32(p + "mask_token_id", config["mask_token_id"])
    elif meta.get("mask_token_id") != config["mask_token_id"]:
        raise ValueError(f"{target_path}: the tokenizer's mask token is not the draft's mask_token_id {config['mask_token_id']}")
    tensors = {}
    for name, array in _read_hf_weights(source).items():
        gname = gguf_name(name, layer_prefix="layers.", globals_=_DRAFT)
        if gname.split(".")[0] in ("token_embd", "output") and not include_shared:
            continue
        if gname not in drop_tensors:
            tensors[gname] = array
    tensors.update(extra_tensors or {})
    _write(writer, tensors, tensor_type=tensor_type, tensor_types=tensor_types or {}, seed=seed)
    return path
