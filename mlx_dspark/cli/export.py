"""`python -m mlx_dspark.export --to gguf|deepspec DRAFT OUT [--target T]`: flags over `export.write`.

    # llama.cpp (`llama-server -md OUT.gguf --spec-type draft-dspark`): the dflash GGUF, with the
    # target's tokenizer in it
    python -m mlx_dspark.export --to gguf drafts/mine draft.gguf --target Qwen/Qwen3-4B [--bf16]
    # vLLM / SGLang / DeepSpec: DeepSpec's Hugging Face layout (with the target's embedding and head)
    python -m mlx_dspark.export --to deepspec drafts/mine drafts/mine-deepspec --target Qwen/Qwen3-4B
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mlx_dspark.cli.common import parse_tap_ids
from mlx_dspark.loading.precision import DTYPES

app = typer.Typer(add_completion=False, help="Export a DSpark draft for llama.cpp (GGUF) or vLLM / SGLang / DeepSpec.")


@app.command()
def cli(
    draft: str = typer.Argument(..., help="the draft: a directory (DeepSpec, ours, MLX-quantized), a .gguf, or a repo id"),
    out: Path = typer.Argument(..., help="--to gguf: the .gguf file to write; --to deepspec: the directory"),
    to: str = typer.Option(..., "--to", help="gguf (llama.cpp) or deepspec (vLLM, SGLang, DeepSpec)"),
    target: Optional[str] = typer.Option(
        None, "--target", help="the draft's target: checks the pair; gives the GGUF its tokenizer and DeepSpec the embedding / head"
    ),
    bf16: bool = typer.Option(False, "--bf16", help="--to gguf: store the matrices as BF16 (default: as the draft's)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="--to deepspec: cast the weights (bfloat16, float16, float32)"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing output"),
    draft_tap_ids: Optional[str] = typer.Option(
        None, "--draft-tap-ids", help="GGUF drafts from older converters: the tapped layers as Hugging Face ids"
    ),
) -> None:
    from mlx_dspark.export.write import FORMATS, export_draft

    def fail(message: str) -> None:
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(2)

    if to not in FORMATS:
        fail(f"--to must be one of {', '.join(FORMATS)}, got {to!r}")
    if dtype is not None and dtype not in DTYPES:
        fail(f"--dtype must be one of {', '.join(sorted(DTYPES))}, got {dtype!r}")
    try:
        notes = export_draft(
            draft, out, to=to, target=target, bf16=bf16, dtype=dtype, force=force,
            tap_ids=parse_tap_ids(draft_tap_ids, draft=draft, model=None),
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    for note in notes:
        typer.echo(f"note: {note}", err=True)
    typer.echo(f"wrote {out}", err=True)


def main() -> None:
    app()
