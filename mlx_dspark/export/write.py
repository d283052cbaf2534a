"""Exporting a draft for other engines: `export_draft(DRAFT, OUT, to="gguf" | "deepspec")`.

`gguf`: upstream llama.cpp's DSpark draft GGUF (`gguf.py`); `deepspec`: DeepSpec's Hugging
Face layout, read by DeepSpec, vLLM and SGLang (`deepspec.py`). The source is any draft we load
(`source.py`); existing outputs are only replaced with `force=True`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from mlx_dspark.loading.checkpoint import is_gguf, read_checkpoint, resolve_path
from mlx_dspark.export.deepspec import write_deepspec
from mlx_dspark.export.gguf import check_exportable, hf_tokenizer, write_draft_gguf
from mlx_dspark.export.source import read_draft_for_export
from mlx_dspark.loading.precision import parse_dtype

FORMATS = ("gguf", "deepspec")


def _check_output(out: Path, *, to: str, force: bool) -> None:
    if to == "gguf":
        if out.is_dir():
            raise ValueError(f"output {out} is a directory; --to gguf writes one file (e.g. {out / 'draft.gguf'})")
        if out.suffix.lower() != ".gguf":
            raise ValueError(f"output {out} must end in .gguf")
        if out.exists() and not force:
            raise ValueError(f"output {out} exists; pass --force to overwrite it")
        out.parent.mkdir(parents=True, exist_ok=True)
        return
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} is a file; --to deepspec writes a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(f"output directory {out} is not empty; pass --force to replace its checkpoint files")
        # only the files a checkpoint consists of: --force on a wrong directory must not wipe it
        for path in [out / "config.json", out / "model.safetensors.index.json", *out.glob("*.safetensors")]:
            if path.is_file():
                path.unlink()


def _tokenizer(draft_tokenizer, target: Optional[str | Path]):
    """The tokenizer for the GGUF's keys: the target's (its tokenizer.json, or its GGUF's keys), else
    a GGUF source draft's own."""
    if target is not None:
        path = resolve_path(target, role="target")
        if is_gguf(path):
            tokenizer = read_checkpoint(path, role="target").tokenizer
            if tokenizer is None:
                raise ValueError(f"{path}: this target GGUF has no tokenizer.ggml.* keys to copy into the draft")
            return tokenizer
        return hf_tokenizer(path)
    return draft_tokenizer


def export_draft(
    draft: str | Path,
    out: str | Path,
    *,
    to: str,
    target: Optional[str | Path] = None,
    bf16: bool = False,
    dtype: Optional[str] = None,
    force: bool = False,
    tap_ids: Optional[Sequence[int]] = None,
) -> list[str]:
    """Export `draft` to `out`; returns notes for the user (dequantized layers, what was left out).

    target: the draft's target, checked as a pair; it gives the GGUF its tokenizer and the DeepSpec
    layout the copies of the embedding and LM head when the draft has none. bf16: GGUF matrices in
    BF16; dtype: cast the DeepSpec weights ("bfloat16", "float16", "float32")."""
    if to not in FORMATS:
        raise ValueError(f"export format {to!r} is not one of {FORMATS}")
    if bf16 and to != "gguf":
        raise ValueError("--bf16 applies to --to gguf; use --dtype bfloat16 for --to deepspec")
    if dtype is not None and to != "deepspec":
        raise ValueError("--dtype applies to --to deepspec; use --bf16 for --to gguf")
    out = Path(out).expanduser()
    _check_output(out, to=to, force=force)
    source = read_draft_for_export(draft, target=target, tap_ids=tap_ids)
    if to == "gguf":
        check_exportable(source)  # before the tokenizer is looked for: the draft's own problem first
        notes = write_draft_gguf(source, out, tokenizer=_tokenizer(source.gguf_tokenizer, target), bf16=bf16)
    else:
        notes = write_deepspec(source, out, dtype=parse_dtype(dtype))
    return source.notes + notes
