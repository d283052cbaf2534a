"""Ours against mlx-lm's own speculative decoding on the same target and draft model, interleaved in one process
(issue 51.4).

Settings, each greedy over the same prompt ids, end-of-sequence ignored:
- `plain`: mlx-lm's own plain loop (`mlx_lm.generate.generate_step`) on mlx-lm's model of the target;
- `mlx-lm k=K`: `mlx_lm.generate.speculative_generate_step` with `num_draft_tokens=K`, its default 2 and each
  `--sweep` length (the best of them is named in the summary);
- `ours DRAFT`: `mlx_dspark.load(target, draft=DRAFT)` with our default options (`auto` length, lookup on), for
  each `--ours` (default the `--draft` path; `self` compares self-speculation too).

Printed per setting: median tok/s over `--repeats` (whole call, prefill included; one untimed warm-up
each), the ratio to plain, target forwards per generated token (mlx-lm's counted by a wrapper around its
model's `__call__`, prefill chunks included; ours the engine's own count: the prefill's last forward, then one
per verify or step), and whether the tokens are plain decoding's (greedy: they must be; the first differing
position otherwise). Beside it: each of our heads' cost curve on this machine (what its `auto` length reads:
verify forwards by width, the draft's first and further chained steps) and /proc/loadavg.

    python scripts/bench_vs_mlx_lm.py --model TARGET --draft SMALL_LM [--ours self] --max-tokens 256 --repeats 5
    python scripts/bench_vs_mlx_lm.py --model mlx_dspark/demo/target --draft mlx_dspark/demo/target --max-tokens 32 --repeats 1

`--openblas` re-executes under OpenBLAS (Linux only; ../shared/BENCHMARKING.md): float32 then runs in the
memory-bound regime speculative decoding lives in on a Mac. Without a draft our loader reads, `ours` says why
in its row and the rest still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable


def _reexec_with_openblas() -> None:
    if "openblas" not in os.environ.get("LD_PRELOAD", ""):
        env = {**os.environ, "LD_PRELOAD": "libopenblas.so.0", "OPENBLAS_NUM_THREADS": "1"}
        os.execvpe(sys.executable, [sys.executable, *sys.argv], env)


class CountedModel:
    """An mlx-lm model whose forwards are counted (its `__call__` through this wrapper; nothing replaced)."""

    def __init__(self, model: Any) -> None:
        self.model, self.forwards = model, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.forwards += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def load_mlx_lm(path: str, dtype: str | None) -> Any:
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = mlx_lm.load(path, tokenizer_config={"trust_remote_code": False})
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model, tokenizer


def mlx_lm_setting(target: Any, draft: Any | None, ids: list[int], *, max_tokens: int, num_draft: int | None) -> Callable[[], dict]:
    """One run of mlx-lm's plain loop (draft None) or its speculative loop with `num_draft` drafts."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    def run() -> dict:
        counted = CountedModel(target)
        prompt = mx.array(ids, dtype=mx.int32)
        sampler = make_sampler(temp=0.0)
        if draft is None:
            steps = generate_step(prompt, counted, max_tokens=max_tokens, sampler=sampler)
        else:
            steps = speculative_generate_step(prompt, counted, draft, num_draft_tokens=num_draft, max_tokens=max_tokens, sampler=sampler)
        start = time.perf_counter()
        tokens = [int(step[0]) for step in steps]
        return {"tokens": tokens, "seconds": time.perf_counter() - start, "forwards": counted.forwards}

    return run


def ours_setting(loaded: Any, ids: list[int], *, max_tokens: int) -> Callable[[], dict]:
    import mlx_dspark

    def run() -> dict:
        start = time.perf_counter()
        result = mlx_dspark.generate(loaded, ids, max_tokens=max_tokens)
        return {"tokens": result.tokens, "seconds": time.perf_counter() - start, "forwards": result.target_forwards,
                "acceptance": result.mean_acceptance_length, "draft_lengths": result.draft_lengths}  # fmt: skip

    return run


def load_ours(target: str, draft: str, dtype: str | None) -> tuple[Any, str | None]:
    """Our pair with default options (end-of-sequence ignored), or None and why it did not load."""
    import mlx_dspark
    from mlx_dspark.bench.runner import RunSettings, prepare_model

    try:
        return prepare_model(mlx_dspark.load(target, draft=draft, dtype=dtype), RunSettings(ignore_eos=True)), None
    except (ValueError, FileNotFoundError) as e:
        return None, str(e).splitlines()[0]


def cost_text(loaded: Any) -> str:
    """Each loaded head's cost curve on this machine (measured once and cached, as generation reads it)."""
    from mlx_dspark.engine.costs.probe import cost_curve_for
    from mlx_dspark.engine.proposers import loaded_heads

    lines = []
    for head in loaded_heads(loaded):
        curve = cost_curve_for(loaded, head=head)
        verify = ", ".join(f"L={w}: {ms:.2f}" for w, ms in enumerate(curve.verify_ms[:9], start=1))
        lines.append(f"  {head}: verify ms {verify} (L=9 / L=1 = {curve.verify_ms[min(8, len(curve.verify_ms) - 1)] / curve.verify_ms[0]:.2f}x); "
                     f"draft {curve.draft_ms:.2f} ms + {curve.draft_step_ms:.2f} ms per further draft; context {curve.context}; {curve.source}")  # fmt: skip
    return "\n".join(lines) or "  (no head loaded)"


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="target checkpoint directory (mlx-lm loads it too)")
    parser.add_argument("--draft", required=True, help="small causal LM of the target's vocabulary (mlx-lm's --draft-model)")
    parser.add_argument("--ours", action="append", help="draft= for our load (repeatable; default the --draft path; e.g. self)")
    parser.add_argument("--prompt", default=None, help="raw prompt text (default: the demo pair's)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", default="1,3,4,6,8", help="further mlx-lm num_draft_tokens to try besides its default 2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--openblas", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args()
    if args.openblas and sys.platform.startswith("linux"):
        _reexec_with_openblas()

    from mlx_dspark.bench.stats import loadavg
    from mlx_dspark.cli.demo import DEMO_PROMPT

    target, tokenizer = load_mlx_lm(args.model, args.dtype)
    draft, draft_tokenizer = load_mlx_lm(args.draft, args.dtype)
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        sys.exit(f"error: the draft's vocabulary ({draft_tokenizer.vocab_size}) is not the target's ({tokenizer.vocab_size})")
    ids = list(tokenizer.encode(args.prompt if args.prompt is not None else DEMO_PROMPT))
    lengths = [2] + [k for k in (int(x) for x in args.sweep.split(",") if x.strip()) if k != 2]
    settings: dict[str, Callable[[], dict]] = {"plain (mlx-lm)": mlx_lm_setting(target, None, ids, max_tokens=args.max_tokens, num_draft=None)}
    for k in lengths:
        settings[f"mlx-lm k={k}"] = mlx_lm_setting(target, draft, ids, max_tokens=args.max_tokens, num_draft=k)
    ours: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name in args.ours or [args.draft]:
        loaded, why = load_ours(args.model, name, args.dtype)
        if loaded is None:
            skipped[f"ours {name}"] = why
            continue
        ours[name] = loaded
        settings[f"ours {name}"] = ours_setting(loaded, ids, max_tokens=args.max_tokens)

    print(f"target {args.model}, draft {args.draft}, {len(ids)} prompt tokens, {args.max_tokens} new, dtype {args.dtype}, loadavg {loadavg()}")
    for name, loaded in ours.items():  # measured before any timing, not inside it
        print(f"cost curve, ours {name}:\n{cost_text(loaded)}")
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    names = list(settings)
    for name in names:  # warm-up: kernels, allocator, first-use measurements
        settings[name]()
    for repeat in range(args.repeats):
        rotation = repeat % len(names)
        for name in names[rotation:] + names[:rotation]:
            runs[name].append(settings[name]())

    reference = runs["plain (mlx-lm)"][0]["tokens"]
    plain_tps = statistics.median(len(r["tokens"]) / r["seconds"] for r in runs["plain (mlx-lm)"])
    rows = {}
    print(f"\n{'setting':<24} {'tok/s':>8} {'vs plain':>9} {'fwd/token':>10} {'identical':>10}  notes")
    for name in names:
        tps = statistics.median(len(r["tokens"]) / r["seconds"] for r in runs[name])
        last = runs[name][-1]
        differs = [first_difference(reference, r["tokens"]) for r in runs[name]]
        same = all(d is None for d in differs)
        notes = "" if same else f"first difference at {next(d for d in differs if d is not None)}"
        if "acceptance" in last:
            notes += f"mean acceptance {last['acceptance']:.2f}, draft lengths {last['draft_lengths']}"
        rows[name] = {"tok_s": tps, "vs_plain": tps / plain_tps, "forwards_per_token": last["forwards"] / len(last["tokens"]),
                      "identical": same, "notes": notes}  # fmt: skip
        print(f"{name:<24} {tps:8.1f} {tps / plain_tps:8.2f}x {rows[name]['forwards_per_token']:10.3f} {str(same):>10}  {notes}")
    for name, why in skipped.items():
        print(f"{name:<24} not run: {why}")
    spec = {n: r for n, r in rows.items() if n.startswith("mlx-lm")}
    best = max(spec, key=lambda n: spec[n]["tok_s"])
    print(f"\nmlx-lm default (k=2): {spec['mlx-lm k=2']['tok_s']:.1f} tok/s; its best fixed length here: {best} ({spec[best]['tok_s']:.1f} tok/s)")
    for name in (n for n in rows if n.startswith("ours")):
        print(f"{name}: {rows[name]['tok_s'] / spec['mlx-lm k=2']['tok_s']:.2f}x mlx-lm's default, "
              f"{rows[name]['tok_s'] / spec[best]['tok_s']:.2f}x its best")  # fmt: skip
    print(f"loadavg {loadavg()}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "skipped": skipped, "loadavg": loadavg(), "args": vars(args)}, default=str, indent=1))


if __name__ == "__main__":
    main()
