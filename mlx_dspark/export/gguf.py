"""Write a DSpark draft as upstream llama.cpp's draft GGUF (architecture `dflash`; GGUF.md).

What upstream's converter (`conversion/qwen.py: DSparkModel`) writes, and what its runtime
(`src/models/dflash.cpp`, `--spec-type draft-dspark`) reads: `dflash.*` sizes, `target_layers` = HF
layer id + 1, `block_size`, `sliding_window` + `sliding_window_pattern`, `attention.causal` false,
`sample_from_anchor` true, `has_confidence_head`, `hidden_activation`, the mask id as
`tokenizer.ggml.mask_token_id`, the target's tokenizer (`tokenizer.ggml.*`: llama.cpp checks that
draft and target vocabularies agree), and the tensors under upstream's names with no permutes: 2-D
tensors in the source's float type (F32 / F16 / BF16, or BF16 with `bf16=True`), 1-D tensors F32.

A DFlash 2 draft adds its convolutions and selector (`export/gguf_dflash2.py`); a draft without a
Markov head (DFlash, DFlash 2) is written without `markov_w1`, which upstream runs as DFlash (drafts
from row 1: `sample_from_anchor` false). Upstream has only the vanilla Markov head and Qwen3-style
draft layers. A draft with Spark2_5-style layers is written with the spark2_5 target's tensor names
(`attn_qkv`, `attn_gate`): our loader reads it, upstream's runtime does not (no graph for it). The target's embedding and LM head are left out
(llama.cpp shares the target's), and so are `confidence_temperatures` (upstream has no key for them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from mlx_dspark.export import gguf_dflash2
from mlx_dspark.loading.gguf_layout import DRAFT_GLOBAL, DRAFT_SHARED, LAYER_COMMON, LAYER_QWEN3, LAYER_SPARK
from mlx_dspark.export.source import ExportDraft
from mlx_dspark.loading.gguf_tokenizer import CONTROL, LLAMA3_SPLIT, NORMAL, QWEN2_SPLIT, UNUSED, USER_DEFINED, GGUFTokenizer

ARCH = "dflash"
# upstream's converter, the reader's tables turned around: DeepSpec tensor name (without .weight / .bias)
# -> GGUF name; the draft's copies of the target's embedding and head are not written here
_GLOBAL = {ours: name for name, ours in DRAFT_GLOBAL.items() if name not in DRAFT_SHARED}
_LAYER = {ours: name for table in (LAYER_COMMON, LAYER_QWEN3, LAYER_SPARK) for name, ours in table.items()}
# the tokenizer.json split regex -> tokenizer.ggml.pre (None: ByteLevel's built-in GPT-2 regex)
_PRE_NAMES = {None: "gpt-2", QWEN2_SPLIT: "qwen2", LLAMA3_SPLIT: "llama-bpe"}


def gguf_tensor_name(name: str, *, extra: Optional[dict[str, str]] = None) -> str:
    """A DeepSpec draft tensor name -> upstream's GGUF name (ValueError for one upstream has no name for);
    `extra`: whole names outside DeepSpec's layout (a DFlash 2 draft's convolutions and selector)."""
    if extra and name in extra:
        return extra[name]
    stem, _, suffix = name.rpartition(".")
    if stem.startswith("layers."):
        index, _, rest = stem[len("layers.") :].partition(".")
        if rest in _LAYER:
            return f"blk.{index}.{_LAYER[rest]}.{suffix}"
    elif stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    raise ValueError(f"draft tensor {name!r} has no name in llama.cpp's DSpark GGUF layout")


# -- the tokenizer ----------------------------------------------------------------------------------


def hf_tokenizer(directory: Path) -> GGUFTokenizer:
    """The `tokenizer.ggml.*` material of a Hugging Face byte-level BPE tokenizer directory, as
    llama.cpp's converter builds it: every id's token (holes as unused `[PAD<i>]`), added tokens as
    control (special) or user-defined, the merges, the special ids of config.json, the chat template."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{directory}: no tokenizer.json for the GGUF's tokenizer keys; pass a target directory that has one")
    data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"{tokenizer_file}: model type {model.get('type')!r} is not supported (only byte-level BPE)")
    by_id = {int(i): (t, NORMAL) for t, i in model["vocab"].items()}
    for added in data.get("added_tokens", []):
        by_id[int(added["id"])] = (added["content"], CONTROL if added.get("special") else USER_DEFINED)
    tokens = [by_id.get(i, (f"[PAD{i}]", UNUSED)) for i in range(max(by_id) + 1)]
    config = _json(directory / "config.json")
    tok_config = _json(directory / "tokenizer_config.json")
    template = tok_config.get("chat_template")
    if not isinstance(template, str) and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    ids = {}
    for key, field in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "pad_token_id")):
        value = config.get(field)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            ids[key] = value
    return GGUFTokenizer(
        source=directory,
        model="gpt2",
        pre=_pre_name(data, config, source=tokenizer_file),
        tokens=[t for t, _ in tokens],
        token_types=[k for _, k in tokens],
        merges=[m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])],
        special_ids=ids,
        add_bos=bool(tok_config.get("add_bos_token", False)),
        add_eos=bool(tok_config.get("add_eos_token", False)),
        chat_template=template if isinstance(template, str) else None,
    )


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _pre_name(data: dict, config: dict, *, source: Path) -> str:
    if config.get("model_type") == "spark2_5":
        return "spark2_5"  # registered upstream for the Spark tokenizer (four splits, GGUF.md)
    pre = data.get("pre_tokenizer") or {}
    split: Optional[str] = None
    if pre.get("type") == "Sequence":
        splits = [p for p in pre.get("pretokenizers", []) if p.get("type") == "Split"]
        if len(splits) == 1:
            split = splits[0].get("pattern", {}).get("Regex")
        elif splits:
            split = "(several splits)"
    elif not (pre.get("type") == "ByteLevel" and pre.get("use_regex", True)):
        split = f"(pre-tokenizer {pre.get('type')!r})"
    if split not in _PRE_NAMES:
        raise ValueError(
            f"{source}: its pre-tokenizer {split!r} matches none llama.cpp knows by name here "
            f"(GPT-2, Qwen2, Llama 3, Spark); write the draft GGUF with upstream's converter and --target-model-dir"
        )
    return _PRE_NAMES[split]


def _add_tokenizer(writer: Any, tokenizer: GGUFTokenizer, *, mask_token_id: int) -> None:
    if not 0 <= mask_token_id < len(tokenizer.tokens):
        raise ValueError(f"the draft's mask_token_id {mask_token_id} is outside the tokenizer's {len(tokenizer.tokens)} tokens ({tokenizer.source})")
    writer.add_tokenizer_model(tokenizer.model)
    if tokenizer.pre:
        writer.add_tokenizer_pre(tokenizer.pre)
    writer.add_token_list(tokenizer.tokens)
    writer.add_token_types(tokenizer.token_types)
    if tokenizer.merges:
        writer.add_token_merges(tokenizer.merges)
    names = {"pad": "padding", "unk": "unknown"}
    for key, value in sorted(tokenizer.special_ids.items()):
        if key != "mask":
            writer.add_uint32(f"tokenizer.ggml.{names.get(key, key)}_token_id", value)
    writer.add_uint32("tokenizer.ggml.mask_token_id", mask_token_id)
    writer.add_add_bos_token(tokenizer.add_bos)
    writer.add_add_eos_token(tokenizer.add_eos)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


# -- keys and tensors -------------------------------------------------------------------------------


def check_exportable(draft: ExportDraft) -> None:
    """ValueError naming what upstream's DSpark GGUF cannot hold."""
    args = draft.args
    if args.family == "gemma4":
        raise ValueError(
            f"{draft.path}: the draft has Gemma 4 layers (sandwich norms, layer_scalar, scale-free v_norm, softcap); "
            "upstream's gemma4 DSpark GGUF layout is not one we write: export it --to deepspec"
        )
    if args.markov_rank == 0 and args.packaging.sample_from_anchor:
        raise ValueError(
            f"{draft.path}: the draft has no Markov head (markov_rank 0) but drafts from the anchor row: llama.cpp runs a "
            "dflash file without markov_w1 as DFlash, from row 1; export it --to deepspec"
        )
    if args.markov_rank and args.markov_head_type != "vanilla":
        raise ValueError(
            f"{draft.path}: the draft's Markov head is {args.markov_head_type} (markov_rank {args.markov_rank}); "
            "llama.cpp's DSpark GGUF has only the vanilla Markov head"
        )
    if draft.kind == "dflash2":
        gguf_dflash2.check(draft)


def _add_keys(writer: Any, draft: ExportDraft) -> None:
    args, layers = draft.args, draft.args.layers
    p = f"{ARCH}."
    head_dim = layers.head_dim
    writer.add_uint32(p + "block_count", layers.num_hidden_layers)
    context = draft.config.get("max_position_embeddings")
    if isinstance(context, int) and context > 0:
        writer.add_uint32(p + "context_length", context)
    writer.add_uint32(p + "embedding_length", layers.hidden_size)
    writer.add_uint32(p + "feed_forward_length", layers.intermediate_size)
    writer.add_uint32(p + "attention.head_count", layers.num_attention_heads)
    writer.add_uint32(p + "attention.head_count_kv", layers.num_key_value_heads)
    writer.add_uint32(p + "attention.key_length", head_dim)
    writer.add_uint32(p + "attention.value_length", head_dim)
    writer.add_float32(p + "attention.layer_norm_rms_epsilon", float(layers.rms_norm_eps))
    types = list(layers.layer_types)
    full_type = "full_attention" if "full_attention" in types else types[0]
    swa_type = "sliding_attention" if "sliding_attention" in types else full_type
    full, swa = layers.rope(full_type), layers.rope(swa_type)
    writer.add_float32(p + "rope.freq_base", float(full.base))
    writer.add_uint32(p + "rope.dimension_count", int(full.dims))
    writer.add_float32(p + "rope.freq_base_swa", float(swa.base))
    writer.add_uint32(p + "rope.dimension_count_swa", int(swa.dims))
    windows = {args.layer_window(i) for i in range(len(types))} - {None}
    if len(windows) > 1:
        raise ValueError(f"{draft.path}: the draft's layers slide over different windows {sorted(windows)}; GGUF has one")
    if windows:
        writer.add_uint32(p + "attention.sliding_window", windows.pop())
        writer.add_array(p + "attention.sliding_window_pattern", [args.layer_window(i) is not None for i in range(len(types))])
    writer.add_array(p + "target_layers", [i + 1 for i in args.target_layer_ids])  # upstream: HF id + 1
    writer.add_uint32(p + "block_size", args.block_size)
    writer.add_bool(p + "attention.causal", False)
    writer.add_bool(p + "sample_from_anchor", args.packaging.sample_from_anchor)
    writer.add_bool(p + "has_confidence_head", bool(args.enable_confidence_head))
    writer.add_string(p + "hidden_activation", layers.hidden_act)  # "silu" / "gelu", as upstream reads it
    packaging = args.packaging  # the scales a published packaging carries (models/heads/dspark/packaging.py)
    for key, value in (
        ("attention.value_scale", packaging.value_scale),
        ("attention.scale", packaging.attention_scale),
        ("embedding_scale", packaging.embedding_scale),
    ):
        if value is not None:
            writer.add_float32(p + key, value)
    if draft.kind == "dflash2":
        gguf_dflash2.add_keys(writer, draft, prefix=p)


def _tensor_data(array: mx.array, *, bf16: bool) -> tuple[np.ndarray, Any]:
    """(numpy data, raw GGML type or None) of one tensor: 1-D F32, 2-D and 3-D F32 / F16 / BF16."""
    from gguf import GGMLQuantizationType

    if array.ndim == 1 or (array.dtype == mx.float32 and not bf16):
        return np.array(array.astype(mx.float32)), None
    if array.dtype == mx.float16 and not bf16:
        return np.array(array), None
    raw = np.array(array.astype(mx.bfloat16).view(mx.uint16))  # BF16 bits exactly (numpy has no bfloat16)
    return raw.view(np.uint8), GGMLQuantizationType.BF16


def write_draft_gguf(
    draft: ExportDraft, out: Path, *, tokenizer: Optional[GGUFTokenizer], bf16: bool = False
) -> list[str]:
    """Write `draft` to the GGUF file `out`; returns notes for the user (what was left out)."""
    from gguf import GGUFWriter

    check_exportable(draft)
    if tokenizer is None:
        raise ValueError(
            f"{draft.path}: no tokenizer for the GGUF's tokenizer.ggml.* keys (llama.cpp needs the target's vocabulary "
            "in the draft file): pass --target with the target's directory or GGUF"
        )
    extra = gguf_dflash2.tensor_names(draft.args.num_hidden_layers) if draft.kind == "dflash2" else None
    tensors = {gguf_tensor_name(name, extra=extra): array for name, array in sorted(draft.weights.items())}
    tmp = out.with_name(out.name + ".tmp")
    writer = GGUFWriter(tmp, ARCH)
    writer.add_name(draft.path.name)
    _add_keys(writer, draft)
    _add_tokenizer(writer, tokenizer, mask_token_id=draft.args.mask_token_id)
    for name, array in tensors.items():
        data, raw = _tensor_data(array, bf16=bf16)
        writer.add_tensor(name, data, raw_dtype=raw)
    if draft.args.packaging.markov_w2_scale is not None:  # one value, as upstream stores it
        writer.add_tensor("markov_w2.scale", np.array([draft.args.packaging.markov_w2_scale], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    notes = ["the target's embedding and LM head are not in the file: llama.cpp uses the target's"]
    if draft.args.family == "spark2_5":
        notes.append(
            "the draft has Spark2_5-style layers (fused attn_qkv, attn_gate, GELU): our loader reads the file, "
            "upstream llama.cpp has a graph for Qwen3-style draft layers only"
        )
    if draft.args.confidence_temperatures:
        notes.append("confidence_temperatures (calibration) are not carried: GGUF has no key for them; recalibrate after loading")
    return notes
