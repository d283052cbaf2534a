"""GGUF files (llama.cpp) read into our checkpoint form: a config in the Hugging Face / DeepSpec
config.json layout and tensors under the names of the equivalent safetensors checkpoint.

Targets (`general.architecture` `spark2_5` or `qwen3`) get Hugging Face names; DSpark drafts
(`dflash` in current upstream, `dspark` in PR-era files; keys are read under whichever prefix the file
names) get DeepSpec names, and their layer family comes from their own tensors: `blk.N.attn_q` is a
Qwen3-style layer, `blk.N.attn_qkv` (+ `attn_gate`) a Spark2_5-style one. The layouts are upstream's
(see GGUF.md): the converter maps names only, so no tensor is permuted.

Tensor types:
- F32, F16 as stored; BF16 exactly (the raw 16-bit patterns reinterpreted as bfloat16; `mx.load`
  would cast them to float16).
- Q8_0, Q4_0, Q4_1 stay quantized as MLX affine quantization with group size 32 and exactly the same
  values: Q8_0 `w = d*q` becomes `d*(q+128) - 128*d`, Q4_0 `w = d*(q-8)` becomes `d*q - 8*d`, Q4_1
  `w = d*q + m` is already affine. Scales and biases are float16, the precision of the blocks' own `d`.
- Every other type `gguf.quants` dequantizes (the K-quants Q2_K..Q6_K, Q5_0/Q5_1, IQ*, ...) is
  dequantized by it (llama.cpp's own code) and then, by default (`kquant="requantize"`), stored as
  MLX affine quantization with group size 32: 4 bits for sources of at most 4.5 bits per weight
  (Q4_K, IQ4, Q3_K, Q2_K), 8 bits for the wider ones (Q5_K, Q6_K, Q5_0/1). Why by default: the user
  chose a quantized file for its memory and speed; a bfloat16 copy would take 3.5x the memory of a
  Q4_K_M file and run at bfloat16 speed, and no source grid is replaced by a coarser one. Q4_K and
  Q5_K are affine per 32-weight sub-block (`d*sc*q - dmin*m`), so they keep their own grid (exact up
  to the float16 rounding of scale and bias); the others (16-weight sub-blocks, non-linear grids) are
  re-quantized with `mx.quantize` (within one MLX step). `kquant="bfloat16"` / `"float32"` keep the
  dequantized values instead (float32: exactly `gguf.quants.dequantize`).

Tensors are read one at a time from the reader's memory map (one copy into MLX memory each; K-quants
are dequantized in row chunks), so the file is never held twice. Every problem is one `ValueError`
naming the file and what does not fit.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np

DRAFT_ARCHITECTURES = ("dflash", "dspark")
TARGET_ARCHITECTURES = {"spark2_5": "Spark2_5ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROLES = ("draft", "target")
KQUANT_MODES = ("requantize", "bfloat16", "float32")
GROUP_SIZE = 32  # ggml's block of 32 weights (Q8_0, Q4_0, Q4_1 and the K-quants' sub-blocks)
_DEQUANT_ROWS = 4096  # rows dequantized at once, to bound the float32 temporaries

# Tensor names, without the `.weight` / `.bias` suffix.
_LAYER_COMMON = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_QWEN3 = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_SPARK = {
    "attn_qkv": "self_attn.q_k_v_proj",
    "attn_gate": "self_attn.g_proj",
    "attn_output": "self_attn.out_proj",
}
_SEPARATE_QKV = ("attn_q", "attn_k", "attn_v")  # a spark2_5 target may store these instead of attn_qkv
_DRAFT_GLOBAL = {
    "fc": "fc",
    "enc.output_norm": "hidden_norm",
    "output_norm": "norm",
    "markov_w1": "markov_head.markov_w1",
    "markov_w2": "markov_head.markov_w2",
    "conf_proj": "confidence_head.proj",
    "token_embd": "embed_tokens",  # the target's copies: compared with the target's, then shared
    "output": "lm_head",
}
_DRAFT_SHARED = ("token_embd", "output")
_REQUIRED = object()  # Metadata getters: no default, the key must be present


@dataclass
class GGUFCheckpoint:
    """A GGUF file read as a checkpoint: `config` (config.json layout), `weights` (our names),
    `tensor_types` (our name -> the GGUF tensor type it came from), and the tokenizer material
    (`tokenizer`, None when the file has no `tokenizer.ggml.*` keys)."""

    path: Path
    architecture: str  # general.architecture
    role: str  # "draft" or "target"
    config: dict[str, Any]
    weights: dict[str, mx.array]
    tensor_types: dict[str, str] = field(default_factory=dict)
    tokenizer: Any = None  # mlx_dspark.gguf_tokenizer.GGUFTokenizer

    @property
    def origin(self) -> dict[str, Path]:
        """Tensor name -> the file it came from (for the loader's messages)."""
        return {name: self.path for name in self.weights}


def read_gguf(
    path: str | Path,
    *,
    role: Optional[str] = None,
    tap_ids: Optional[list[int]] = None,
    kquant: str = "requantize",
) -> GGUFCheckpoint:
    """Read a GGUF target or DSpark draft (see the module docstring).

    role: "draft" / "target" to refuse the other kind with a clear message (None: either).
    tap_ids: the draft's tapped target layers as Hugging Face layer ids, overriding the file's
      `target_layers`. Current upstream converters write HF id + 1 (the runtime taps the input of that
      layer), which is how the file is read by default; a file from an older converter that wrote the
      HF ids unchanged needs the override, e.g. `tap_ids=[2, 10, 18, 25, 33]` for the published Spark
      draft (its card lists those HF ids for its 36-layer target).
    kquant: what becomes of K-quant (and other non-affine) tensors: "requantize" (default, MLX 4/8-bit),
      "bfloat16" or "float32".
    """
    from mlx_dspark.gguf_tokenizer import GGUFTokenizer

    path = Path(path)
    if role is not None and role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")
    if kquant not in KQUANT_MODES:
        raise ValueError(f"kquant {kquant!r} is not one of {KQUANT_MODES}")
    meta = Metadata.open(path)
    arch = meta.architecture
    if arch in DRAFT_ARCHITECTURES:
        kind = "draft"
    elif arch in TARGET_ARCHITECTURES:
        kind = "target"
    else:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; expected a DSpark draft "
            f"({', '.join(DRAFT_ARCHITECTURES)}) or a target ({', '.join(TARGET_ARCHITECTURES)})"
        )
    if role is not None and role != kind:
        raise ValueError(f"{path}: this GGUF is a {kind} (architecture {arch!r}), but it was given as the {role}")
    if kind == "target" and tap_ids is not None:
        raise ValueError(f"{path}: tap_ids apply to a DSpark draft, but this GGUF is a {arch} target")
    if "d2t" in meta.tensors:
        raise ValueError(
            f"{path}: tensor 'd2t' maps a reduced draft vocabulary to the target's; drafts with a reduced "
            "vocabulary are not supported (the draft must predict over the target's whole vocabulary)"
        )
    if kind == "target":
        config, names = _target_layout(meta, arch)
    else:
        config, names = _draft_layout(meta, arch, tap_ids=tap_ids)
    _check_names(meta, names)
    weights, types = _read_weights(meta, names, kquant=kquant, dequantize_only=_DRAFT_SHARED if kind == "draft" else ())
    quantization = _quantization_block(weights)
    if quantization:
        config["quantization"] = quantization
    tokenizer = GGUFTokenizer.from_metadata(meta)
    return GGUFCheckpoint(
        path=path, architecture=arch, role=kind, config=config, weights=weights, tensor_types=types, tokenizer=tokenizer
    )


# -- metadata --------------------------------------------------------------------------------------


class Metadata:
    """The key/values and tensor index of one GGUF file, with typed getters whose errors name the
    file and the key."""

    def __init__(self, path: Path, reader: Any):
        self.path = path
        self.reader = reader
        self.tensors = {t.name: t for t in reader.tensors}
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{path}: key 'general.architecture' is missing; not a model GGUF")
        self.architecture = arch

    @classmethod
    def open(cls, path: Path) -> "Metadata":
        from gguf import GGUFReader

        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        size = path.stat().st_size
        try:
            reader = GGUFReader(path)
        except (ValueError, IndexError, KeyError, OverflowError) as e:
            # the reader indexes past the end of a truncated memmap, or meets garbage in a corrupt header
            raise ValueError(f"{path}: not a readable GGUF file ({size} bytes; truncated or corrupt): {e}") from e
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError(
                    f"{path}: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes} but the file has {size} "
                    "(truncated download or corrupt file)"
                )
        return cls(path, reader)

    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return default if value is None else value

    def require(self, key: str, *, why: str = "") -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: key {key!r} is missing{' (' + why + ')' if why else ''}")
        return value

    def integer(self, key: str, default: Any = _REQUIRED, *, low: int = 0) -> Any:
        value = self.get(key)
        if value is None:
            return self.require(key) if default is _REQUIRED else default
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{self.path}: key {key!r} must be an integer >= {low}, got {value!r}")
        return value

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.get(key)
        if value is None:
            return self.require(key) if default is _REQUIRED else default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{self.path}: key {key!r} must be a number, got {value!r}")
        # GGUF floats are float32: the shortest decimal that reads back as the same float32 (1e-06)
        return float(str(np.float32(value))) if isinstance(value, float) else float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.path}: key {key!r} must be a bool, got {value!r}")
        return value

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's logical shape in numpy order (GGUF stores the dims reversed)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def tensor_or_fail(self, name: str, why: str) -> tuple[int, ...]:
        if name not in self.tensors:
            raise ValueError(f"{self.path}: tensor {name!r} is missing ({why})")
        return self.shape(name)


# -- configs ---------------------------------------------------------------------------------------


def _sizes(meta: Metadata, arch: str) -> dict[str, Any]:
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
        dims_swa = meta.integer(p + "rope.dimension_count_swa", head_dim, low=1)
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
            "hidden_act": "silu",
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


def _special_ids(meta: Metadata, config: dict[str, Any]) -> None:
    for field_name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[field_name] = value


def _target_layout(meta: Metadata, arch: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(config, GGUF tensor name -> our name) of a target."""
    sizes = _sizes(meta, arch)
    num_layers = sizes["num_hidden_layers"]
    embed_shape = meta.tensor_or_fail("token_embd.weight", "every target has its token embedding")
    layer_types, window = _layer_types(meta, arch, num_layers)
    config: dict[str, Any] = {"architectures": [TARGET_ARCHITECTURES[arch]], **sizes}
    config.update(_family_fields(meta, arch, arch, sizes, layer_types, window))
    config["vocab_size"] = embed_shape[0]
    config["tie_word_embeddings"] = "output.weight" not in meta.tensors
    _special_ids(meta, config)

    embed = "model.embedding" if arch == "spark2_5" else "model.embed_tokens"
    names = {"token_embd.weight": f"{embed}.weight", "output_norm.weight": "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names["output.weight"] = "lm_head.weight"
    for i in range(num_layers):
        table = dict(_LAYER_COMMON)
        if arch == "qwen3":
            table.update(_LAYER_QWEN3)
        else:
            table.update(_LAYER_SPARK)
            if f"blk.{i}.attn_qkv.weight" not in meta.tensors and f"blk.{i}.attn_q.weight" in meta.tensors:
                # separate Q/K/V: fused into q_k_v_proj when read (rows Q, then K, then V)
                del table["attn_qkv"]
                table.update({k: f"self_attn.q_k_v_proj#{j}" for j, k in enumerate(_SEPARATE_QKV)})
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


def _draft_layout(meta: Metadata, arch: str, *, tap_ids: Optional[list[int]]) -> tuple[dict[str, Any], dict[str, str]]:
    """(config, GGUF tensor name -> our name) of a DSpark draft, in DeepSpec's config layout."""
    p = f"{arch}."
    family = _draft_family(meta)
    sizes = _sizes(meta, arch)
    hidden, num_layers = sizes["hidden_size"], sizes["num_hidden_layers"]
    layer_types, window = _layer_types(meta, arch, num_layers)
    config: dict[str, Any] = {"architectures": ["Qwen3DSparkModel" if family == "qwen3" else "Spark2_5DSparkModel"], **sizes}
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
    w1 = meta.tensor_or_fail("markov_w1.weight", "the Markov head")
    vocab, rank = w1
    head_type = meta.get(p + "markov_head_type", "vanilla")
    if head_type not in ("vanilla", 0):
        raise ValueError(f"{meta.path}: key {p + 'markov_head_type'!r} is {head_type!r}; only the vanilla Markov head is supported")
    declared_rank = meta.get(p + "markov_rank")
    if declared_rank is not None and declared_rank != rank:
        raise ValueError(f"{meta.path}: key {p + 'markov_rank'!r} is {declared_rank} but markov_w1.weight has shape {w1}")
    if meta.flag(p + "attention.causal", False):
        raise ValueError(f"{meta.path}: key {p + 'attention.causal'!r} is true; DSpark blocks attend without a causal mask")
    if not meta.flag(p + "sample_from_anchor", True):
        raise ValueError(
            f"{meta.path}: key {p + 'sample_from_anchor'!r} is false (the anchor row yields no draft); only "
            "drafts whose every block row predicts the next token are supported"
        )
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
    config.update(
        {
            "vocab_size": vocab,
            "block_size": meta.integer(p + "block_size", 16, low=1),
            "target_layer_ids": taps,
            "mask_token_id": mask,
            "markov_rank": rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": confidence,
            "confidence_head_with_markov": with_markov,
        }
    )
    _special_ids(meta, config)

    names = {f"{g}.weight": f"{h}.weight" for g, h in _DRAFT_GLOBAL.items() if g not in ("conf_proj", *_DRAFT_SHARED)}
    if confidence:
        names.update({"conf_proj.weight": "confidence_head.proj.weight", "conf_proj.bias": "confidence_head.proj.bias"})
    for g in _DRAFT_SHARED:  # optional: absent means "share the target's"
        if f"{g}.weight" in meta.tensors:
            names[f"{g}.weight"] = f"{_DRAFT_GLOBAL[g]}.weight"
    table = {**_LAYER_COMMON, **(_LAYER_QWEN3 if family == "qwen3" else _LAYER_SPARK)}
    for i in range(num_layers):
        names.update({f"blk.{i}.{g}.weight": f"layers.{i}.{h}.weight" for g, h in table.items()})
    return dict(sorted(config.items())), names


def _check_names(meta: Metadata, names: dict[str, str]) -> None:
    missing = sorted(set(names) - set(meta.tensors), key=_natural)
    unexpected = sorted(set(meta.tensors) - set(names), key=_natural)
    problems = []
    if missing:
        problems.append(f"missing tensor(s) {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected tensor(s) {_short(unexpected)}")
    if problems:
        raise ValueError(
            f"{meta.path}: the {meta.architecture} GGUF's tensors do not match its metadata "
            f"({meta.architecture}.block_count {meta.get(meta.architecture + '.block_count')}): " + "; ".join(problems)
        )


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _short(names: list[str], limit: int = 12) -> str:
    return str(names if len(names) <= limit else names[:limit] + [f"... {len(names) - limit} more"])


# -- tensors ---------------------------------------------------------------------------------------


@dataclass
class _Tensor:
    weight: mx.array
    scales: Optional[mx.array] = None
    biases: Optional[mx.array] = None
    bits: Optional[int] = None
    ggml_type: str = ""

    def dequantized(self) -> mx.array:
        if self.scales is None:
            return self.weight.astype(mx.float32)
        return mx.dequantize(self.weight, self.scales.astype(mx.float32), self.biases.astype(mx.float32), group_size=GROUP_SIZE, bits=self.bits)


def _read_weights(
    meta: Metadata, names: dict[str, str], *, kquant: str, dequantize_only: tuple[str, ...]
) -> tuple[dict[str, mx.array], dict[str, str]]:
    weights: dict[str, mx.array] = {}
    types: dict[str, str] = {}
    fused: dict[str, list[_Tensor]] = {}
    for gguf_name, ours in names.items():
        t = meta.tensors[gguf_name]
        keep_float = gguf_name.split(".")[0] in dequantize_only  # the draft's copies of target tensors
        tensor = _read_tensor(meta, t, kquant="float32" if keep_float else kquant)
        if keep_float and tensor.scales is not None:
            tensor = _Tensor(tensor.dequantized(), ggml_type=tensor.ggml_type)
        if "#" in ours:
            stem, rest = ours.split("#")  # "<q_k_v_proj>#<part>.weight"
            index, suffix = rest.split(".", 1)
            fused.setdefault(f"{stem}.{suffix}", [None] * len(_SEPARATE_QKV))[int(index)] = tensor  # type: ignore[list-item]
            continue
        _put(weights, types, ours, tensor)
    for name, parts in fused.items():
        _put(weights, types, name, _concat_rows(parts))
    return dict(sorted(weights.items())), types


def _put(weights: dict[str, mx.array], types: dict[str, str], name: str, tensor: _Tensor) -> None:
    weights[name] = tensor.weight
    types[name] = tensor.ggml_type
    if tensor.scales is not None:
        prefix = name.removesuffix(".weight")
        weights[f"{prefix}.scales"] = tensor.scales
        weights[f"{prefix}.biases"] = tensor.biases


def _concat_rows(parts: list[_Tensor]) -> _Tensor:
    """Q, K, V stored separately, fused as q_k_v_proj (rows Q, then K, then V)."""
    kind = "+".join(p.ggml_type for p in parts)
    if all(p.scales is None for p in parts):
        dtypes = {p.weight.dtype for p in parts}
        dtype = dtypes.pop() if len(dtypes) == 1 else mx.float32
        return _Tensor(mx.concatenate([p.weight.astype(dtype) for p in parts]), ggml_type=kind)
    if all(p.scales is not None and p.bits == parts[0].bits for p in parts):
        return _Tensor(
            *(mx.concatenate([getattr(p, a) for p in parts]) for a in ("weight", "scales", "biases")),
            bits=parts[0].bits,
            ggml_type=kind,
        )
    # mixed storage: quantize the fused rows at the widest of the parts' widths
    bits = max(p.bits or 8 for p in parts)
    w, s, b = mx.quantize(mx.concatenate([p.dequantized() for p in parts]), group_size=GROUP_SIZE, bits=bits)
    return _Tensor(w, s.astype(mx.float16), b.astype(mx.float16), bits=bits, ggml_type=kind)


def _read_tensor(meta: Metadata, t: Any, *, kquant: str) -> _Tensor:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    kind = T(t.tensor_type)
    data = t.data  # numpy view on the memory map
    if kind in (T.F32, T.F16):
        return _Tensor(mx.array(np.ascontiguousarray(data)), ggml_type=kind.name)
    if kind == T.BF16:
        bits16 = np.ascontiguousarray(data).view(np.uint16)  # the raw bfloat16 patterns
        return _Tensor(mx.array(bits16).view(mx.bfloat16), ggml_type=kind.name)
    shape = meta.shape(t.name)
    if len(shape) != 2:
        raise ValueError(f"{meta.path}: tensor {t.name!r} is {kind.name} with shape {shape}; only 2-D quantized tensors are supported")
    rows, cols = shape
    if kind in (T.Q8_0, T.Q4_0, T.Q4_1):
        return _affine_blocks(np.asarray(data).reshape(rows, cols // GROUP_SIZE, -1), kind.name)
    block, type_size = GGML_QUANT_SIZES.get(kind, (None, None))
    if block is None or kind in (T.I8, T.I16, T.I32, T.I64, T.F64):
        raise ValueError(f"{meta.path}: tensor {t.name!r} has type {kind.name}, which is not supported")
    from gguf.quants import dequantize

    bits = 4 if type_size * 8 / block <= 4.5 else 8
    chunks = []
    for start in range(0, rows, _DEQUANT_ROWS):
        try:
            values = mx.array(dequantize(np.asarray(data[start : start + _DEQUANT_ROWS]), kind))  # (r, cols) float32
        except NotImplementedError as e:
            raise ValueError(f"{meta.path}: tensor {t.name!r} has type {kind.name}, which gguf cannot dequantize") from e
        if kquant == "requantize":
            if cols % GROUP_SIZE:
                raise ValueError(f"{meta.path}: tensor {t.name!r} ({kind.name}) has {cols} columns, not a multiple of {GROUP_SIZE}")
            if kind in (T.Q4_K, T.Q5_K):
                part = _kquant_affine(np.asarray(data[start : start + _DEQUANT_ROWS]), values, bits=bits)
            else:
                w, s, b = mx.quantize(values, group_size=GROUP_SIZE, bits=bits)
                part = (w, s.astype(mx.float16), b.astype(mx.float16))
        else:
            part = (values.astype(mx.bfloat16) if kquant == "bfloat16" else values,)
        mx.eval(part)  # frees the float32 chunk before the next one
        chunks.append(part)
    arrays = [mx.concatenate(list(c)) if len(chunks) > 1 else c[0] for c in zip(*chunks)]
    if kquant == "requantize":
        return _Tensor(*arrays, bits=bits, ggml_type=kind.name)
    return _Tensor(arrays[0], ggml_type=kind.name)


def _kquant_affine(raw: np.ndarray, values: mx.array, *, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Q4_K / Q5_K rows as MLX affine quantization on their own grid: each 32-weight sub-block is
    `d*sc*q - dmin*m` (q < 16 / 32), so scale `d*sc` and bias `-dmin*m` reproduce it (up to the float16
    rounding of scale and bias), where re-quantizing the values would move them to another grid."""
    from gguf.quants import Q4_K

    rows, cols = values.shape
    blocks = raw.reshape(rows, cols // 256, -1)  # both start with d, dmin (float16) and 12 scale bytes
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).astype(np.float32)  # (rows, n, 1)
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    scale = (d * sc.reshape(rows, -1, 8).astype(np.float32)).reshape(rows, -1)  # (rows, cols / 32)
    bias = -(dmin * m.reshape(rows, -1, 8).astype(np.float32)).reshape(rows, -1)
    grouped = np.array(values).reshape(rows, -1, GROUP_SIZE)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((grouped - bias[..., None]) / scale[..., None])
    q = np.where(scale[..., None] == 0, 0, q).clip(0, (1 << bits) - 1).astype(np.uint8)
    packed = _pack(q.reshape(rows, -1), bits)
    return mx.array(packed), mx.array(scale.astype(np.float16)), mx.array(bias.astype(np.float16))


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned 4/8-bit values (rows, cols) in MLX's packing: uint32 words, first value in the low bits."""
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return np.ascontiguousarray(q).view(np.uint32)


def _affine_blocks(blocks: np.ndarray, kind: str) -> _Tensor:
    """ggml blocks of 32 (rows, n_blocks, bytes) as MLX affine quantization with identical values."""
    rows, n_blocks, _ = blocks.shape
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]  # (rows, n_blocks)
    if kind == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)  # (rows, n_blocks, 32)
        packed = _pack((q.astype(np.int16) + 128).astype(np.uint8).reshape(rows, -1), 8)
        bias = -128.0 * d.astype(np.float32)
        bits = 8
    else:
        if kind == "Q4_0":
            qs, bias, bits = blocks[..., 2:], -8.0 * d.astype(np.float32), 4
        else:  # Q4_1: d, then the block's minimum m
            m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
            qs, bias, bits = blocks[..., 4:], m.astype(np.float32), 4
        # ggml: byte j holds weight j (low nibble) and weight j + 16 (high nibble)
        weights = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (rows, n_blocks, 32) in weight order
        packed = _pack(weights.reshape(rows, -1), 4)
    scales = d.astype(np.float32)
    dtype = np.float16 if np.all(np.abs(bias) <= np.finfo(np.float16).max) else np.float32  # -128*d may overflow
    return _Tensor(
        mx.array(packed), mx.array(scales.astype(dtype)), mx.array(bias.astype(dtype)), bits=bits, ggml_type=kind
    )


def _quantization_block(weights: dict[str, mx.array]) -> dict[str, Any]:
    """The config's `quantization` block as mlx-lm writes it: the commonest setting at the top, the
    modules quantized otherwise as per-module entries."""
    settings = {}
    for name in weights:
        if name.endswith(".scales"):
            module = name.removesuffix(".scales")
            bits = weights[f"{module}.weight"].shape[-1] * 32 // (weights[name].shape[-1] * GROUP_SIZE)
            settings[module] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    if not settings:
        return {}
    common = Counter(s["bits"] for s in settings.values()).most_common(1)[0][0]
    block: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common, "mode": "affine"}
    block.update({m: s for m, s in sorted(settings.items()) if s["bits"] != common})
    return block
