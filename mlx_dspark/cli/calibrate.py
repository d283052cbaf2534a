"""`python -m mlx_dspark.calibrate [--model T --draft D] [--measure] [--careful] [--json]`: the loaded pair's
cost curve on this machine (read from its cache, else measured and cached, as a generation's first use
does), the break-even acceptance of each draft length, and the length `--max-draft-tokens auto` starts with."""

from __future__ import annotations

import json
from typing import Optional

import typer

from mlx_dspark.cli import common as flags
from mlx_dspark.cli.common import exit_on_interrupt, fail

app = typer.Typer(add_completion=False, help="This machine's draft and verify costs for a pair, and what auto draft lengths make of them.")


def report(pair, curve, path) -> dict:
    """What the command prints: the machine, the curve at each depth, break-even acceptances, auto's start."""
    from mlx_dspark.engine.cost_probe import machine
    from mlx_dspark.engine.draft_length import AutoLength, break_even

    block = int(pair.draft.num_drafts)
    depths = [curve] + ([curve.deep] if curve.deep is not None else [])
    rows = []
    for at in depths:
        cap = min(block, at.max_width - 1)
        rows.append({
            "context": at.context,
            "draft_block_ms": at.draft_ms,
            "verify_ms": {str(n + 1): ms for n, ms in enumerate(at.verify_ms)},
            "break_even_acceptance": {str(n): break_even(at, n) for n in range(1, cap + 1)},
            "auto_start_length": AutoLength(curve, block).start_length(at.context),
        })  # fmt: skip
    return {"machine": machine(), "target": str(pair.target_path), "draft": str(pair.draft_path), "cache_file": str(path),
            "source": curve.source, "depths": rows}  # fmt: skip


def format_report(data: dict) -> str:
    m = data["machine"]
    lines = [
        f"machine: {m['node']} ({m['system']} {m['machine']}), device {m['device']}, MLX {m['mlx']}, BLAS {m['blas']}",
        f"pair: {data['target']} + {data['draft']}",
        f"cost curve: {data['cache_file']} ({data['source']})",
    ]
    for row in data["depths"]:
        verify = " ".join(f"{ms:.2f}" for ms in row["verify_ms"].values())
        even = " ".join("-" if q is None else f"{q:.2f}" for q in row["break_even_acceptance"].values())
        lines += [
            f"context {row['context']}: draft block {row['draft_block_ms']:.2f} ms; verify of 1..{len(row['verify_ms'])} tokens: {verify} ms",
            f"  break-even acceptance per position for 1..{len(row['break_even_acceptance'])} drafts: {even} (-: never pays)",
            f"  --max-draft-tokens auto starts at {row['auto_start_length']} drafts per round"
            + (" (parked: plain decoding until acceptance shows drafting pays)" if row["auto_start_length"] == 0 else ""),
        ]
    return "\n".join(lines)


@app.command()
def cli(
    model: Optional[str] = typer.Option(None, "--model", help=flags.MODEL_HELP + " Default: the demo pair."),
    draft: Optional[str] = typer.Option(None, "--draft", help=flags.DRAFT_HELP),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Load both in this dtype (float32, bfloat16, float16): the costs depend on it."),
    quantize: flags.Quantize = None,
    measure: bool = typer.Option(False, "--measure", help="Measure again even when a cached curve exists (and replace it)."),
    careful: bool = typer.Option(False, "--careful", help="With --measure: 10 interleaved repeats at contexts 512 and 4096 instead of the quick 3 at 256 and 1024."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    from mlx_dspark.engine.cost_probe import cost_curve_for, cost_curve_path, measure_cost_curve
    from mlx_dspark.loading.load import load

    if model is None:
        demo = flags.demo_pair()
        model, draft, dtype = str(demo.target), draft or str(demo.draft), dtype or demo.dtype
    if draft is None:
        fail("--draft: the cost curve is measured for a target and its DSpark draft; give both")
    with exit_on_interrupt(), flags.flag_errors():
        flags.check_quantize(quantize)
        pair = load(model, draft=draft, dtype=dtype, quantize=quantize)
        path = cost_curve_path(pair)
        if measure and path.is_file():
            path.unlink()
        options = dict(context=512, deep_context=4096, repeats=10) if careful else {}
        curve = cost_curve_for(pair, measure=lambda target, d: measure_cost_curve(target, d, **options))
        data = report(pair, curve, path)
    typer.echo(json.dumps(data, indent=2) if as_json else format_report(data))


def main() -> None:
    app()
