"""Ours against mlx-lm's own speculative decoding on the same target and draft model, interleaved in one process
(issue 51.4).

Settings, each greedy over the same prompt ids, end-of-sequence ignored:
- `plain`: mlx-lm's own plain loop (`mlx_lm.generate.generate_step`) on mlx-lm's model of the target;
- `mlx-lm k=K`: `mlx_lm.generate.speculative_generate_step` with `num_draft_tokens=K`, its default 2 and each
  `--sweep` length (the best of them is named in the summary);
- `ours DRAFT`: `mlx_dspark.load(target, draft=DRAFT)` with our default options (`auto` length, lookup on), for
  each `--ours` (default the `--draft` path; `self` compares self-speculation too), and with `--lookup-off` each
  of those with lookup="off" as well (the draft alone).

Printed per setting: min / median / max tok/s over `--repeats` times each `--prompt` (whole call, prefill
included; one untimed warm-up each; the settings' order rotates from run to run), the ratio to plain, target
forwards per generated token (mlx-lm's counted by a wrapper around its model's `__call__`, prefill chunks included;
ours the engine's own count: the prefill's last forward, then one per verify or step), and whether the tokens are plain decoding's (greedy: they must be; the first differing
position otherwise). Beside it: each of our heads' cost curve on this machine (what its `auto` length reads:
verify forwards by width, the draft's first and further chained steps) and /proc/loadavg.

    python scripts/bench_vs_mlx_lm.py --model TARGET --draft SMALL_LM [--ours self] --max-tokens 256 --repeats 5
    python scripts/bench_vs_mlx_lm.py --openblas --model /tmp/lmpair/target --draft /tmp/lmpair/draft --lookup-off \
        --sweep 1,3,4,5,6 --prompt "..." --prompt "..." --max-tokens 128 --repeats 3   # scripts/make_lm_draft_pair.py
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


def ours_setting(loaded: Any, ids: list[int], *, max_tokens: int, **options: Any) -> Callable[[], dict]:
    import mlx_dspark

    def run() -> dict:
        start = time.perf_counter()
        result = mlx_dspark.generate(loaded, ids, max_tokens=max_tokens, **options)
        return {"tokens": result.tokens, "seconds": time.perf_counter() - start, "forwards": result.target_forwards,
                "acceptance_lengths": result.acceptance_lengths, "proposal_lengths": result.proposal_lengths}  # fmt: skip

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


def spread(values: list[float]) -> str:
    return f"{min(values):6.1f} {statistics.median(values):6.1f} {max(values):6.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="target checkpoint directory (mlx-lm loads it too)")
    parser.add_argument("--draft", required=True, help="small causal LM of the target's vocabulary (mlx-lm's --draft-model)")
    parser.add_argument("--ours", action="append", help="draft= for our load (repeatable; default the --draft path; e.g. self)")
    parser.add_argument("--lookup-off", action="store_true", help="also run each of ours with lookup='off' (the draft alone)")
    parser.add_argument("--prompt", action="append", default=None, help="raw prompt text (repeatable; default: the demo pair's)")
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
    from mlx_dspark.engine.round.results import length_histogram

    target, tokenizer = load_mlx_lm(args.model, args.dtype)
    draft, draft_tokenizer = load_mlx_lm(args.draft, args.dtype)
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        sys.exit(f"error: the draft's vocabulary ({draft_tokenizer.vocab_size}) is not the target's ({tokenizer.vocab_size})")
    prompts = [list(tokenizer.encode(p)) for p in (args.prompt or [DEMO_PROMPT])]
    lengths = [2] + [k for k in (int(x) for x in args.sweep.split(",") if x.strip()) if k != 2]
    # settings[name][p]: one run of that setting on prompt p
    settings: dict[str, list[Callable[[], dict]]] = {
        "plain (mlx-lm)": [mlx_lm_setting(target, None, ids, max_tokens=args.max_tokens, num_draft=None) for ids in prompts]}  # fmt: skip
    for k in lengths:
        settings[f"mlx-lm k={k}"] = [mlx_lm_setting(target, draft, ids, max_tokens=args.max_tokens, num_draft=k) for ids in prompts]
    ours: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name in args.ours or [args.draft]:
        loaded, why = load_ours(args.model, name, args.dtype)
        if loaded is None:
            skipped[f"ours {name}"] = why
            continue
        ours[name] = loaded
        settings[f"ours {name}"] = [ours_setting(loaded, ids, max_tokens=args.max_tokens) for ids in prompts]
        if args.lookup_off:
            settings[f"ours {name}, lookup off"] = [ours_setting(loaded, ids, max_tokens=args.max_tokens, lookup="off") for ids in prompts]

    print(f"target {args.model}, draft {args.draft}, {len(prompts)} prompt(s) of {[len(i) for i in prompts]} tokens, "
          f"{args.max_tokens} new, dtype {args.dtype}, {args.repeats} repeats, loadavg {loadavg()}")  # fmt: skip
    for name, loaded in ours.items():  # measured before any timing, not inside it
        print(f"cost curve, ours {name}:\n{cost_text(loaded)}")
    runs: dict[str, list[list[dict]]] = {name: [[] for _ in prompts] for name in settings}
    names = list(settings)
    for name in names:  # warm-up: kernels, allocator, first-use measurements
        settings[name][0]()
    for repeat in range(args.repeats):
        for p in range(len(prompts)):
            rotation = (repeat * len(prompts) + p) % len(names)
            for name in names[rotation:] + names[:rotation]:
                runs[name][p].append(settings[name][p]())
        print(f"  repeat {repeat + 1}/{args.repeats} done, loadavg {loadavg()}", flush=True)

    references = [runs["plain (mlx-lm)"][p][0]["tokens"] for p in range(len(prompts))]
    tok_s = {name: [len(r["tokens"]) / r["seconds"] for per_prompt in runs[name] for r in per_prompt] for name in names}
    plain_tps = statistics.median(tok_s["plain (mlx-lm)"])
    rows = {}
    print(f"\n{'setting':<40} {'tok/s min   med    max':>22} {'vs plain':>9} {'fwd/token':>10} {'identical':>10}  notes")
    for name in names:
        tps = statistics.median(tok_s[name])
        every = [(p, r) for p in range(len(prompts)) for r in runs[name][p]]
        differs = [(p, first_difference(references[p], r["tokens"])) for p, r in every]
        same = all(d is None for _, d in differs)
        notes = "" if same else "first difference: prompt {}, position {}; ".format(*next((p, d) for p, d in differs if d is not None))
        forwards = sum(r["forwards"] for _, r in every) / sum(len(r["tokens"]) for _, r in every)
        if "acceptance_lengths" in every[0][1]:
            last = [runs[name][p][-1] for p in range(len(prompts))]
            accepted = [a for r in last for a in r["acceptance_lengths"]]
            lengths_seen = length_histogram([n for r in last for n in r["proposal_lengths"]])
            notes += f"mean acceptance {sum(accepted) / max(1, len(accepted)):.2f}, drafts per round {lengths_seen}"
        rows[name] = {"tok_s": tps, "tok_s_min": min(tok_s[name]), "tok_s_max": max(tok_s[name]), "tok_s_all": tok_s[name],
                      "vs_plain": tps / plain_tps, "forwards_per_token": forwards, "identical": same, "notes": notes}  # fmt: skip
        print(f"{name:<40} {spread(tok_s[name]):>22} {tps / plain_tps:8.2f}x {forwards:10.3f} {str(same):>10}  {notes}")
    for name, why in skipped.items():
        print(f"{name:<40} not run: {why}")
    spec = {n: r for n, r in rows.items() if n.startswith("mlx-lm")}
    best = max(spec, key=lambda n: spec[n]["tok_s"])
    print(f"\nmlx-lm default (k=2): {spec['mlx-lm k=2']['tok_s']:.1f} tok/s; its best fixed length here: {best} ({spec[best]['tok_s']:.1f} tok/s)")
    for name in (n for n in rows if n.startswith("ours")):
        print(f"{name}: {rows[name]['tok_s'] / spec['mlx-lm k=2']['tok_s']:.2f}x mlx-lm's default, "
              f"{rows[name]['tok_s'] / spec[best]['tok_s']:.2f}x its best")  # fmt: skip
    print(f"loadavg {loadavg()}")
    if args.json is not None:
        curves = {name: cost_text(loaded) for name, loaded in ours.items()}
        args.json.write_text(json.dumps({"rows": rows, "skipped": skipped, "loadavg": loadavg(), "cost_curves": curves,
                                         "args": vars(args)}, default=str, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
