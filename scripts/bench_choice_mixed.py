"""The round's choice between proposals against each one alone, on a mixed workload of real heads (issue 35.4).

    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/bench_choice_mixed.py \\
        --eagle3 /tmp/bench/demo-eagle3 [--repeats 3] [--out benchmarks/results/issue35-choice-mixed.json]

The demo pair's target with its trained DSpark draft (mlx_dspark/demo/draft) and a trained EAGLE-3 head
(`scripts/train_demo_eagle3.py`), prompt lookup beside them. Workloads (raw text: the demo target is a
Python model): `prose` (an English module docstring), `new_code` (prefixes of held-out stdlib files: code
the prompt does not hold), `code_reemission` (benchmarks/workloads `rename`: a file written out again) and
`json` (benchmarks/workloads `json_record`: a JSON object under its schema). Settings, greedy, every
default else (auto length, its cost curves measured in a fresh cost cache: what a new user gets):
plain; `dspark` / `eagle3` (each head alone, lookup off); `lookup` (no draft, `--draft lookup`);
`dspark+lookup` / `eagle3+lookup` (one draft and lookup, the default); `choice` (`--draft DSPARK,EAGLE3` with lookup on: every
proposal, each round the one that pays). Each repeat runs every setting on every workload, the settings'
order rotated per repeat. Every setting's tokens must equal plain decoding's (checked). Printed per workload
and over the whole mix: target forwards per token, decode tok/s (median over repeats), speed over plain, and
the rounds each head of `choice` proposed; and each head's cost curve.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SETTINGS = ("plain", "dspark", "eagle3", "lookup", "dspark+lookup", "eagle3+lookup", "choice")
PROSE = '''"""Helpers for reading and writing configuration files.

This module reads the settings of an application from a file, checks that every value has the type
the application expects, and writes the settings back when they change. A value that cannot be read
is reported with the name of the file and the line it came from, so that the user can fix it. The
'''


def workloads(tokenizer) -> dict[str, dict]:
    from bench_lookup import WORKLOADS, workload_requests
    from train_demo_pair import corpus_files, read

    specs = json.loads((WORKLOADS / "workloads.json").read_text())
    held_out = corpus_files()[1]
    code = [tokenizer.decode(tokenizer.encode(read(p), add_special_tokens=False)[:160]) for p in held_out[3:5]]
    return {
        "prose": dict(prompt=PROSE, max_tokens=96),
        "new_code_1": dict(prompt=code[0], max_tokens=96),
        "new_code_2": dict(prompt=code[1], max_tokens=96),
        "code_reemission": {**workload_requests("rename", specs["rename"], tokenizer), "max_tokens": 192},
        "json": {**workload_requests("json_record", specs["json_record"], tokenizer), "max_tokens": specs["json_record"]["max_tokens"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eagle3", type=Path, required=True, help="an EAGLE-3 draft for the demo target")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ["MLX_DSPARK_COST_DIR"] = tempfile.mkdtemp(prefix="choice-cost-")  # a new user's curves

    from mlx_dspark import load
    from mlx_dspark.api import generate
    from mlx_dspark.cli.demo import demo_pair
    from mlx_dspark.engine.costs import probe as cost_probe
    from mlx_dspark.engine.policy import head_choice
    from mlx_dspark.engine.round import request as steps

    chosen: list = []

    class CountedChoice(head_choice.HeadChoice):  # the rounds each head proposed (benchmark instrumentation)
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            chosen.append(self.chosen)

    steps.HeadChoice = CountedChoice
    demo = demo_pair()
    pairs = {
        "target": load(demo.target, dtype=demo.dtype),
        "dspark": load(demo.target, draft=demo.draft, dtype=demo.dtype),
        "eagle3": load(demo.target, draft=str(args.eagle3), dtype=demo.dtype),
        "choice": load(demo.target, draft=f"{demo.draft},{args.eagle3}", dtype=demo.dtype),
    }
    setting_pair = {"plain": ("target", dict(speculative=False)), "dspark": ("dspark", dict(lookup="off")),
                    "eagle3": ("eagle3", dict(lookup="off")), "lookup": ("target", dict(lookup="only")),
                    "dspark+lookup": ("dspark", dict(lookup="on")), "eagle3+lookup": ("eagle3", dict(lookup="on")),
                    "choice": ("choice", dict(lookup="on"))}  # fmt: skip
    loads = [os.getloadavg()[0]]
    work = workloads(pairs["target"].tokenizer)
    runs = {w: {s: [] for s in SETTINGS} for w in work}
    heads = {w: {} for w in work}
    for name, request in work.items():  # warm-up: every setting once (measures each head's cost curve)
        for setting in SETTINGS:
            pair, extra = setting_pair[setting]
            generate(pairs[pair], **{**request, **extra, "temperature": 0.0, "max_tokens": 8})
    for repeat in range(args.repeats):
        order = SETTINGS[repeat % len(SETTINGS):] + SETTINGS[: repeat % len(SETTINGS)]
        for name, request in work.items():
            for setting in order:
                pair, extra = setting_pair[setting]
                chosen.clear()
                started = time.perf_counter()
                result = generate(pairs[pair], **{**request, **extra, "temperature": 0.0})
                wall = time.perf_counter() - started
                runs[name][setting].append({"tokens": result.tokens, "forwards": result.target_forwards,
                                            "tps": result.generation_tps, "wall": wall})  # fmt: skip
                if setting == "choice" and chosen:
                    for head, n in chosen[-1].items():
                        heads[name][head] = heads[name].get(head, 0) + n
        loads.append(os.getloadavg()[0])
    curves = {}
    for head in cost_probe.loaded_heads(pairs["choice"]):
        curve = cost_probe.cost_curve_for(pairs["choice"], head=head)
        curves[head] = {"draft_ms": round(curve.draft_ms, 2), "draft_step_ms": round(getattr(curve, "draft_step_ms", 0.0), 3),
                        "verify_ms": [round(v, 2) for v in curve.verify_ms[:9]]}  # fmt: skip
    report = {"loadavg_1min": loads, "cost_curves": curves, "workloads": {}}
    print(f"loadavg (1 min) per repeat: {' '.join(f'{x:.1f}' for x in loads)}")
    for head, curve in curves.items():
        print(f"cost curve, head {head}: draft {curve['draft_ms']} ms + {curve['draft_step_ms']} ms per draft; verify 1..9: {curve['verify_ms']}")
    totals = {s: [0, 0, 0.0] for s in SETTINGS}  # tokens, forwards, wall seconds
    print(f"\n{'workload':<16} " + " ".join(f"{s:>22}" for s in SETTINGS) + "   (forwards/token, tok/s)")
    for name in work:
        plain = runs[name]["plain"][0]["tokens"]
        row, entry = [], {}
        for setting in SETTINGS:
            done = runs[name][setting]
            if any(r["tokens"] != plain for r in done):
                raise SystemExit(f"{name}: {setting} wrote other tokens than plain decoding")
            fpt = statistics.mean(r["forwards"] for r in done) / len(plain)
            tps = statistics.median(r["tps"] for r in done)
            entry[setting] = {"forwards_per_token": round(fpt, 3), "tps_median": round(tps, 1),
                              "tps_all": [round(r["tps"], 1) for r in done]}  # fmt: skip
            totals[setting][0] += len(plain) * len(done)
            totals[setting][1] += sum(r["forwards"] for r in done)
            totals[setting][2] += sum(r["wall"] for r in done)
            row.append(f"{fpt:>10.3f} {tps:>10.1f} ")
        entry["choice_heads"] = heads[name]
        report["workloads"][name] = entry
        print(f"{name:<16} " + " ".join(row) + f"  choice: {heads[name]}")
    plain_rate = totals["plain"][0] / totals["plain"][2]
    print("\nwhole mix (every repeat): forwards per token / tokens per second of wall time / x plain")
    report["mix"] = {}
    for setting in SETTINGS:
        tokens, forwards, wall = totals[setting]
        rate = tokens / wall
        report["mix"][setting] = {"forwards_per_token": round(forwards / tokens, 3), "tokens_per_s": round(rate, 1),
                                  "x_plain": round(rate / plain_rate, 3)}  # fmt: skip
        print(f"  {setting:<14} {forwards / tokens:.3f}  {rate:7.1f}  x{rate / plain_rate:.2f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
