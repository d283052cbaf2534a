"""Never slower: plain vs the default vs fixed 7 on prompts no draft can predict, interleaved.

    python scripts/bench_never_slower.py [PAIR_DIR ...] [--blas both]

Each PAIR_DIR holds `target/` and `draft/` (default: the bundled demo pair; add the scaled Spark pair of
scripts/make_scaled_spark_pair.py). Prompts are invented words, base64 and digits (seeded, raw text), so
the draft accepts little and a good policy parks. Modes per cell, rotated per repeat after a warm-up:
plain (the target alone), default (every default: auto length, lookup on), default with lookup off,
fixed 7. Printed per pair, BLAS and prompt: median generation tok/s of each mode, default / plain,
rounds parked and drafted (probes) of the default, and the cost curve the default used (a fresh cost
cache per process: the curve a new user gets). `--blas both` runs the whole thing twice, in child
processes: with MLX's bundled BLAS, then with OpenBLAS preloaded (one thread, BENCHMARKING.md).
"""

from __future__ import annotations

import base64
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
app = typer.Typer(add_completion=False)
MODES = ("plain", "default", "default_nolookup", "fixed7")


def unpredictable_prompts(seed: int = 7) -> dict[str, str]:
    rng = random.Random(seed)
    syllables = ["ka", "zu", "mi", "tor", "vel", "xi", "qua", "ro", "ne", "sil", "bra", "oom", "fe", "gli"]
    words = " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(60))
    b64 = base64.b64encode(bytes(rng.randrange(256) for _ in range(240))).decode()
    digits = "".join(rng.choice("0123456789") for _ in range(300))
    return {"invented_words": words, "base64": b64, "digits": digits}


def options_for(mode: str, max_tokens: int):
    from mlx_dspark.engine.options import GenerationOptions, SamplingOptions, SpeculationOptions

    speculation = {
        "plain": SpeculationOptions(speculative=False),
        "default": SpeculationOptions(),
        "default_nolookup": SpeculationOptions(lookup="off"),
        "fixed7": SpeculationOptions(max_draft_tokens=7, lookup="off"),
    }[mode]
    return GenerationOptions(max_tokens=max_tokens, sampling=SamplingOptions(temperature=0.0), speculation=speculation)


def run_blas(pairs: list[Path], *, max_tokens: int, repeats: int, blas: str, modes: tuple[str, ...] = MODES,
             prompts: tuple[str, ...] = ()) -> dict:
    from mlx_dspark import load
    from mlx_dspark.api import generate
    from mlx_dspark.bench.runner import RunSettings, prepare_model
    from mlx_dspark.engine.costs.probe import cost_curve_for

    results: dict = {"blas": blas, "loadavg_before": Path("/proc/loadavg").read_text().split()[:3], "cells": []}
    for pair in pairs:
        loaded = load(str(pair / "target"), draft=str(pair / "draft"), dtype="float32")
        model = prepare_model(loaded, RunSettings(ignore_eos=True))  # random-weight pairs: always max_tokens
        curve = cost_curve_for(model)  # measured now: the process's cost cache is fresh
        print(f"[{blas}] {pair.name}: cost curve draft {curve.draft_ms:.1f} ms, verify(1..{curve.max_width}) "
              + " ".join(f"{v:.1f}" for v in curve.verify_ms) + " ms", flush=True)
        for name, text in unpredictable_prompts().items():
            if prompts and name not in prompts:
                continue
            ids = model.tokenizer.encode(text)[:192]
            tps = {m: [] for m in modes}
            parked = {"default": 0, "default_nolookup": 0}
            drafted = dict(parked)
            reference = None
            identical = True
            for repeat in range(repeats + 1):  # repeat 0 warms up and is not recorded
                order = modes[repeat % len(modes):] + modes[: repeat % len(modes)]
                for mode in order:
                    result = generate(model, ids, options=options_for(mode, max_tokens))
                    if mode == "plain":
                        reference = reference or result.tokens
                    elif reference is not None:
                        identical &= result.tokens == reference
                    if not repeat:
                        continue
                    tps[mode].append(result.generation_tps)
                    if mode in parked:
                        parked[mode] += sum(1 for n in result.proposal_lengths if n == 0) + (result.target_forwards - 1 - len(result.proposal_lengths))
                        drafted[mode] += sum(1 for n in result.proposal_lengths if n > 0)
            median = {m: statistics.median(v) for m, v in tps.items()}
            over = {m: median[m] / median["plain"] for m in modes}
            cell = {
                "pair": pair.name, "prompt": name, "tokens": max_tokens, "median_tps": median, "tps": tps,
                **{f"{'nolookup' if m == 'default_nolookup' else m}_over_plain": x for m, x in over.items() if m != "plain"},
                "parked_rounds_per_run": {m: n / repeats for m, n in parked.items() if m in modes},
                "drafted_rounds_per_run": {m: n / repeats for m, n in drafted.items() if m in modes},
                "greedy_identical": identical, "curve": curve.to_json(),
            }
            results["cells"].append(cell)
            shown = " | ".join(f"{m} x{x:.3f}" for m, x in over.items() if m != "plain")
            counts = ", ".join(f"{m} {parked[m] / repeats:.0f} / {drafted[m] / repeats:.0f}" for m in parked if m in modes)
            print(f"[{blas}] {pair.name:>8} {name:>14}: plain {median['plain']:.1f} tok/s | {shown} | rounds parked / drafted "
                  f"per run: {counts} | identical {identical}", flush=True)
    results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    return results


@app.command()
def main(
    pairs: list[Path] = typer.Argument(None, help="Pair directories (target/ and draft/); default the demo pair."),
    max_tokens: int = typer.Option(256, "--max-tokens"),
    repeats: int = typer.Option(3, "--repeats"),
    blas: str = typer.Option("default", "--blas", help="default, openblas (this process is preloaded), or both (two children)."),
    out: Path = typer.Option(Path("benchmarks/results/never_slower.json"), "--out"),
    modes: str = typer.Option(",".join(MODES), "--modes", help=f"Modes to interleave, comma-separated (plain always): {', '.join(MODES)}."),
    prompts: str = typer.Option("", "--prompts", help="Prompts to run, comma-separated (default all): invented_words, base64, digits."),
) -> None:
    pairs = pairs or [ROOT / "mlx_dspark" / "demo"]
    if blas == "both":
        rows = []
        for child in ("default", "openblas"):
            env = dict(os.environ)
            if child == "openblas":
                env.update(LD_PRELOAD="libopenblas.so.0", OPENBLAS_NUM_THREADS="1")
            part = out.with_suffix(f".{child}.json")
            subprocess.run([sys.executable, __file__, *map(str, pairs), "--max-tokens", str(max_tokens), "--repeats", str(repeats),
                            "--blas", child, "--out", str(part), "--modes", modes, "--prompts", prompts], env=env, check=True)
            rows.append(json.loads(part.read_text()))
        out.write_text(json.dumps(rows, indent=2) + "\n")
        worst = [c["default_over_plain"] for r in rows for c in r["cells"] if "default_over_plain" in c]
        if worst:
            print(f"worst default / plain over every cell: x{min(worst):.3f}")
        return
    with tempfile.TemporaryDirectory() as cost_dir:
        os.environ["MLX_DSPARK_COST_DIR"] = cost_dir  # a fresh cost cache: what a new user measures
        chosen = ("plain", *(m for m in modes.split(",") if m and m != "plain"))
        unknown = [m for m in chosen if m not in MODES]
        if unknown:
            raise typer.BadParameter(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}", param_hint="--modes")
        results = run_blas(pairs, max_tokens=max_tokens, repeats=repeats, blas=blas, modes=chosen,
                           prompts=tuple(p for p in prompts.split(",") if p))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    app()
