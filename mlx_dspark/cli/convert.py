"""`python -m mlx_dspark.convert --hf-path SRC --mlx-path DST [-q]`: flags over `loading.convert.convert`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mlx_dspark.cli.common import parse_tap_ids
from mlx_dspark.loading.convert import convert
from mlx_dspark.loading.precision import DTYPES, Q_BITS, Q_GROUP_SIZES

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
    draft_q_bits: Optional[int] = typer.Option(
        None, "--draft-q-bits", help="a draft only, instead of -q: 4 or 8 bits, its confidence head (and at 4 bits its Markov head) kept in float"
    ),
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
    if draft_q_bits is not None and (quantize or draft_q_bits not in Q_BITS):
        fail(f"--draft-q-bits must be one of {', '.join(map(str, Q_BITS))} and replaces -q, got {draft_q_bits}" + (" with -q" if quantize else ""), 2)
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
            draft_q_bits=draft_q_bits,
        )
    except (ValueError, OSError) as e:  # exit status 2, as every command's bad input
        fail(str(e), 2)
    except Exception as e:  # noqa: BLE001  (the conversion's boundary: a bug or an unforeseen layout is one line too)
        fail(f"converting {hf_path} failed: {type(e).__name__}: {e} (please report this with its config.json)", 2)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
