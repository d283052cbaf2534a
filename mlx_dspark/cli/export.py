"""`python -m mlx_dspark.export --to gguf|deepspec|zlab|speculators DRAFT OUT [--target T]`: flags over `export.write`.

    # llama.cpp (`llama-server -md OUT.gguf --spec-type draft-dspark`): the dflash GGUF, with the
    # target's tokenizer in it (DSpark, DFlash and DFlash 2 drafts)
    python -m mlx_dspark.export --to gguf drafts/mine draft.gguf --target Qwen/Qwen3-4B [--bf16]
    # vLLM / SGLang / DeepSpec: DeepSpec's Hugging Face layout (with the target's embedding and head)
    python -m mlx_dspark.export --to deepspec drafts/mine drafts/mine-deepspec --target Qwen/Qwen3-4B
    # a DFlash 2 draft in z-lab's Hugging Face layout (DFlash2DraftModel)
    python -m mlx_dspark.export --to zlab drafts/dflash2.gguf drafts/dflash2-hf
    # an EAGLE-3 draft in vLLM speculators' layout (SpecForge's midlayer.* renamed, d2t / t2d)
    python -m mlx_dspark.export --to speculators drafts/eagle3 drafts/eagle3-speculators --target T

A head read from the target's own checkpoint is not a draft file: `python -m mlx_dspark.convert` keeps it
with the target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mlx_dspark.cli.common import parse_tap_ids
from mlx_dspark.loading.precision import DTYPES

HELP = (
    "Export a draft for another engine: DSpark / DFlash to llama.cpp (gguf) or DeepSpec / vLLM / SGLang (deepspec); "
    "DFlash 2 to llama.cpp (gguf) or z-lab's layout (zlab); EAGLE-3 to vLLM speculators' layout (speculators). "
    "A head read from the target's own checkpoint is not exported: convert keeps it with the target."
)
app = typer.Typer(add_completion=False, help=HELP)


@app.command(help=HELP)
def cli(
    draft: str = typer.Argument(
        ..., help="the draft: a directory (DeepSpec, z-lab, speculators, ours, MLX-quantized), a .gguf, or a repo id"
    ),
    out: Path = typer.Argument(..., help="--to gguf: the .gguf file to write; the other formats: the directory"),
    to: str = typer.Option(
        ..., "--to", help="gguf (llama.cpp; DSpark, DFlash, DFlash 2), deepspec (vLLM, SGLang, DeepSpec; DSpark, DFlash), "
        "zlab (DFlash 2), speculators (vLLM; EAGLE-3)",
    ),  # fmt: skip
    target: Optional[str] = typer.Option(
        None, "--target", help="the draft's target: checks the pair; gives the GGUF its tokenizer, DeepSpec the embedding / head, "
        "speculators the embedding copy",
    ),  # fmt: skip
    bf16: bool = typer.Option(False, "--bf16", help="--to gguf: store the matrices as BF16 (default: as the draft's)"),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="--to deepspec / zlab / speculators: cast the weights (bfloat16, float16, float32)"
    ),
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
