"""`python -m mlx_dspark.benchmark`: model-card tables and honest engine measurements.

For each prompt: our plain decoding and DSpark with the same settings, warmed up and interleaved in
one process, plus mlx-lm's plain generation once; a table per dataset (AIME25, GSM8K, MATH500,
HumanEval, MBPP, Arena-Hard-v2, average), results.json, results.md and plots. `--cost-curve` and
`--controlled-acceptance` add engine measurements for random-weight pairs (see bench/cost.py and
bench/controlled.py). The pieces live in `mlx_dspark.bench`; this module only parses flags.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from mlx_dspark.cli import common as flags
from mlx_dspark.cli.common import fail, flag_errors
from mlx_dspark.cli.split import PIPELINE_HELP, launched_group, split_or_follow, target_splitter

app = typer.Typer(add_completion=False, help="Benchmark DSpark against plain decoding (ours and mlx-lm's).")


OPENBLAS_ENV = {"LD_PRELOAD": "libopenblas.so.0", "OPENBLAS_NUM_THREADS": "1"}


def openblas_loaded() -> bool:
    maps = Path("/proc/self/maps")
    return maps.is_file() and "libopenblas" in maps.read_text()


def reexec_with_openblas() -> None:
    """Restart this command with MLX's float32 sgemm routed to OpenBLAS (one thread), Linux only.

    Importing the package already loads mlx, and a preload only works before that, so the flag
    re-executes `python -m mlx_dspark.benchmark` with LD_PRELOAD set (BENCHMARKING.md).
    """
    if sys.platform != "linux":
        fail("--openblas is for Linux CPU runs only (never on macOS, where MLX uses Metal/Accelerate)")
    if openblas_loaded():
        return
    if ctypes.util.find_library("openblas") is None:
        fail("libopenblas.so.0 not found: apt-get install -y libopenblas0-pthread")
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is None or main_spec.name != "mlx_dspark.benchmark" or os.environ.get("MLX_DSPARK_OPENBLAS_REEXEC"):
        fail("--openblas needs OpenBLAS preloaded before mlx is imported: run `python -m mlx_dspark.benchmark --openblas ...` "
             "or set LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 yourself")
    env = {**os.environ, **OPENBLAS_ENV, "MLX_DSPARK_OPENBLAS_REEXEC": "1"}
    os.execvpe(sys.executable, [sys.executable, "-m", "mlx_dspark.benchmark", *sys.argv[1:]], env)


def blas_setting() -> str:
    """Which BLAS this process routes float32 matmuls to, read from its memory map (Linux)."""
    if sys.platform == "darwin":
        return "macOS (Metal / Accelerate)"
    if openblas_loaded():
        return f"OpenBLAS (OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')})"
    return "MLX's bundled reference BLAS"


def run_meta(*, dtype: Optional[str], quantize: Optional[int]) -> dict:
    import mlx.core as mx
    from importlib.metadata import version

    from mlx_dspark.bench.stats import loadavg

    return {
        "command": " ".join(["python -m mlx_dspark.benchmark", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "device": str(mx.default_device()),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "blas": blas_setting(),
        "dtype": dtype or "checkpoint",
        "quantize": quantize,
        "loadavg_start": loadavg(),
    }


def parse_floats(text: str, *, option: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"{option} expects comma-separated numbers, got {text!r}")
        raise


@app.command()
def main(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", help=flags.MODEL_HELP + " Default: the demo pair."),
    draft: Optional[str] = typer.Option(None, "--draft", "--draft-model", help=flags.DRAFT_HELP + " Required with --model."),
    draft_tap_ids: flags.DraftTapIds = None,
    datasets: Optional[list[str]] = typer.Option(None, "--datasets", help="Built-in sets (comma-separated or repeated); default all."),
    dataset_files: Optional[list[str]] = typer.Option(None, "--dataset", help="NAME=FILE.jsonl (repeatable)."),
    prompts_per_dataset: Optional[int] = typer.Option(None, "--prompts-per-dataset", help="Use at most N prompts of each set."),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    temp: flags.Temp = flags.SAMPLING.temperature,
    top_p: flags.TopP = flags.SAMPLING.top_p,
    top_k: flags.TopK = flags.SAMPLING.top_k,
    min_p: flags.MinP = flags.SAMPLING.min_p,
    draft_sampling: flags.DraftSampling = flags.SPECULATION.draft_sampling,
    p_min: flags.PMin = flags.SPECULATION.p_min,
    confidence_threshold: flags.ConfidenceThreshold = flags.SPECULATION.confidence_threshold,
    max_draft_tokens: flags.MaxDraftTokens = flags.SPECULATION.max_draft_tokens,
    verify_schedule: flags.VerifySchedule = flags.SPECULATION.verify_schedule,
    lookup: flags.Lookup = flags.SPECULATION.lookup,
    cost_curve_file: flags.CostCurveFile = None,
    max_context: flags.MaxContext = None,
    repeats: int = typer.Option(1, "--repeats", help="Timed repeats per prompt and mode (medians)."),
    seed: flags.Seed = 0,
    out: Path = typer.Option(Path("benchmark-results"), "--out", help="Directory for results.json, results.md, plots."),
    pipeline: bool = typer.Option(False, "--pipeline", help=PIPELINE_HELP),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Cast weights: float32, bfloat16, float16."),
    quantize: flags.Quantize = None,
    draft_quantize: flags.DraftQuantize = None,
    draft_dtype: flags.DraftDtype = None,
    draft_vocab: flags.DraftVocab = None,
    draft_vocab_file: flags.DraftVocabFile = None,
    kv_bits: flags.KvBits = None,
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Always generate --max-tokens (random-weight pairs)."),
    no_mlx_lm_baseline: bool = typer.Option(False, "--no-mlx-lm-baseline", help="Skip mlx-lm's plain generation."),
    skip_datasets: bool = typer.Option(False, "--skip-datasets", help="Only the engine measurements."),
    cost_curve: bool = typer.Option(False, "--cost-curve", help="Measure target forwards of 1..8 tokens, a draft block, decode."),
    cost_context: Optional[int] = typer.Option(None, "--cost-context", help="Context length of the cost curve (default: the controlled runs' mean context, else 512)."),
    cost_repeats: int = typer.Option(10, "--cost-repeats"),
    controlled_acceptance: Optional[str] = typer.Option(None, "--controlled-acceptance", help="e.g. 3.0,4.0,4.55,6.0: engine efficiency at these acceptance lengths."),
    controlled_context: int = typer.Option(512, "--controlled-context", help="Prompt length of the controlled runs."),
    controlled_prompts: int = typer.Option(2, "--controlled-prompts"),
    controlled_tokens: Optional[int] = typer.Option(None, "--controlled-tokens", help="Tokens per controlled run (default --max-tokens)."),
    parity_repeats: int = typer.Option(0, "--parity-repeats", help="Also time our plain decoding against mlx-lm's N times each, interleaved, on the first prompt."),
    card_columns: bool = typer.Option(False, "--card-columns", help="The model card's four acceptance columns (T=1 high/low/no thinking with sampled drafts, T=0 high thinking greedy), each with --verify-schedule fixed and confidence."),
    card_max_tokens: int = typer.Option(4096, "--card-max-tokens", help="Maximum output of the card-column runs (the card uses 4096)."),
    schedule_ab: bool = typer.Option(False, "--schedule-ab", help="Fixed vs confidence verify schedule at a calibrated synthetic confidence profile, on this machine's cost curve (or --cost-curve-file) and a flat one (controlled prompts and tokens)."),
    openblas: bool = typer.Option(False, "--openblas", help="Linux CPU: rerun with OpenBLAS (1 thread) preloaded for float32 matmuls."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on stderr."),
    force: bool = typer.Option(False, "--force", help="Overwrite results already in --out."),
) -> None:
    if (out / "results.json").exists() and not force:
        fail(f"{out} already holds results (results.json); choose another --out or pass --force to overwrite them")
    if openblas:
        reexec_with_openblas()
    from mlx_dspark.bench import session
    from mlx_dspark.bench.runner import RunSettings

    if draft == flags.LOOKUP_DRAFT:
        fail("--draft lookup: the benchmark measures a DSpark draft against plain decoding; use --lookup on or only "
             "(beside the loaded draft), or scripts/bench_lookup.py for lookup without a draft")
    draft = flags.resolve_draft(model, draft, no_draft=False)
    if model is None:
        try:
            demo = flags.demo_pair()
        except FileNotFoundError as err:
            fail(str(err))
        typer.echo(f"[mlx_dspark] {demo.note}", err=True)
        model, draft, dtype = str(demo.target), draft or str(demo.draft), dtype or demo.dtype
    elif draft is None:
        fail("--draft: the DSpark draft of --model is required (without --model, the demo pair is used)")

    taus = parse_floats(controlled_acceptance, option="--controlled-acceptance") if controlled_acceptance else []
    names = [part.strip() for item in (datasets or []) for part in item.split(",") if part.strip()]
    with flag_errors():
        flags.check_quantize(quantize)
        load_options = flags.draft_load_options(ctx.params)
        tap_ids = flags.parse_tap_ids(draft_tap_ids, draft=draft, model=model)
        generation = flags.generation_options(ctx.params, max_tokens=max_tokens)  # the shared flags, by name
        settings = RunSettings(generation=generation, repeats=repeats, ignore_eos=ignore_eos)
    options = session.Options(
        model=model,
        draft=draft,
        draft_tap_ids=tap_ids,
        out=out,
        settings=settings,
        datasets=names,
        dataset_files=list(dataset_files or []),
        prompts_per_dataset=prompts_per_dataset,
        dtype=dtype,
        quantize=quantize,
        load_options=load_options,
        mlx_lm_baseline=not no_mlx_lm_baseline,
        run_datasets=not skip_datasets,
        cost_curve=cost_curve,
        cost_context=cost_context,
        cost_repeats=cost_repeats,
        controlled_acceptance=taus,
        controlled_context=controlled_context,
        controlled_prompts=controlled_prompts,
        controlled_tokens=controlled_tokens or max_tokens,
        parity_repeats=parity_repeats,
        card_columns=card_columns,
        card_max_tokens=card_max_tokens,
        schedule_ab=schedule_ab,
        progress=progress,
    )
    group = launched_group()  # under `mlx.launch -n N`: the target split over the ranks as it loads, rank 0 reports
    with flags.load_errors(f"{options.model} + {options.draft}"):
        loaded = session.load_pair(options, split=target_splitter(group, pipeline=pipeline))
    if group is not None:
        split_or_follow(loaded, group)
    try:
        with flag_errors():  # a dataset line, a model path, or a --max-draft-tokens the loaded draft cannot take
            meta = run_meta(dtype=dtype, quantize=quantize)
            meta["load_options"] = {k: str(v) for k, v in load_options.items()}
            session.run(options, meta=meta, loaded=loaded)
    except FileNotFoundError as err:
        fail(str(err))

if __name__ == "__main__":
    app()
