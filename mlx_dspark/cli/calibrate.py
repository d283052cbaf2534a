"""`python -m mlx_dspark.calibrate [--model T --draft D] [--measure] [--careful] [--max-batch N] [--json]`: the
loaded pair's cost curve on this machine (read from its cache, else measured and cached, as a generation's
first use does), the break-even acceptance of each draft length, and the length `--max-draft-tokens auto`
starts with; with `--max-batch N`, the packed-forward costs a server with `--max-batch N` plans with, and
the drafts per request its plan gives at each batch width."""

from __future__ import annotations

import json
from typing import Optional

import typer

from mlx_dspark.cli import common as flags
from mlx_dspark.cli.common import exit_on_interrupt, fail
from mlx_dspark.cli.split import PIPELINE_HELP, launched_group, split_or_follow, target_splitter

app = typer.Typer(add_completion=False, help="This machine's draft and verify costs for a pair, and what auto draft lengths make of them.")


def report(pair, curve, path, *, head: str = "draft") -> dict:
    """What the command prints for one draft head: the machine, the curve at each depth, break-even
    acceptances, auto's start."""
    from mlx_dspark.engine.costs.probe import machine
    from mlx_dspark.engine.proposers import head_block
    from mlx_dspark.loading.heads import head_loader
    from mlx_dspark.engine.policy.draft_length import AutoLength, break_even

    block = head_block(pair, head)
    depths = [curve] + ([curve.deep] if curve.deep is not None else [])
    rows = []
    for at in depths:
        cap = min(block, at.max_width - 1)
        rows.append({
            "context": at.context,
            "draft_block_ms": at.draft_ms,
            **({"draft_step_ms": at.draft_step_ms} if at.draft_step_ms else {}),
            "verify_ms": {str(n + 1): ms for n, ms in enumerate(at.verify_ms)},
            "break_even_acceptance": {str(n): break_even(at, n) for n in range(1, cap + 1)},
            "auto_start_length": AutoLength(curve, block).start_length(at.context),
        })  # fmt: skip
    draft = str(pair.head_files[head][0]) if head in pair.head_files else head_loader(head).DESCRIPTION
    return {"machine": machine(), "target": str(pair.target_path), "draft": draft, "head": head, "cache_file": str(path),
            "source": curve.source, **_trust(path), "depths": rows}  # fmt: skip


def _trust(path) -> dict:
    """How old the cached curve is and how far generations' own round times have confirmed it (cost_heal.py)."""
    import time

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        age_s = time.time() - float(data.get("measured_at", path.stat().st_mtime))
    except (OSError, ValueError, TypeError):
        return {}
    healing = data.get("healing")
    if not healing:
        trust = "not yet checked by any generation's round times"
    elif healing.get("healed"):
        trust = (f"corrected by observed rounds at {healing.get('at')} (verify x{healing.get('verify_scale')}, draft block "
                 f"{healing.get('draft_block_ms_before', 0):.2f} -> {data.get('draft_block_ms', 0):.2f} ms)")
    else:
        trust = f"confirmed by observed rounds at {healing.get('at')}"
    return {"measured": data.get("source"), "age_hours": round(age_s / 3600, 2), "checked_rounds": data.get("checked", 0),
            "trust": trust}  # fmt: skip


PLAN_ACCEPTANCES = (0.5, 0.7, 0.9)  # per-position acceptances the batch table shows


def batch_report(cost, block: int) -> dict:
    """The packed costs and, per width and acceptance, the drafts per request the server's plan takes."""
    from mlx_dspark.engine.batch.length import RowDemand, measured_widths, plan_lengths

    widths = sorted({*measured_widths(cost.max_width), cost.max_width})
    plans = {str(q): {str(w): plan_lengths(cost, [RowDemand(acceptance=[q] * block, cap=block)] * w) for w in widths}
             for q in PLAN_ACCEPTANCES}  # fmt: skip
    return {**cost.to_json(), "plans": plans}


def format_batch(data: dict) -> list[str]:
    table = lambda d: " ".join(f"{k}: {v:.2f}" for k, v in d.items())  # noqa: E731
    lines = [f"packed forwards, {data['source']} at context {data['context']} (ms): one request's forward of n rows {table(data['rows_ms'])}",
             f"  w requests of one row each: {table(data['sequences_ms'])}; draft block of w requests: {table(data['draft_ms'])}"]  # fmt: skip
    for q, by_width in data["plans"].items():
        plans = " | ".join(f"{w} at once: {' '.join(map(str, lengths))}" for w, lengths in by_width.items())
        lines.append(f"  drafts per request planned at acceptance {q} per position: {plans}")
    return lines


def format_report(data: dict) -> str:
    m = data["machine"]
    lines = [
        f"machine: {m['node']} ({m['system']} {m['machine']}), device {m['device']}, MLX {m['mlx']}, BLAS {m['blas']}",
        f"pair: {data['target']} + {data['draft']}",
        f"cost curve: {data['cache_file']} ({data['source']})",
    ]
    if "trust" in data:
        lines.append(f"  {data['measured']}, {data['age_hours']:.1f} h ago; {data['trust']}; "
                     f"{data['checked_rounds']} rounds observed (generations correct it as they run)")
    for row in data["depths"]:
        verify = " ".join(f"{ms:.2f}" for ms in row["verify_ms"].values())
        even = " ".join("-" if q is None else f"{q:.2f}" for q in row["break_even_acceptance"].values())
        draft = (f"draft chain {row['draft_block_ms']:.2f} ms + {row['draft_step_ms']:.2f} ms per draft" if "draft_step_ms" in row
                 else f"draft block {row['draft_block_ms']:.2f} ms")  # fmt: skip
        lines += [
            f"context {row['context']}: {draft}; verify of 1..{len(row['verify_ms'])} tokens: {verify} ms",
            f"  break-even acceptance per position for 1..{len(row['break_even_acceptance'])} drafts: {even} (-: never pays)",
            f"  --max-draft-tokens auto starts at {row['auto_start_length']} drafts per round"
            + (" (parked: plain decoding until acceptance shows drafting pays)" if row["auto_start_length"] == 0 else ""),
        ]
    if data.get("batch") is not None:
        lines += format_batch(data["batch"])
    for head, other in data.get("other_heads", {}).items():  # a pair of several heads: each one's own curve
        lines += ["", f"head {head}:", *format_report(other).splitlines()[2:]]
    return "\n".join(lines)


@app.command()
def cli(
    model: Optional[str] = typer.Option(None, "--model", help=flags.MODEL_HELP + " Default: the demo pair."),
    draft: Optional[str] = typer.Option(None, "--draft", help=flags.DRAFT_HELP),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Load both in this dtype (float32, bfloat16, float16): the costs depend on it."),
    quantize: flags.Quantize = None,
    measure: bool = typer.Option(False, "--measure", help="Measure again even when a cached curve exists (and replace it)."),
    careful: bool = typer.Option(False, "--careful", help="With --measure: 10 interleaved repeats at contexts 512 and 4096 instead of the quick 3 at 256 and 1024."),
    max_batch: int = typer.Option(1, "--max-batch", help="Also the packed-forward costs of up to this many requests "
                                  "at once (what `server --max-batch N` plans draft lengths with), and the plan per width."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    pipeline: bool = typer.Option(False, "--pipeline", help=PIPELINE_HELP),
) -> None:
    from mlx_dspark.engine.costs.probe import cost_curve_for, cost_curve_path, measure_chain_curve, measure_cost_curve
    from mlx_dspark.engine.proposers import loaded_heads
    from mlx_dspark.loading.load import load

    if model is None:
        demo = flags.demo_pair()
        model, draft, dtype = str(demo.target), draft or str(demo.draft), dtype or demo.dtype
    if draft is None:
        fail("--draft: the cost curve is measured for a target and its DSpark draft; give both")
    with exit_on_interrupt(), flags.flag_errors():
        flags.check_quantize(quantize)
        group = launched_group()  # under `mlx.launch -n N`: the split target's costs, network included
        with flags.load_errors(f"{model} + {draft}"):
            pair = load(model, draft=draft, dtype=dtype, quantize=quantize, split=target_splitter(group, pipeline=pipeline))
        if group is not None:
            split_or_follow(pair, group)
        reports = {}
        for head in loaded_heads(pair):  # each head's own curve (a chain: its cost per draft)
            path = cost_curve_path(pair, head=head)
            if measure and path.is_file():
                path.unlink()
            if head == "draft":
                options = dict(context=512, deep_context=4096, repeats=10) if careful else {}
                measure_head = lambda target, d: measure_cost_curve(target, d, **options)  # noqa: E731
            else:
                options = dict(context=512, repeats=10) if careful else {}
                measure_head = lambda target, d, head: measure_chain_curve(target, d, head=head, **options)  # noqa: E731
            reports[head] = report(pair, cost_curve_for(pair, head=head, measure=measure_head), path, head=head)
        if not reports:
            fail(f"--draft {draft}: no draft head to calibrate")
        data, *others = reports.values()
        if others:
            data["other_heads"] = {other["head"]: other for other in others}
        if max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        if max_batch > 1:
            data["batch"] = _batch(pair, max_batch, remeasure=measure)
    typer.echo(json.dumps(data, indent=2) if as_json else format_report(data))


def _batch(pair, max_batch: int, *, remeasure: bool) -> dict:
    from mlx_dspark.engine.batch.length import batch_cost_for, batch_cost_path
    from mlx_dspark.models.packed.forward import packing_problem

    problem = packing_problem(pair)
    if problem is not None:
        raise ValueError(f"--max-batch {max_batch}: {problem}; the server serves this pair one request at a time")
    path = batch_cost_path(pair, max_batch)
    if remeasure and path.is_file():
        path.unlink()
    return {**batch_report(batch_cost_for(pair, max_batch), int(pair.draft.num_drafts)), "cache_file": str(path)}


def main() -> None:
    app()
