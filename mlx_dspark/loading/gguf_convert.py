"""GGUF -> MLX: `python -m mlx_dspark.convert --hf-path FILE.gguf --mlx-path OUT [-q]` (see convert.py).

The file is read by `read_checkpoint` (exactly as `load()` reads it), the model is built from it with
the same dtype rule (`checkpoint.gguf_compute_dtype` unless --dtype), optionally quantized as at load
time, and its parameters are written as they are: so `load(OUT)` builds the same model as
`load(FILE.gguf)`. A target also gets its tokenizer files (those beside the GGUF, else the ones its
metadata describes) and a generation_config.json holding the GGUF's eos ids; a draft's config keeps
DeepSpec's layout (`target_layer_ids` as Hugging Face ids, after the +1 convention or `tap_ids`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_dspark.loading.mlx_output import AUX_FILES, clear_outputs, write_config
from mlx_dspark.loading.checkpoint import Checkpoint, ShardWriter, read_checkpoint, read_json
from mlx_dspark.loading.load import build_draft, build_target
from mlx_dspark.models.heads.dspark.args import is_draft_config
from mlx_dspark.loading.pair import FLOAT_STORAGE
from mlx_dspark.loading.precision import DTYPES, quant_predicate
from mlx_dspark.loading.tokenizer import tokenizer_directory


def convert_gguf(
    src: Path,
    dst: Path,
    *,
    quantize: bool,
    q_bits: int,
    q_group_size: int,
    dtype: Optional[mx.Dtype],
    keep_shared: bool,
    tap_ids: Optional[Sequence[int]],
    max_shard_bytes: Optional[int],
    log: Callable[[str], None],
) -> Path:
    """Write the GGUF at `src` into the (checked, empty) directory `dst` in our MLX layout."""
    checkpoint = read_checkpoint(src, tap_ids=tap_ids)
    config = checkpoint.config
    if quantize and "quantization" in config:
        raise ValueError(f"{src}: the GGUF is already quantized ({config['quantization']}); convert it without -q")
    draft = is_draft_config(config)
    tokenizer_dir = None if draft else tokenizer_directory(src, gguf_tokenizer=checkpoint.tokenizer)  # fails before writing
    model, extra = _build(checkpoint, dtype=dtype, keep_shared=keep_shared)
    if draft and not keep_shared and "embed_tokens.weight" in checkpoint.weights:
        # without the target we cannot tell whether the copy has rows of its own (a trained mask row)
        log("the draft's token_embd is not written (the loader shares the target's); if some of its rows are the "
            "draft's own (e.g. its mask row), convert with --keep-shared so the loader can find them")  # fmt: skip
    if quantize:
        nn.quantize(model, q_group_size, q_bits, class_predicate=quant_predicate(model, group_size=q_group_size))

    dst.mkdir(parents=True, exist_ok=True)
    clear_outputs(dst)
    writer = ShardWriter(dst, **({"max_bytes": max_shard_bytes} if max_shard_bytes else {}))
    tensors = dict(tree_flatten(model.parameters()))
    tensors.update(extra)
    for name in sorted(tensors):
        writer.add(name, tensors.pop(name))
    shards = writer.finish()
    compute = _dtype_name(model)
    write_config(config, dst, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size, dtype=compute)
    copied = []
    if tokenizer_dir is not None:
        copied = [name for name in AUX_FILES if (tokenizer_dir / name).is_file()]
        for name in copied:
            shutil.copyfile(tokenizer_dir / name, dst / name)
        _write_eos_ids(dst, checkpoint)
    what = "draft" if draft else "target"
    log(f"wrote the {what} of {src.name} ({compute or 'mixed dtypes'}) as {len(shards)} file(s) and {len(copied) + 1} config/tokenizer file(s) to {dst}")
    return dst


def _build(checkpoint: Checkpoint, *, dtype: Optional[mx.Dtype], keep_shared: bool) -> tuple[nn.Module, dict[str, mx.array]]:
    """The model as load() builds it, and the draft's copies of the target's tensors when kept."""
    if not is_draft_config(checkpoint.config):
        return build_target(checkpoint, dtype=dtype), {}
    model, shared = build_draft(checkpoint, dtype=dtype)
    if not keep_shared:
        return model, {}
    quantized = sorted(f"{k} ({checkpoint.storage[k]})" for k in shared if checkpoint.storage.get(k, "F32") not in FLOAT_STORAGE)
    if quantized:
        raise ValueError(
            f"{checkpoint.path}: --keep-shared keeps the draft's copies of the target's tensors as stored, but {quantized} "
            "are quantized GGUF types (read dequantized); convert without --keep-shared (the loader shares the target's)"
        )
    cast = checkpoint.default_dtype if dtype is None else dtype
    return model, {k: v.astype(cast) if cast is not None else v for k, v in shared.items()}


def _dtype_name(model: nn.Module) -> Optional[str]:
    """The one floating dtype of the model's parameters (its compute dtype), None if they mix dtypes."""
    kinds = {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
    names = [name for name, dtype in DTYPES.items() if dtype in kinds]
    return names[0] if len(names) == 1 and len(kinds) == 1 else None


def _write_eos_ids(dst: Path, checkpoint: Checkpoint) -> None:
    """generation_config.json with the GGUF's eos ids (eos, end-of-turn, end-of-message) added, so the
    converted directory stops where the GGUF does."""
    path = dst / "generation_config.json"
    generation = read_json(path) if path.is_file() else {}
    value = generation.get("eos_token_id")
    ids = list(value) if isinstance(value, list) else [] if value is None else [value]
    gguf_ids = checkpoint.tokenizer.eos_token_ids if checkpoint.tokenizer is not None else []
    ids += [i for i in gguf_ids if i not in ids]
    if ids:
        generation["eos_token_id"] = ids
        path.write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
