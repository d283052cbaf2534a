"""Exporting a draft for other engines: `export_draft(DRAFT, OUT, to="gguf" | "deepspec" | "zlab" | "speculators")`.

Each kind of draft has the formats that can hold it (`FORMATS_BY_KIND`); another is refused in one line
naming the ones that can:
- DSpark / DFlash: `gguf`, upstream llama.cpp's `dflash` draft GGUF (`gguf.py`); `deepspec`, DeepSpec's
  Hugging Face layout, read by DeepSpec, vLLM and SGLang (`deepspec.py`);
- DFlash 2: `gguf`, the same file with the DFlash 2 keys and tensors (`gguf_dflash2.py`); `zlab`, z-lab's
  Hugging Face layout (`zlab.py`);
- EAGLE-3: `speculators`, vLLM speculators' layout (`speculators.py`).
The target's own MTP layers have no format: they stay in the target's checkpoint (refused by `source.py`).
The source is any draft we load (`source.py`); existing outputs are only replaced with `force=True`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from mlx_dspark.loading.checkpoint import is_gguf, read_checkpoint, resolve_path
from mlx_dspark.export import deepspec, speculators, zlab
from mlx_dspark.export.gguf import check_exportable, hf_tokenizer, write_draft_gguf
from mlx_dspark.export.source import ExportDraft, read_draft_for_export
from mlx_dspark.loading.precision import parse_dtype

FORMATS = ("gguf", "deepspec", "zlab", "speculators")
FORMATS_BY_KIND = {"dspark": ("gguf", "deepspec"), "dflash2": ("gguf", "zlab"), "eagle3": ("speculators",)}
_KIND_NAMES = {"dspark": "a DSpark / DFlash", "dflash2": "a DFlash 2", "eagle3": "an EAGLE-3"}
# the Hugging Face layouts: (what refuses a draft before anything is written, the writer); every EAGLE-3
# draft we load fits speculators' layout (it is the one we read)
_DIRECTORY_WRITERS = {
    "deepspec": (deepspec.check_exportable, deepspec.write_deepspec),
    "zlab": (zlab.check_exportable, zlab.write_zlab),
    "speculators": (None, speculators.write_speculators),
}


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
        raise ValueError(f"output {out} is a file; --to {to} writes a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"output directory {out} is not empty; pass --force to replace its checkpoint files")


def _clear_directory(out: Path) -> None:
    """--force: the checkpoint files of an earlier export, removed once the new one is known to be written
    (only those: --force on a wrong directory must not wipe it)."""
    if out.is_dir():
        for path in [out / "config.json", out / "model.safetensors.index.json", *out.glob("*.safetensors")]:
            if path.is_file():
                path.unlink()


def check_format(draft: ExportDraft, *, to: str) -> None:
    """ValueError naming the formats that hold this kind of draft, when `to` is not one of them."""
    allowed = FORMATS_BY_KIND[draft.kind]
    if to not in allowed:
        raise ValueError(
            f"{draft.path}: {_KIND_NAMES[draft.kind]} draft does not fit --to {to}; export it "
            + " or ".join(f"--to {f}" for f in allowed)
        )


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
    layout the copies of the embedding and LM head when the draft has none (an EAGLE-3 export the
    embedding copy). bf16: GGUF matrices in BF16; dtype: cast the weights of a Hugging Face layout
    ("bfloat16", "float16", "float32")."""
    if to not in FORMATS:
        raise ValueError(f"export format {to!r} is not one of {FORMATS}")
    if bf16 and to != "gguf":
        raise ValueError(f"--bf16 applies to --to gguf; use --dtype bfloat16 for --to {to}")
    if dtype is not None and to == "gguf":
        raise ValueError("--dtype applies to the Hugging Face layouts; use --bf16 for --to gguf")
    out = Path(out).expanduser()
    _check_output(out, to=to, force=force)
    source = read_draft_for_export(draft, target=target, tap_ids=tap_ids)
    check_format(source, to=to)
    if to == "gguf":
        check_exportable(source)  # before the tokenizer is looked for: the draft's own problem first
        notes = write_draft_gguf(source, out, tokenizer=_tokenizer(source.gguf_tokenizer, target), bf16=bf16)
    else:
        check, write = _DIRECTORY_WRITERS[to]
        if check is not None:
            check(source)
        _clear_directory(out)
        notes = write(source, out, dtype=parse_dtype(dtype))
    return source.notes + notes
