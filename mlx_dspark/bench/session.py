"""One benchmark session: load the pair, run the datasets, the cost curve and the controlled runs, report.

Text goes to stdout (tables) and stderr (progress, notes); files go to `Options.out`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from mlx_dspark.bench import card, controlled, controlled_chain, cost, plots, report, runner, schedule_ab
from mlx_dspark.bench.mlx_lm_baseline import make_mlx_lm_baseline
from mlx_dspark.bench.prompts import select_prompts
from mlx_dspark.bench.stats import loadavg
from mlx_dspark.engine.proposers import head_block


@dataclass
class Options:
    model: str
    draft: str
    out: Path
    draft_tap_ids: Optional[list[int]] = None  # --draft-tap-ids
    settings: runner.RunSettings = runner.RunSettings()  # how every timed run generates
    datasets: list[str] = field(default_factory=list)
    dataset_files: list[str] = field(default_factory=list)
    prompts_per_dataset: Optional[int] = None
    dtype: Optional[str] = None
    quantize: Optional[int] = None
    # load()'s draft precision / reduced vocabulary / KV-bits keywords (--draft-quantize, --draft-vocab, --kv-bits, ...)
    load_options: dict = field(default_factory=dict)
    mlx_lm_baseline: bool = True
    run_datasets: bool = True
    cost_curve: bool = False
    cost_context: Optional[int] = None
    cost_repeats: int = 10
    controlled_acceptance: list[float] = field(default_factory=list)
    controlled_context: int = 512
    controlled_prompts: int = 2
    controlled_tokens: int = 128
    parity_repeats: int = 0
    card_columns: bool = False  # the card's four acceptance columns, fixed vs confidence schedule
    card_max_tokens: int = card.CARD_MAX_TOKENS
    schedule_ab: bool = False  # fixed vs confidence schedule at a calibrated synthetic profile (controlled prompts)
    progress: bool = True


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress_records(model, prompts, settings, baseline, *, show: bool) -> list[dict]:
    records = runner.run_prompts(model, prompts, settings, baseline)
    if not show:
        return list(records)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    out = []
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("prompts", total=len(prompts))
        for record in records:
            out.append(record)
            bar.update(task, advance=1, description=f"{record['category']} #{record['index']}")
    return out


def _controlled_prompts(model, prompts: Sequence, options: Options) -> list[list[int]]:
    if not prompts:
        prompts = select_prompts(datasets=[], files=[], limit=None)
    count = min(options.controlled_prompts, len(prompts))
    step = max(1, len(prompts) // max(count, 1))
    chosen = [prompts[i * step] for i in range(count)]
    return [controlled.tiled_prompt(runner.prompt_ids(model, p), options.controlled_context) for p in chosen]


def load_pair(options: Options, *, split: Any = None) -> Any:
    """The pair the flags name (the command's load boundary wraps this call); `split`: `load`'s hook that
    splits the target over the ranks of an `mlx.launch` run."""
    import mlx_dspark

    return mlx_dspark.load(
        options.model, draft=options.draft, dtype=options.dtype, quantize=options.quantize, draft_tap_ids=options.draft_tap_ids,
        split=split, **options.load_options,
    )


def run(options: Options, *, meta: dict, loaded: Any = None) -> dict:
    """Everything the flags ask for; returns the results dict also written to results.json."""
    settings = options.settings
    if options.controlled_acceptance and not settings.ignore_eos:
        _note("note: controlled-acceptance runs always ignore stop tokens (they follow a fixed greedy reference)")
    loaded = load_pair(options) if loaded is None else loaded
    head = controlled_chain.chain_head(loaded)  # None: a block draft
    if loaded.draft is None and head is None:
        raise ValueError("the benchmark needs a draft: pass --draft")
    block = head_block(loaded, head or "draft")  # a block draft's block, or the chain's default length
    settings.generation.speculation.draft_length(block)  # before any long run
    model = runner.prepare_model(loaded, settings)
    meta = {**meta, "target": str(loaded.target_path), "draft": str(loaded.draft_path), "settings": dataclasses.asdict(settings)}
    prompts = select_prompts(datasets=options.datasets, files=options.dataset_files, limit=options.prompts_per_dataset)

    records: list[dict] = []
    baseline = None
    if options.run_datasets:
        baseline = make_mlx_lm_baseline(loaded, dtype=options.dtype, quantize=options.quantize) if options.mlx_lm_baseline else None
        meta["mlx_lm_baseline"] = baseline.kind if baseline else None
        records = _progress_records(model, prompts, settings, baseline, show=options.progress)
    results = report.build_results(records, meta=meta)
    sections: list[str] = []
    if options.parity_repeats and baseline is not None:
        results["baseline_parity"] = runner.baseline_parity(model, baseline, prompts[0], settings, repeats=options.parity_repeats)
        sections.append(runner.format_parity(results["baseline_parity"]))
    if records:
        print("\n".join(report.table_lines([*results["rows"], results["average"]], markdown=False)))
        print("\n".join(report.lossless_lines(records)))
    for section in sections:
        print(section)
    if options.card_columns:
        from mlx_dspark.engine.costs.probe import cost_curve_for
        from mlx_dspark.engine.costs.curve import require_confidence_head

        require_confidence_head(loaded.draft, source=loaded.draft_path)
        curve = settings.generation.speculation.cost_curve or cost_curve_for(loaded)
        results["card_columns"] = card.run_card_columns(model, prompts, settings, cost_curve=curve, max_tokens=options.card_max_tokens)
        sections.append(card.format_card_columns(results["card_columns"]))
        print(sections[-1])

    if options.cost_curve or options.controlled_acceptance:
        no_stop = runner.prepare_model(loaded, runner.RunSettings(ignore_eos=True))
        controlled_ids = _controlled_prompts(no_stop, prompts, options) if options.controlled_acceptance else []
        context = options.cost_context
        if context is None:
            context = options.controlled_context + options.controlled_tokens // 2 if controlled_ids else 512
        if head is None:
            # widths 1..8, fewer for a block of under 7 drafts (a DFlash block of 7 drafts 6)
            curve = cost.measure_round_breakdown(loaded, context=context, repeats=options.cost_repeats, seed=settings.seed, max_width=min(8, block + 1))
        else:  # the chain's curve as `auto` measures it, for the chain the controlled runs drive
            steps = controlled_chain.chain_steps(loaded, head, options.controlled_acceptance)
            curve = controlled_chain.measure_chain_cost(loaded, head, steps=steps, context=context, repeats=options.cost_repeats, seed=settings.seed)
        results["cost_curve"] = curve
        sections.append(cost.format_cost_curve(curve) if head is None else controlled_chain.format_chain_cost(curve))
        print(sections[-1])
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / "cost_curve.json").write_text(json.dumps(curve, indent=2) + "\n", encoding="utf-8")
        if controlled_ids:
            results["controlled"] = controlled.run_controlled(
                no_stop,
                controlled_ids,
                acceptance_lengths=options.controlled_acceptance,
                max_tokens=options.controlled_tokens,
                repeats=settings.repeats,
            )
            sections.append(controlled.format_controlled(results["controlled"]))
            print(sections[-1])

    if options.schedule_ab:
        from mlx_dspark.engine.costs.probe import cost_curve_for

        no_stop = runner.prepare_model(loaded, runner.RunSettings(ignore_eos=True))
        curve = settings.generation.speculation.cost_curve or cost_curve_for(loaded)
        results["schedule_ab"] = schedule_ab.run_schedule_ab(
            no_stop,
            _controlled_prompts(no_stop, prompts, options),
            machine_curve=curve,
            max_tokens=options.controlled_tokens,
            repeats=settings.repeats,
        )
        sections.append(schedule_ab.format_schedule_ab(results["schedule_ab"]))
        print(sections[-1])

    results["meta"]["loadavg_end"] = loadavg()
    written = report.write_outputs(results, options.out, extra_sections=sections)
    if records:
        images, note = plots.write_plots(results, options.out)
        written += images
        if note:
            _note(note)
    _note("wrote " + ", ".join(str(p) for p in written))
    return results
