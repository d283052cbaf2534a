"""Time to first token of a chat's second turn: resumed from the first turn's prompt cache vs cold.

    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/bench_prefix_cache.py \
        --model /tmp/bench/scaled/target --draft /tmp/bench/scaled/draft --out benchmarks/results/x.json

The conversation is built at the token level (the scaled pair's tokenizer is a tiny byte-level one):
turn 1 is a prompt of `--turn1-tokens` random ids; its reply is generated (`--reply-tokens`, greedy);
turn 2 is turn 1 + a history + a `--question-tokens` question, where the history is
- `extend`: the reply exactly as generated (the cache's live state serves all of it);
- `rerender`: the reply with its first token changed, as a chat template that re-renders the last
  assistant turn would send it (the cache resumes from its snapshot at turn 1's prompt end).
Each repeat runs turn 1 on a fresh prompt cache, then the warm turn 2 on that cache and the cold
turn 2 (no cache) in alternating order; medians over repeats, /proc/loadavg at start and end. Greedy
output of the warm and the cold turn 2 is checked to be token-identical.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import typer

# run from a checkout without installing the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

app = typer.Typer(add_completion=False)

CASES = ("extend", "rerender")


def turn_2_prompt(case: str, turn_1: list[int], reply: list[int], question: list[int], vocab: int) -> list[int]:
    if case == "extend":
        return turn_1 + reply + question
    changed = [(reply[0] + 1) % vocab] + reply[1:]
    return turn_1 + changed + question


@app.command()
def main(
    model: Path = typer.Option(..., "--model", help="target directory (the scaled pair's)"),
    draft: Optional[Path] = typer.Option(None, "--draft", help="DSpark draft directory (none: plain decoding)"),
    turn1_tokens: int = typer.Option(1400, "--turn1-tokens"),
    reply_tokens: int = typer.Option(32, "--reply-tokens"),
    question_tokens: int = typer.Option(24, "--question-tokens"),
    turn2_tokens: int = typer.Option(4, "--turn2-tokens", help="tokens generated in turn 2 (TTFT is the point)"),
    repeats: int = typer.Option(5, "--repeats"),
    seed: int = typer.Option(0, "--seed"),
    out: Optional[Path] = typer.Option(None, "--out", help="write the raw results here (JSON)"),
) -> None:
    import mlx.core as mx
    from importlib.metadata import version

    from mlx_dspark.api import generate, make_prompt_cache
    from mlx_dspark.bench.stats import loadavg
    from mlx_dspark.cli.benchmark import blas_setting
    from mlx_dspark.loading.load import load

    meta = {
        "command": " ".join(["python scripts/bench_prefix_cache.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "device": str(mx.default_device()),
        "mlx": version("mlx"),
        "blas": blas_setting(),
        "loadavg_start": loadavg(),
    }
    pair = load(model, draft=draft)
    vocab = pair.target.args.vocab_size
    rng = random.Random(seed)
    special = 400  # above the byte-level tokenizer's ids, so no eos or template token appears by chance
    turn_1 = [rng.randrange(special, vocab) for _ in range(turn1_tokens)]
    question = [rng.randrange(special, vocab) for _ in range(question_tokens)]
    options = {"speculative": draft is not None}

    # Warm-up: every path (cold prefill, a resume from live caches and from a snapshot) once.
    warm_cache = make_prompt_cache(pair)
    generate(pair, turn_1[:600], max_tokens=4, prompt_cache=warm_cache, **options)
    generate(pair, turn_1[:600] + question, max_tokens=2, prompt_cache=warm_cache, **options)
    del warm_cache

    rows: dict[str, list[dict]] = {case: [] for case in CASES}
    for r in range(repeats):
        for case in CASES:
            cache = make_prompt_cache(pair)
            first = generate(pair, turn_1, max_tokens=reply_tokens, prompt_cache=cache, **options)
            prompt = turn_2_prompt(case, turn_1, first.tokens, question, vocab)
            order = ("warm", "cold") if (r + CASES.index(case)) % 2 == 0 else ("cold", "warm")
            results = {}
            for kind in order:
                results[kind] = generate(
                    pair, prompt, max_tokens=turn2_tokens, prompt_cache=cache if kind == "warm" else None, **options
                )
            warm, cold = results["warm"], results["cold"]
            row = {
                "repeat": r,
                "order": list(order),
                "turn1_prompt_tokens": first.prompt_tokens,
                "turn1_ttft_s": first.time_to_first_token,
                "turn2_prompt_tokens": warm.prompt_tokens,
                "cached_tokens": warm.cached_tokens,
                "warm_ttft_s": warm.time_to_first_token,
                "cold_ttft_s": cold.time_to_first_token,
                "warm_prompt_tps": warm.prompt_tps,
                "cold_prompt_tps": cold.prompt_tps,
                "identical": warm.tokens == cold.tokens,
                "loadavg": loadavg(),
            }
            rows[case].append(row)
            typer.echo(
                f"[{case} {r}] turn 2: {row['turn2_prompt_tokens']} tokens, {row['cached_tokens']} cached | "
                f"TTFT warm {row['warm_ttft_s']:.3f} s, cold {row['cold_ttft_s']:.3f} s | identical {row['identical']}",
                err=True,
            )

    summary = {}
    for case, runs in rows.items():
        warm = statistics.median(r["warm_ttft_s"] for r in runs)
        cold = statistics.median(r["cold_ttft_s"] for r in runs)
        summary[case] = {
            "turn2_prompt_tokens": runs[0]["turn2_prompt_tokens"],
            "cached_tokens": runs[0]["cached_tokens"],
            "median_warm_ttft_s": warm,
            "median_cold_ttft_s": cold,
            "speedup": cold / warm,
            "median_turn1_ttft_s": statistics.median(r["turn1_ttft_s"] for r in runs),
            "all_identical": all(r["identical"] for r in runs),
        }
        typer.echo(
            f"{case}: turn 2 of {summary[case]['turn2_prompt_tokens']} tokens, {summary[case]['cached_tokens']} cached: "
            f"median TTFT warm {warm:.3f} s vs cold {cold:.3f} s ({cold / warm:.1f}x); "
            f"identical {summary[case]['all_identical']}"
        )
    meta["loadavg_end"] = loadavg()
    settings = {"turn1_tokens": turn1_tokens, "reply_tokens": reply_tokens, "question_tokens": question_tokens,
                "turn2_tokens": turn2_tokens, "repeats": repeats, "seed": seed, "speculative": draft is not None,
                "target": str(model), "draft": None if draft is None else str(draft)}  # fmt: skip
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "settings": settings, "summary": summary, "runs": rows}, indent=2) + "\n")
        typer.echo(f"wrote {out}")


if __name__ == "__main__":
    app()
