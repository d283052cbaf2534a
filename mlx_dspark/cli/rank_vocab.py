"""`python -m mlx_dspark.rank_vocab --model TARGET --data FILE... --out RANK.json`: flags over
`loading.rank_vocab.rank_vocabulary` (token frequencies of a corpus, for `--draft-vocab K`)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from mlx_dspark.cli.common import fail
from mlx_dspark.loading.rank_vocab import RANK_FILE, rank_vocabulary

app = typer.Typer(add_completion=False, help="Rank the target's vocabulary by token frequency for a reduced draft head.")


@app.command()
def cli(
    model: str = typer.Option(..., "--model", help="Target whose tokenizer counts the tokens (what load() takes)."),
    data: List[Path] = typer.Option(..., "--data", help="Text file(s) to count tokens in: --data A B C or --data A --data B."),
    more: Optional[List[Path]] = typer.Argument(None, help="More data files (what follows --data FILE)."),
    out: Path = typer.Option(..., "--out", help=f"The ranking to write; saved as {RANK_FILE} in the draft's directory it is found by itself."),
) -> None:
    try:
        data = [*data, *(more or [])]
        result = rank_vocabulary(model, data, out=out)
    except (ValueError, FileNotFoundError, OSError) as err:
        fail(str(err))
    seen = sum(1 for c in result["counts"] if c)
    total = result["tokens_counted"]
    cover = []
    for k in (1024, 4096, 16384, 32768):
        if k < result["vocab_size"]:
            cover.append(f"top {k}: {sum(result['counts'][:k]) / total:.1%}")
    typer.echo(
        f"[rank_vocab] {total} tokens in {len(data)} file(s); {seen} of {result['vocab_size']} ids seen"
        + (f"; coverage {', '.join(cover)}" if cover else "") + f"; wrote {out}",
        err=True,
    )


def main() -> None:
    app()
