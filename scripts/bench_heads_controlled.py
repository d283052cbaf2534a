"""Engine efficiency per draft head of one target, at controlled acceptance (issue 35.5).

For each head given with `--head` (a draft path, GGUF, or anything `--draft` takes), runs the
controlled-acceptance benchmark (`python -m mlx_dspark.benchmark --controlled-acceptance ...`,
bench/controlled.py: the head's real forward runs each round, its tokens replaced by the target's
greedy continuation with the chosen mean acceptance) in its own process, one head after the other,
and prints per head and acceptance length: efficiency = measured speedup / ideal speedup, beside
the cost curve it was measured on (a block draft's ms per block, a chained head's ms for its first
draft and per chained step; verify(1..8) ms) and the costs timed interleaved with the runs that the
ideal speedup uses. Block drafts (DSpark, DFlash, DFlash 2) and chained heads (`--head mtp` on a target
with MTP layers, an EAGLE-3 draft, a Gemma 4 assistant: bench/controlled_chain.py) are both driven. A
head the harness cannot drive is one line with its error, and the others still run.

    python scripts/bench_heads_controlled.py --model /tmp/bench/scaled/target \\
        --head /tmp/bench/scaled/draft --head /tmp/bench/scaled/dflash2 --head /tmp/bench/scaled/eagle3 --openblas
    python scripts/bench_heads_controlled.py --model /tmp/bench/scaled/mtp-target --head mtp --openblas
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from mlx_dspark.bench.controlled import draft_cost_text


def benchmark_command(model: str, head: str, out: Path, args: argparse.Namespace) -> list[str]:
    command = [
        sys.executable, "-m", "mlx_dspark.benchmark", "--model", model, "--draft", head, "--skip-datasets",
        "--controlled-acceptance", args.acceptance, "--controlled-context", str(args.context),
        "--controlled-tokens", str(args.tokens), "--controlled-prompts", str(args.prompts),
        "--repeats", str(args.repeats), "--cost-repeats", str(args.cost_repeats),
        "--out", str(out), "--force", "--no-progress", "--no-mlx-lm-baseline",
    ]  # fmt: skip
    return command + (["--openblas"] if args.openblas else [])


def run_head(model: str, head: str, out: Path, args: argparse.Namespace) -> dict:
    """The head's results.json, or {"error": its last output line}."""
    done = subprocess.run(benchmark_command(model, head, out, args), capture_output=True, text=True)
    results = out / "results.json"
    if done.returncode != 0 or not results.exists():
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit status {done.returncode}"}
    return json.loads(results.read_text(encoding="utf-8"))


def head_lines(head: str, results: dict) -> list[str]:
    if "error" in results:
        return [f"{head}: not measured: {results['error']}"]
    curve, controlled = results["cost_curve"], results["controlled"]
    verify = " ".join(f"{curve['verify_ms'][w]:.1f}" for w in sorted(curve["verify_ms"], key=int))
    if "draft_step_ms" in curve:  # a chained head: its first draft, then a cost per chained step
        draft = (f"{curve['head']} chain of {curve['chain_steps']}: {curve['draft_ms']:.1f} ms + "
                 f"{curve['draft_step_ms']:.2f} ms/step = {curve['draft_block_ms']:.1f} ms")  # fmt: skip
    else:
        draft = f"draft block of {curve['block_size']}: {curve['draft_block_ms']:.1f} ms"
    lines = [
        f"{head}",
        f"  cost curve (context {curve.get('context', '?')}): {draft}, "
        f"verify(1..{len(curve['verify_ms'])}) {verify} ms; plain {controlled['plain_tokens_per_second']:.1f} tok/s",
        f"  interleaved with the runs: {draft_cost_text(controlled)}, verify({controlled['draft_tokens'] + 1}) "
        f"{controlled['verify_ms']:.1f} ms, plain {controlled['decode_ms']:.1f} ms/token",
        f"  {'tau':>6} {'tau meas.':>9} {'measured':>9} {'ideal':>7} {'efficiency':>10} {'round ms':>9} {'ideal ms':>9} {'lossless':>8}",
    ]
    for row in controlled["rows"]:
        lines.append(
            f"  {row['target_acceptance_length']:>6.2f} {row['measured_acceptance_length']:>9.2f} {row['measured_speedup']:>8.2f}x "
            f"{row['ideal_speedup']:>6.2f}x {row['efficiency']:>10.2f} {row['round_ms']:>9.1f} {row['ideal_round_ms']:>9.1f} "
            f"{row['outputs_match_reference']:>8.2f}"
        )
    lines.append(f"  loadavg {controlled['loadavg_before']} -> {controlled['loadavg_after']}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--head", action="append", required=True, help="A draft head of the target (repeatable).")
    parser.add_argument("--acceptance", default="2.0,3.0,4.55", help="Controlled acceptance lengths, comma-separated.")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cost-repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench-heads-controlled"))
    parser.add_argument("--openblas", action="store_true", help="Linux CPU: OpenBLAS (1 thread) for float32 matmuls.")
    args = parser.parse_args()

    summary = {}
    print("ENGINE MEASUREMENT per head at controlled acceptance (not model acceptance); efficiency = measured / ideal")
    for i, head in enumerate(args.head):
        results = run_head(args.model, head, args.out / f"head{i}", args)
        summary[head] = {**results["controlled"], "cost_curve": results["cost_curve"]} if "controlled" in results else results
        print("\n".join(head_lines(head, results)), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
