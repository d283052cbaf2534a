"""Fixed vs confidence-scheduled verification with the trained demo pair's real (calibrated) confidences.

The demo pair is the only pair here whose draft predicts its target, so its confidences are real; its
cost curve is this machine's, measured by `cost_probe.cost_curve_for` at first use. Runs are interleaved
(fixed, confidence) per prompt and repeat; medians. Greedy output must be identical in both.

    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/bench_schedule_demo.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
from pathlib import Path

import mlx_dspark
from mlx_dspark.cli.common import demo_pair
from mlx_dspark.engine.costs.probe import cost_curve_for


def held_out_prompts(count: int, chars: int) -> list[str]:
    # The demo's held-out files are the last of the sorted stdlib list; any stdlib source reads alike.
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[-count:]
    return [f.read_text(encoding="utf-8", errors="replace")[:chars] for f in files]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    demo = demo_pair()
    pair = mlx_dspark.load(str(demo.target), draft=str(demo.draft), dtype=demo.dtype)
    curve = cost_curve_for(pair)
    rows = {"fixed": [], "confidence": []}
    identical = 0
    for prompt in held_out_prompts(args.prompts, 600):
        outputs = {}
        for _ in range(args.repeats):
            for schedule in ("fixed", "confidence"):
                res = mlx_dspark.generate(pair, prompt, max_tokens=args.max_tokens, verify_schedule=schedule,
                                          cost_curve=curve if schedule == "confidence" else None)
                rows[schedule].append({"tps": res.generation_tps, "tau": res.mean_acceptance_length,
                                       "proposed": sum(res.proposal_lengths) / max(1, res.rounds)})
                outputs[schedule] = res.tokens
        identical += outputs["fixed"] == outputs["confidence"]
    summary = {
        s: {k: statistics.median(r[k] for r in rows[s]) for k in ("tps", "tau", "proposed")} for s in rows
    }
    summary["confidence_over_fixed_tps"] = summary["confidence"]["tps"] / summary["fixed"]["tps"]
    summary["identical_greedy_outputs"] = f"{identical}/{args.prompts}"
    summary["cost_curve"] = {"source": curve.source, "draft_ms": curve.draft_ms, "verify_ms": list(curve.verify_ms)}
    summary["loadavg"] = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    args.out.write_text(json.dumps({"summary": summary, "runs": rows}, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
