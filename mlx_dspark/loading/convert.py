"""Hugging Face -> MLX conversion (`python -m mlx_dspark.convert`, flags in `cli/convert.py`).

SRC may also be a GGUF file (a target or a DSpark draft; `gguf_convert.py` writes it through the
loader's own reading, so the converted directory loads as the GGUF does).

Converts a target of either family or a DSpark draft (either layer family, any packaging the loader
reads; written back under DeepSpec's tensor names) shard by shard: each
source file is read lazily, renamed by the model's `sanitize`, checked against the model built from
config.json, cast / quantized (the layers mlx-lm quantizes) and written into MLX shards (`ShardWriter`), so at most one source shard
and one output shard are in memory. A draft loses its frozen copies of the target's embedding and LM
head (shared at load time) unless --keep-shared.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_dspark.loading.checkpoint import (
    ShardWriter,
    is_gguf,
    load_file,
    read_config,
    read_header,
    resolve_path,
    weight_files,
)
from mlx_dspark.models import target_model_class
from mlx_dspark.models.target.mlx_lm import from_config as mlx_lm_target_from_config
from mlx_dspark.models.heads.dspark import draft_class
from mlx_dspark.models.heads.dspark.model import SHARED_PREFIXES, DSparkDraft
from mlx_dspark.models.heads.dspark.args import DraftArgs, canonical_name, canonical_names, is_draft_config, layer_family, with_tensor_fields
from mlx_dspark.loading.precision import DRAFT_SOURCE_PRECISION, check_quantize_options, parse_dtype, quant_predicate
from mlx_dspark.loading.weights import check_tensors
from mlx_dspark.loading.gguf_convert import convert_gguf
from mlx_dspark.loading.mlx_output import AUX_FILES, check_destination, clear_outputs, write_config
from mlx_dspark.loading.heads import FALLBACK as BLOCK_DRAFT, detect_head, generic, head_loader, target_weights
from mlx_dspark.loading.heads.mtp import is_mtp_tensor, mtp_skeleton



def _log(message: str) -> None:
    print(f"[convert] {message}", file=sys.stderr, flush=True)


def _skeleton(config: dict, files: list[Path], *, src: Path) -> tuple[nn.Module, str]:
    """The model built from config.json (lazy random parameters: only names and shapes are used);
    a draft's layer family comes from its tensor names (file headers only)."""
    source = str(src / "config.json")
    head = detect_head(config)  # a draft file of a head other than the block draft loads as it is
    if head != BLOCK_DRAFT and not generic(head) and head_loader(head).detect(config):  # a causal LM converts as a target
        raise ValueError(f"{source}: {head_loader(head).DESCRIPTION} is not converted; load it as it is (--draft {src})")
    if is_draft_config(config):
        shapes = {canonical_name(name): shape for path in files for name, (_, shape) in read_header(path).items()}
        family = layer_family(list(shapes), source=str(src))
        config = with_tensor_fields(config, shapes, source=source)
        args = DraftArgs.from_dict(config, family=family, source=source)
        return draft_class(args)(args), "draft"
    return mlx_lm_target_from_config(config, source=source, model_class=target_model_class(config)), "target"


def convert(
    hf_path: str | Path,
    mlx_path: str | Path,
    *,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    dtype: Optional[str] = None,
    force: bool = False,
    keep_shared: bool = False,
    draft_tap_ids: Optional[Sequence[int]] = None,
    draft_q_bits: Optional[int] = None,
    max_shard_bytes: Optional[int] = None,
    log: Callable[[str], None] = _log,
) -> Path:
    """Convert the checkpoint at `hf_path` into an MLX directory at `mlx_path`; returns its path.

    draft_tap_ids (GGUF drafts only): the tapped target layers as Hugging Face ids, replacing the file's
    `target_layers` (see `load(draft_tap_ids=)`); written into the converted config.
    draft_q_bits (drafts only, instead of `quantize`): quantize as `load(draft_quantize=)` does, the
    draft's `DRAFT_SOURCE_PRECISION` parts kept in float."""
    keep: tuple[str, ...] = ()
    if draft_q_bits is not None:
        if quantize:
            raise ValueError("give either quantize (-q) or draft_q_bits (--draft-q-bits), not both")
        check_quantize_options(bits=draft_q_bits, group_size=q_group_size)
        quantize, q_bits, keep = True, draft_q_bits, DRAFT_SOURCE_PRECISION[draft_q_bits]
    if quantize:
        check_quantize_options(bits=q_bits, group_size=q_group_size)
    mx_dtype = parse_dtype(dtype)
    src = resolve_path(hf_path, role="source")
    dst = Path(mlx_path).expanduser()
    check_destination(src, dst, force=force)
    if is_gguf(src) and keep:
        raise ValueError(f"{src}: draft_q_bits (--draft-q-bits) reads safetensors drafts; convert a GGUF with -q --q-bits")
    if is_gguf(src):
        return convert_gguf(
            src, dst, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size, dtype=mx_dtype,
            keep_shared=keep_shared, tap_ids=draft_tap_ids, max_shard_bytes=max_shard_bytes, log=log,
        )  # fmt: skip
    if draft_tap_ids is not None:
        raise ValueError(
            f"{src}: draft_tap_ids applies to GGUF drafts (whose target_layers convention varies); a safetensors "
            "draft's config.json states target_layer_ids (pass draft_tap_ids to load() to override them)"
        )
    config = read_config(src)
    source = str(src / "config.json")
    if quantize and "quantization" in config:
        raise ValueError(f"{source}: the checkpoint is already quantized ({config['quantization']}); convert it without -q")
    files = weight_files(src)
    model, kind = _skeleton(config, files, src=src)
    if keep and kind != "draft":
        raise ValueError(f"{source}: draft_q_bits (--draft-q-bits) applies to a DSpark draft; this is a target (use -q)")

    mtp = _mtp_skeleton(config, files, source=source) if kind == "target" else None

    def sanitize(weights: dict[str, mx.array], file: str) -> dict[str, mx.array]:
        if kind == "target":
            # the target's own MTP layers (mlx-lm's sanitize drops them) are kept, in MLX form (Qwen's norms
            # + 1, DeepSeek's / GLM's experts stacked and kv_b_proj split) under the names the loader reads
            own = {k: v for k, v in weights.items() if is_mtp_tensor(config, k)}
            own = {mtp.checkpoint_name(k): v for k, v in mtp.sanitize(own).items()} if mtp and own else {}
            return {**model.sanitize(target_weights(config, weights)), **own}
        weights, _ = canonical_names(weights, dict.fromkeys(weights, file), source=str(src))
        kept = {k: v for k, v in weights.items() if k.startswith(SHARED_PREFIXES)} if keep_shared else {}
        return {**model.sanitize(weights), **kept}

    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    predicate = quant_predicate(model, group_size=q_group_size, keep=keep)
    # module path -> its (group size, bits): the default, or the layer's own where the family gives one
    quant_modules = {}
    for path, m in model.named_modules() if quantize else ():
        choice = predicate(path, m)
        if choice:
            own = choice if isinstance(choice, dict) else {}
            quant_modules[path] = (own.get("group_size", q_group_size), own.get("bits", q_bits))
    if mtp is not None:
        expected.update({mtp.checkpoint_name(k): tuple(v.shape) for k, v in tree_flatten(mtp.parameters())})
        for path, m in mtp.named_modules() if quantize else ():
            if isinstance(m, nn.Linear) and m.weight.shape[-1] % q_group_size == 0:
                quant_modules[mtp.checkpoint_name(path + ".weight").removesuffix(".weight")] = (q_group_size, q_bits)
        log(f"keeping the target's {mtp.num_layers} MTP layer(s) for --draft mtp")
    _check_names(files, sanitize, expected, src=src, what=kind, keep_shared=kind == "draft" and keep_shared)

    dst.mkdir(parents=True, exist_ok=True)
    clear_outputs(dst)
    writer = ShardWriter(dst, **({"max_bytes": max_shard_bytes} if max_shard_bytes else {}))
    written = 0
    for i, path in enumerate(files):
        weights = sanitize(load_file(path), path.name)
        log(f"shard {i + 1}/{len(files)} {path.name}: {len(weights)} tensors")
        for name in sorted(weights):
            array = weights.pop(name)  # drop our reference as soon as it is queued
            if mx_dtype is not None and mx.issubdtype(array.dtype, mx.floating):
                array = array.astype(mx_dtype)
            module_path, _, leaf = name.rpartition(".")
            if leaf == "weight" and module_path in quant_modules:
                group, bits = quant_modules[module_path]
                qweight, scales, biases = mx.quantize(array, group_size=group, bits=bits)
                for suffix, value in (("weight", qweight), ("scales", scales), ("biases", biases)):
                    writer.add(f"{module_path}.{suffix}", value)
                    written += 1
            else:
                writer.add(name, array)
                written += 1
    shards = writer.finish()
    own = {p: {"group_size": g, "bits": b} for p, (g, b) in quant_modules.items() if (g, b) != (q_group_size, q_bits)}
    write_config(config, dst, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size, dtype=dtype, per_layer=own)
    copied = [name for name in AUX_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copyfile(src / name, dst / name)
    log(f"wrote {written} tensors in {len(shards)} file(s) and {len(copied) + 1} config/tokenizer file(s) to {dst}")
    return dst


def _mtp_skeleton(config: dict, files: list[Path], *, source: str) -> Optional[nn.Module]:
    """The target's MTP layers when its config declares them and its files hold them (headers only)."""
    headers = {name: shape for path in files for name, (_, shape) in read_header(path).items()}
    return mtp_skeleton(config, headers, source=source)


def _check_names(files: list[Path], sanitize, expected: dict[str, tuple], *, src: Path, what: str, keep_shared: bool) -> None:
    """Before writing anything: every expected tensor present, nothing unexpected, shapes right."""
    found: dict[str, tuple] = {}
    origin: dict[str, str] = {}
    for path in files:
        for name, array in sanitize(load_file(path), path.name).items():
            if keep_shared and name.startswith(SHARED_PREFIXES):
                continue  # kept as they are; the loader checks them against the target
            found[name] = tuple(array.shape)
            origin[name] = path.name
    check_tensors(expected, found, origin, source=str(src), what=what)
