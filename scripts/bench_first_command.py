"""The README's first command as a new user runs it: a fresh clone, a fresh cost cache per run, several runs.

Runs `python -m mlx_dspark.generate [FLAGS]` (the demo pair, 256 tokens) from a fresh `git clone` of this
repository, each run with its own empty cost cache (`MLX_DSPARK_COST_DIR`), the settings interleaved run by
run so the machine's load falls on all of them alike, and prints each setting's target forwards and tok/s
(min / median / max) with the load average. The settings are named on the command line, `--` separating
their flags; the default compares the first command with `--lookup off`:

    python scripts/bench_first_command.py --runs 10
    python scripts/bench_first_command.py --runs 5 --setting "chain=--lookup off --max-draft-tokens 7" \\
        --setting "tree15=--lookup off --max-draft-tokens 7 --tree-nodes 15"

The venv is this one's (the clone is put first on PYTHONPATH): the clone stands for the new user's files,
the installed dependencies are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(clone: Path, flags: list[str]) -> dict:
    """One run of the first command in `clone` with a fresh cost cache: its JSON summary and the load."""
    with tempfile.TemporaryDirectory() as costs:
        env = {**os.environ, "MLX_DSPARK_COST_DIR": costs, "PYTHONPATH": str(clone)}
        out = subprocess.run([sys.executable, "-m", "mlx_dspark.generate", "--json", *flags], cwd=clone, env=env,
                             capture_output=True, text=True, check=True)  # fmt: skip
    result = json.loads(out.stdout)
    result["loadavg"] = os.getloadavg()[0]
    return result


def spread(values: list[float]) -> str:
    return f"{min(values):.0f} / {statistics.median(values):.0f} / {max(values):.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--setting", action="append", default=[], help="NAME=FLAGS (repeatable)")
    parser.add_argument("--rev", default="HEAD", help="the revision cloned")
    args = parser.parse_args()
    settings = dict(s.split("=", 1) for s in args.setting) or {"first command": "", "--lookup off": "--lookup off"}
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", args.rev], cwd=clone, check=True)
        results: dict[str, list[dict]] = {name: [] for name in settings}
        outputs: dict[str, set] = {name: set() for name in settings}
        for run in range(args.runs):
            for name, flags in settings.items():
                result = run_once(clone, shlex.split(flags))
                results[name].append(result)
                outputs[name].add(tuple(result["tokens"]))
                print(f"run {run + 1} {name}: {result['target_forwards']} forwards, {result['generation_tps']:.0f} tok/s, "
                      f"load {result['loadavg']:.1f}", flush=True)  # fmt: skip
    print(f"\n{args.runs} runs each, fresh clone of {args.rev}, fresh cost cache per run; min / median / max")
    for name, rows in results.items():
        forwards = [r["target_forwards"] for r in rows]
        tps = [r["generation_tps"] for r in rows]
        loads = [r["loadavg"] for r in rows]
        print(f"{name:>16}: forwards {spread(forwards)}, tok/s {spread(tps)}, load {min(loads):.1f}-{max(loads):.1f}, "
              f"outputs {'all identical' if len(outputs[name]) == 1 else f'{len(outputs[name])} different'}")  # fmt: skip
    every = {o for name in outputs for o in outputs[name]}
    print(f"all settings' outputs identical: {'yes' if len(every) == 1 else 'no'}")


if __name__ == "__main__":
    main()
