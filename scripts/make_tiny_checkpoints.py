"""Write a random tiny target and its DSpark draft: `python scripts/make_tiny_checkpoints.py OUT_DIR`.

OUT_DIR/<family>/target and OUT_DIR/<family>/draft (plus draft-gated / draft-rnn with --all-heads).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

# run from a checkout without installing the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_dspark.testing.tiny import FAMILIES, write_tiny_draft, write_tiny_target

app = typer.Typer(add_completion=False)


@app.command()
def main(
    out_dir: Path = typer.Argument(..., help="directory to write into"),
    family: list[str] = typer.Option(list(FAMILIES), "--family", help="spark2_5 and/or qwen3"),
    seed: int = typer.Option(0, "--seed"),
    all_heads: bool = typer.Option(False, "--all-heads", help="also write gated and rnn Markov-head drafts"),
) -> None:
    for fam in family:
        if fam not in FAMILIES:
            typer.echo(f"error: --family {fam!r} is not one of {', '.join(FAMILIES)}", err=True)
            raise typer.Exit(2)
        target = write_tiny_target(out_dir / fam / "target", family=fam, seed=seed)
        heads = ["vanilla", "gated", "rnn"] if all_heads else ["vanilla"]
        for head in heads:
            name = "draft" if head == "vanilla" else f"draft-{head}"
            write_tiny_draft(out_dir / fam / name, target_path=target, markov_head_type=head, seed=seed)
        typer.echo(f"wrote {out_dir / fam}")


if __name__ == "__main__":
    app()
