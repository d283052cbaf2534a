"""`python -m mlx_dspark.train.regenerate`: the target's own continuations of prompts / text prefixes,
for self-distilled draft training (`mlx_dspark.train.distill`).

    python -m mlx_dspark.train.regenerate --target T --data prompts.jsonl --out distilled/ --max-tokens 512
    python -m mlx_dspark.train --target T --data corpus/ --data distilled/ --out drafts/mine ...
    # several processes or Macs: each regenerates its share into its own part file
    mlx.launch -n 2 -- python -m mlx_dspark.train.regenerate ...
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from mlx_dspark.loading.precision import DTYPES, Q_BITS

regenerate_app = typer.Typer(add_completion=False, help="Regenerate training responses with the target (self-distillation).")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


@regenerate_app.command()
def regenerate(
    target: str = typer.Option(..., "--target", help="The target: local directory, .gguf or Hugging Face repo id."),
    data: list[str] = typer.Option(..., "--data", help="Prompts: .jsonl (prompt / messages / text) or text files, directories (repeatable)."),
    out: Path = typer.Option(..., "--out", help="Output directory: part-*.jsonl records for `train --data`; rerun to continue."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="New tokens per prompt at most."),
    greedy_fraction: float = typer.Option(0.5, "--greedy-fraction", help="Share of prompts decoded greedily; the rest sampled."),
    temperature: float = typer.Option(1.0, "--temperature", help="Temperature of the sampled prompts."),
    prefix_tokens: int = typer.Option(64, "--prefix-tokens", help="Text sources: tokens per prompt window."),
    stride: Optional[int] = typer.Option(None, "--stride", help="Text sources: tokens between windows (default prefix + max tokens)."),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts", help="Use the first N prompts only."),
    batch_size: int = typer.Option(8, "--batch-size", help="Prompts of one length decoded together."),
    seed: int = typer.Option(0, "--seed"),
    target_dtype: Optional[str] = typer.Option(None, "--target-dtype", help="Cast the target: bfloat16, float16, float32."),
    target_quantize: Optional[int] = typer.Option(None, "--target-quantize", help="Quantize the target: 4 or 8 bits."),
) -> None:
    """Write the target's continuations of every prompt not yet in --out."""
    from mlx_dspark.loading.load import load
    from mlx_dspark.train.distill import RegenerateOptions
    from mlx_dspark.train.distill import regenerate as run
    from mlx_dspark.train.distributed import init_world

    if target_dtype is not None and target_dtype not in DTYPES:
        _fail(f"--target-dtype must be one of {', '.join(sorted(DTYPES))}, got {target_dtype!r}")
    if target_quantize is not None and target_quantize not in Q_BITS:
        _fail(f"--target-quantize must be one of {Q_BITS}, got {target_quantize}")
    try:
        options = RegenerateOptions(
            max_tokens=max_tokens, greedy_fraction=greedy_fraction, temperature=temperature, prefix_tokens=prefix_tokens,
            stride=stride, max_prompts=max_prompts, batch_size=batch_size, seed=seed,
        )  # fmt: skip
        world = init_world()
        pair = load(target, dtype=target_dtype, quantize=target_quantize)
        run(
            target, data, out, options=options, target=pair.target, tokenizer=pair.tokenizer, world=world,
            log=lambda message: print(f"[regenerate] {message}", file=sys.stderr, flush=True),
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        _fail(str(err))
