"""Hugging Face -> MLX converter: `python -m mlx_dspark.convert --hf-path SRC --mlx-path DST [-q]`.

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
import typer
from mlx.utils import tree_flatten

from mlx_dspark.checkpoint import (
    INDEX_FILE,
    ShardWriter,
    is_gguf,
    load_file,
    read_config,
    read_header,
    resolve_path,
    weight_files,
)
from mlx_dspark.cli_common import parse_tap_ids
from mlx_dspark.models import target_module
from mlx_dspark.models.dspark import SHARED_PREFIXES, DSparkDraft
from mlx_dspark.models.dspark_args import DraftArgs, canonical_name, canonical_names, is_draft_config, layer_family
from mlx_dspark.precision import DTYPES, Q_BITS, Q_GROUP_SIZES, check_quantize_options, parse_dtype, quant_predicate
from mlx_dspark.weights import check_tensors

# Non-weight files carried over (tokenizer, generation defaults); never checkpoint code (*.py).
AUX_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def _log(message: str) -> None:
    print(f"[convert] {message}", file=sys.stderr, flush=True)


def _skeleton(config: dict, files: list[Path], *, src: Path) -> tuple[nn.Module, str]:
    """The model built from config.json (lazy random parameters: only names and shapes are used);
    a draft's layer family comes from its tensor names (file headers only)."""
    source = str(src / "config.json")
    if is_draft_config(config):
        names = [canonical_name(name) for path in files for name in read_header(path)]
        family = layer_family(names, source=str(src))
        return DSparkDraft(DraftArgs.from_dict(config, family=family, source=source)), "draft"
    module = target_module(config, source=source)
    return module.Model(module.ModelArgs.from_dict(config, source=source)), "target"


def _check_destination(src: Path, dst: Path, *, force: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"destination {dst} is a file; expected a directory")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"destination {dst} is the source directory; choose another --mlx-path")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise ValueError(f"destination {dst} is not empty; pass --force to overwrite it")


def _clear_outputs(dst: Path) -> None:
    # --force: remove what an earlier conversion wrote, so stale shards never mix with new ones
    for path in list(dst.glob("*.safetensors")) + list(dst.glob(".shard-*.tmp.safetensors")) + [dst / INDEX_FILE, dst / "config.json"]:
        if path.is_file():
            path.unlink()


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
    max_shard_bytes: Optional[int] = None,
    log: Callable[[str], None] = _log,
) -> Path:
    """Convert the checkpoint at `hf_path` into an MLX directory at `mlx_path`; returns its path.

    draft_tap_ids (GGUF drafts only): the tapped target layers as Hugging Face ids, replacing the file's
    `target_layers` (see `load(draft_tap_ids=)`); written into the converted config."""
    if quantize:
        check_quantize_options(bits=q_bits, group_size=q_group_size)
    mx_dtype = parse_dtype(dtype)
    src = resolve_path(hf_path, role="source")
    dst = Path(mlx_path).expanduser()
    _check_destination(src, dst, force=force)
    if is_gguf(src):
        from mlx_dspark.gguf_convert import convert_gguf

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

    def sanitize(weights: dict[str, mx.array], file: str) -> dict[str, mx.array]:
        if kind == "target":
            return model.sanitize(weights)
        weights, _ = canonical_names(weights, dict.fromkeys(weights, file), source=str(src))
        kept = {k: v for k, v in weights.items() if k.startswith(SHARED_PREFIXES)} if keep_shared else {}
        return {**model.sanitize(weights), **kept}

    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    predicate = quant_predicate(model, group_size=q_group_size)
    quant_modules = {path for path, m in model.named_modules() if predicate(path, m)} if quantize else set()
    _check_names(files, sanitize, expected, src=src, what=kind, keep_shared=kind == "draft" and keep_shared)

    dst.mkdir(parents=True, exist_ok=True)
    _clear_outputs(dst)
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
                qweight, scales, biases = mx.quantize(array, group_size=q_group_size, bits=q_bits)
                for suffix, value in (("weight", qweight), ("scales", scales), ("biases", biases)):
                    writer.add(f"{module_path}.{suffix}", value)
                    written += 1
            else:
                writer.add(name, array)
                written += 1
    shards = writer.finish()
    _write_config(config, dst, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size, dtype=dtype)
    copied = [name for name in AUX_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copyfile(src / name, dst / name)
    log(f"wrote {written} tensors in {len(shards)} file(s) and {len(copied) + 1} config/tokenizer file(s) to {dst}")
    return dst


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


def _write_config(config: dict, dst: Path, *, quantize: bool, q_bits: int, q_group_size: int, dtype: Optional[str]) -> None:
    import json

    config = dict(config)
    if dtype is not None:
        config["dtype"] = dtype
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype
    if quantize:
        # the block MLX / mlx-lm write; the loader quantizes exactly the layers that carry scales
        config["quantization"] = {"group_size": q_group_size, "bits": q_bits, "mode": "affine"}
        config["quantization_config"] = dict(config["quantization"])
    (dst / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# -- CLI -----------------------------------------------------------------------------------------

app = typer.Typer(add_completion=False, help="Convert a Hugging Face target or DSpark draft checkpoint to MLX.")


@app.command()
def cli(
    hf_path: str = typer.Option(
        ..., "--hf-path", help="source: a local directory, a Hugging Face repo id, FILE.gguf or owner/name:FILE.gguf"
    ),
    mlx_path: Path = typer.Option(..., "--mlx-path", help="destination directory (must be empty unless --force)"),
    quantize: bool = typer.Option(False, "-q", "--quantize", help="quantize linear and embedding layers"),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="bits per weight with -q: 4 or 8 (default 4)"),
    q_group_size: Optional[int] = typer.Option(None, "--q-group-size", help="group size with -q: 32, 64 or 128 (default 64)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="cast floating weights: bfloat16, float16 or float32"),
    force: bool = typer.Option(False, "--force", help="overwrite a non-empty destination"),
    keep_shared: bool = typer.Option(False, "--keep-shared", help="keep a draft's copies of the target's embedding / LM head"),
    draft_tap_ids: Optional[str] = typer.Option(
        None, "--draft-tap-ids", help="GGUF drafts: the tapped target layers as Hugging Face ids (e.g. 2,10,18,25,33)"
    ),
) -> None:
    def fail(message: str, code: int) -> None:
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(code)

    if (q_bits is not None or q_group_size is not None) and not quantize:
        fail("--q-bits / --q-group-size only apply with -q/--quantize", 2)
    if q_bits is not None and q_bits not in Q_BITS:
        fail(f"--q-bits must be one of {', '.join(map(str, Q_BITS))}, got {q_bits}", 2)
    if q_group_size is not None and q_group_size not in Q_GROUP_SIZES:
        fail(f"--q-group-size must be one of {', '.join(map(str, Q_GROUP_SIZES))}, got {q_group_size}", 2)
    if dtype is not None and dtype not in DTYPES:
        fail(f"--dtype must be one of {', '.join(sorted(DTYPES))}, got {dtype!r}", 2)
    try:
        tap_ids = parse_tap_ids(draft_tap_ids, draft=hf_path, model=None)
    except ValueError as e:
        fail(str(e), 2)
    try:
        convert(
            hf_path,
            mlx_path,
            quantize=quantize,
            q_bits=q_bits or 4,
            q_group_size=q_group_size or 64,
            dtype=dtype,
            force=force,
            keep_shared=keep_shared,
            draft_tap_ids=tap_ids,
        )
    except (ValueError, FileNotFoundError) as e:
        fail(str(e), 1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
