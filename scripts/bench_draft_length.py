"""Plain vs fixed 7 vs `auto` draft lengths, interleaved: `python scripts/bench_draft_length.py PAIR_DIR`.

PAIR_DIR holds `target/` and `draft/` (scripts/make_scaled_spark_pair.py). Three scenarios (issue 26):
  (a) a cost-curve file where verify(n) = n x verify(1) (speculation can never pay), the real draft's
      own (random-weight: near-zero) acceptance: auto must park, within 3% of plain; fixed 7 far below;
  (b) this machine's measured curve, controlled acceptance length 4.55 (bench/controlled.py): auto >= fixed 7;
  (c) the same curve at controlled acceptance 1.5: auto >= plain within 3%;
  natural: the measured curve and the draft's own acceptance (the demo pair: `mlx_dspark/demo`).
Every mode of a scenario runs in rotating order per repeat; medians of tok/s and ratios are printed
with the cost curve. Run it as BENCHMARKING.md says: float32 with
`LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1`.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_dspark import load  # noqa: E402
from mlx_dspark.api import generate  # noqa: E402
from mlx_dspark.bench.controlled import ControlledProposer, greedy_reference, tiled_prompt  # noqa: E402
from mlx_dspark.bench.runner import RunSettings, prepare_model  # noqa: E402
from mlx_dspark.bench.stats import loadavg  # noqa: E402
from mlx_dspark.engine.costs.probe import measure_cost_curve  # noqa: E402
from mlx_dspark.engine.policy.draft_length import AutoLength, break_even  # noqa: E402
from mlx_dspark.engine.options import GenerationOptions, SpeculationOptions  # noqa: E402
from mlx_dspark.engine.proposers.dspark import DraftProposer  # noqa: E402
from mlx_dspark.engine.costs.curve import CostCurve  # noqa: E402

app = typer.Typer(add_completion=False)


def options(mode: str, curve: CostCurve, max_tokens: int) -> GenerationOptions:
    if mode == "plain":
        speculation = SpeculationOptions(speculative=False)
    elif mode == "fixed7":
        speculation = SpeculationOptions(max_draft_tokens=7)
    else:
        speculation = SpeculationOptions(max_draft_tokens="auto", cost_curve=curve)
    return GenerationOptions(max_tokens=max_tokens, speculation=speculation)


def scenario(model, ids, reference, *, curve, tau, max_tokens, repeats) -> dict:
    modes = ["plain", "fixed7", "auto"]
    tps = {m: [] for m in modes}
    lengths = {m: {} for m in modes}
    match = {m: True for m in modes}
    for repeat in range(repeats + 1):  # the first pass is a warm-up, not recorded
        rotation = repeat % len(modes)
        for mode in modes[rotation:] + modes[:rotation]:
            proposer = None
            if tau is not None and mode != "plain":
                proposer = ControlledProposer(
                    DraftProposer(model.draft, model.target, greedy=True, temperature=1.0), reference,
                    prompt_len=len(ids), vocab_size=model.target.args.vocab_size, acceptance_length=tau,
                )  # fmt: skip
            result = generate(model, list(ids), options=options(mode, curve, max_tokens), proposer=proposer)
            match[mode] &= result.tokens == reference[: len(result.tokens)]
            if repeat:
                tps[mode].append(result.generation_tps)
                for n, count in result.draft_lengths.items():
                    lengths[mode][n] = lengths[mode].get(n, 0) + count
    medians = {m: statistics.median(v) for m, v in tps.items()}
    return {
        "tau": tau,
        "curve": curve.to_json(),
        "tps": tps,
        "median_tps": medians,
        "auto_over_plain": medians["auto"] / medians["plain"],
        "auto_over_fixed7": medians["auto"] / medians["fixed7"],
        "fixed7_over_plain": medians["fixed7"] / medians["plain"],
        "draft_lengths": lengths,
        "greedy_identical": match,
    }


def describe(curve: CostCurve) -> str:
    cap = min(7, curve.max_width - 1)
    even = [break_even(curve, n) for n in range(1, cap + 1)]
    return (
        f"draft {curve.draft_ms:.1f} ms, verify(1..{curve.max_width}) "
        + " ".join(f"{v:.1f}" for v in curve.verify_ms)
        + " ms; break-even q per length: "
        + " ".join("-" if q is None else f"{q:.2f}" for q in even)
        + f"; auto starts at {AutoLength(curve, cap).start_length()}"
    )


@app.command()
def main(
    pair: Path,
    context: int = typer.Option(256, "--context", help="Prompt tokens."),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    repeats: int = typer.Option(5, "--repeats"),
    out: Path = typer.Option(Path("benchmarks/results/draft_length.json"), "--out"),
    scenarios: str = typer.Option("a,b,c", "--scenarios", help="a, b, c (above) and natural: the measured curve, the draft's own acceptance."),
    prompt: str = typer.Option("def main(argv):\n    return parse(argv) + 1\n", "--prompt", help="Raw text, tiled to --context tokens."),
) -> None:
    loaded = load(str(pair / "target"), draft=str(pair / "draft"), dtype="float32")
    model = prepare_model(loaded, RunSettings(ignore_eos=True))
    encoded = model.tokenizer.encode(prompt)
    ids = encoded if len(encoded) >= context else tiled_prompt(encoded, context)
    reference = greedy_reference(model.target, ids, max_tokens + 16)
    load_before = loadavg()
    measured = measure_cost_curve(model.target, model.draft, context=context, deep_context=4 * context, repeats=5)
    linear = CostCurve(draft_ms=measured.draft_ms, verify_ms=[measured.verify_ms[0] * n for n in range(1, 9)], source="verify(n) = n x verify(1)")
    print(f"measured curve at {measured.context}: {describe(measured)}")
    print(f"  at {measured.deep.context}: {describe(measured.deep)}")
    print(f"linear curve: {describe(linear)}")
    results = {}
    chosen = {"a": ("a_linear_file", linear, None), "b": ("b_tau_4.55", measured, 4.55), "c": ("c_tau_1.5", measured, 1.5),
              "natural": ("natural", measured, None)}
    for name, curve, tau in (chosen[key] for key in scenarios.split(",")):
        row = scenario(model, ids, reference, curve=curve, tau=tau, max_tokens=max_tokens, repeats=repeats)
        results[name] = row
        m = row["median_tps"]
        print(
            f"{name}: plain {m['plain']:.2f} fixed7 {m['fixed7']:.2f} auto {m['auto']:.2f} tok/s | auto/plain "
            f"{row['auto_over_plain']:.3f} auto/fixed7 {row['auto_over_fixed7']:.3f} fixed7/plain {row['fixed7_over_plain']:.3f} | "
            f"auto lengths {row['draft_lengths']['auto']} | greedy identical {row['greedy_identical']}",
            flush=True,
        )
    results["measured_curve"] = measured.to_json()
    results["loadavg"] = [load_before, loadavg()]
    print(f"loadavg {load_before} -> {loadavg()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    app()
