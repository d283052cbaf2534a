"""GGUF files (llama.cpp) read into our checkpoint form: a config in the Hugging Face / DeepSpec
config.json layout and tensors under the names of the equivalent safetensors checkpoint.

Targets (`general.architecture` `spark2_5` or `qwen3`) get Hugging Face names; DSpark drafts
(`dflash` in current upstream, `dspark` in PR-era files; keys are read under whichever prefix the file
names) get DeepSpec names, and their layer family comes from their own tensors: `blk.N.attn_q` is a
Qwen3-style layer, `blk.N.attn_qkv` (+ `attn_gate`) a Spark2_5-style one. The layouts are upstream's
(see GGUF.md): the converter maps names only, so no tensor is permuted. A plain language model given as the
draft (`llama`, `qwen2`, `qwen3`: a draft model, llama.cpp's `-md`) gets Hugging Face names too, llama's q / k
rows put back from the order upstream's converter permuted them into (gguf_lm.py).

Tensors are read one at a time from the reader's memory map (one copy into MLX memory each; K-quants
are dequantized in row chunks), so the file is never held twice. Every problem is one `ValueError`
naming the file and what does not fit.
"""


from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from mlx_dspark.loading.gguf_layout import DRAFT_SHARED, DRAFT_VALUES, TARGET_ARCHITECTURES, check_names, draft_layout, target_layout
from mlx_dspark.loading.gguf_lm import FIX, LM_ARCHITECTURES, lm_layout, unpermute_llama
from mlx_dspark.loading.gguf_metadata import Metadata
from mlx_dspark.loading.gguf_tensors import KQUANT_MODES, quantization_block, read_weights

DRAFT_ARCHITECTURES = ("dflash", "dspark")
ROLES = ("draft", "target")



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
    tokenizer: Any = None  # mlx_dspark.loading.gguf_tokenizer.GGUFTokenizer

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
    """Read a GGUF target, DSpark draft or, as the draft, a plain language model (see the module docstring).

    role: "draft" / "target" to refuse the other kind with a clear message (None: either); "draft" reads a
      `llama` / `qwen2` / `qwen3` language model as a draft model (its role is "draft", its config an LM's).
    tap_ids: the draft's tapped target layers as Hugging Face layer ids, overriding the file's
      `target_layers`. Current upstream converters write HF id + 1 (the runtime taps the input of that
      layer), which is how the file is read by default; a file from an older converter that wrote the
      HF ids unchanged needs the override, e.g. `tap_ids=[2, 10, 18, 25, 33]` for the published Spark
      draft (its card lists those HF ids for its 36-layer target).
    kquant: what becomes of K-quant (and other non-affine) tensors: "requantize" (default, MLX 4/8-bit),
      "bfloat16" or "float32".
    """
    from mlx_dspark.loading.gguf_tokenizer import GGUFTokenizer

    path = Path(path)
    if role is not None and role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")
    if kquant not in KQUANT_MODES:
        raise ValueError(f"kquant {kquant!r} is not one of {KQUANT_MODES}")
    meta = Metadata.open(path)
    arch = meta.architecture
    draft_model = role == "draft" and arch in LM_ARCHITECTURES  # a language model drafting: llama.cpp's -md
    if arch in DRAFT_ARCHITECTURES or draft_model:
        kind = "draft"
    elif arch in TARGET_ARCHITECTURES:
        kind = "target"
    elif role == "draft":
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is neither a DSpark draft ({', '.join(DRAFT_ARCHITECTURES)}) nor a language "
            f"model we read from GGUF as a draft model ({', '.join(LM_ARCHITECTURES)}); for a language model, {FIX}"
        )
    else:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; expected a DSpark draft "
            f"({', '.join(DRAFT_ARCHITECTURES)}) or a target ({', '.join(TARGET_ARCHITECTURES)})"
        )
    if role is not None and role != kind:
        raise ValueError(f"{path}: this GGUF is a {kind} (architecture {arch!r}), but it was given as the {role}")
    if (kind == "target" or draft_model) and tap_ids is not None:
        this = "language model (a draft model)" if draft_model else "target"
        raise ValueError(f"{path}: tap_ids apply to a DSpark draft, but this GGUF is a {arch} {this}")
    if draft_model:
        config, names = lm_layout(meta, arch)
    elif kind == "target":
        config, names = target_layout(meta, arch)
    else:
        config, names = draft_layout(meta, arch, tap_ids=tap_ids)
    check_names(meta, names)
    values = {n: names.pop(n) for n in DRAFT_VALUES if n in names}  # not weights (gguf_layout.DRAFT_VALUES)
    block_draft = arch in DRAFT_ARCHITECTURES
    shared = DRAFT_SHARED if block_draft and "d2t" not in meta.tensors else ("token_embd",) if block_draft else ()
    weights, types = read_weights(meta, names, kquant=kquant, dequantize_only=shared)
    if draft_model and arch == "llama":
        weights = unpermute_llama(weights, config)
    if config.get("enable_confidence_head") and "confidence_head.proj.bias" not in weights:
        weights["confidence_head.proj.bias"] = mx.zeros((1,), dtype=mx.float32)  # conf_proj without a bias
    if "d2t" in values:
        # GGUF holds absolute target ids; checkpoints (and our draft's loader) offsets: id = d2t[i] + i
        ids = np.asarray(meta.tensors["d2t"].data).reshape(-1).astype(np.int64)
        weights["d2t"] = mx.array((ids - np.arange(ids.size)).astype(np.int32))
    quantization = quantization_block(weights)
    if quantization:
        config["quantization"] = quantization
    tokenizer = GGUFTokenizer.from_metadata(meta)
    return GGUFCheckpoint(
        path=path, architecture=arch, role=kind, config=config, weights=weights, tensor_types=types, tokenizer=tokenizer
    )
