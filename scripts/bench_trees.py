"""Issue 37: chain vs tree rounds on the demo pair, at a controlled 60% / 85% top-1 / top-2 accuracy.

    python scripts/bench_trees.py [--tokens 192] [--repeats 3] [--out results.json]

Rows (interleaved per repeat; greedy; medians over repeats):
- plain: the target alone;
- chain-7: chain rounds of 7 drafts (verify width 8) from `bench/controlled_tree.RankedProposer` (right token at
  rank 1 at ~60% of positions, rank 2 at ~25%), behind the demo draft's real block forward (its cost paid);
- tree-7 (width 8, the chain's width), tree-15 (width 16), tree-31 (width 32): tree rounds of that many nodes
  from the same proposer's per-position distributions;
- tree-auto: `tree_nodes="auto"` (engine/tree_budget.AutoTree, at most 15 nodes) over this run's own cost curve
  of verify widths 1..16 (chain forwards with the draft's taps, measured first), from the same proposer;
- draft chain-7 / draft tree-7 / draft tree-15 / draft tree-auto: the demo draft's own proposals (its Markov
  head's conditional logits grow the tree), for what a trained draft does.
Every run's output must equal plain decoding. Printed beside: the cost curve (bench/cost.py: target forwards of
1..8 tokens, draft block, plain step), chain / tree verify forwards at widths 8, 16, 32, and what auto picked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_dspark  # noqa: E402
from mlx_dspark.bench.controlled_tree import RankedProposer  # noqa: E402
from mlx_dspark.bench.cost import format_cost_curve, measure_round_breakdown  # noqa: E402
from mlx_dspark.bench.stats import loadavg  # noqa: E402
from mlx_dspark.cli.common import demo_pair  # noqa: E402
from mlx_dspark.engine.round.decode import plain_steps, speculative_steps  # noqa: E402
from mlx_dspark.engine.options import SpeculationOptions  # noqa: E402
from mlx_dspark.engine.proposers.dspark import DraftProposer  # noqa: E402
from mlx_dspark.engine.logits.sample import Sampler  # noqa: E402
from mlx_dspark.engine.costs.curve import CostCurve  # noqa: E402
from mlx_dspark.engine.tree.grow import Tree  # noqa: E402
from mlx_dspark.engine.tree.budget import AutoTree  # noqa: E402
from mlx_dspark.engine.tree.rounds import tree_steps  # noqa: E402
from mlx_dspark.models.caches.kv import trim_caches  # noqa: E402
from mlx_dspark.models.target.tree_verify import keep_path, tree_target_forward  # noqa: E402

PROMPT_TEXT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"


def run(steps, tokens: int) -> dict:
    """Wall time of `tokens` committed tokens (after the prefill's), verify rounds and their accepted drafts."""
    out, rounds, accepted = [], 0, 0
    start = None
    for step in steps:
        if start is None:  # the clock starts after the prefill's token
            start = time.perf_counter()
        out.extend(step.tokens)
        rounds += step.verified
        accepted += step.accepted
        if len(out) >= tokens + 1:
            break
    ms = 1000 * (time.perf_counter() - start)
    return {"tokens": out[: tokens + 1], "ms_per_token": ms / tokens, "rounds": rounds, "accepted": accepted,
            "per_verify": (len(out) - 1) / max(1, rounds)}  # fmt: skip


def verify_ms(target, prompt: list[int], width: int, taps: tuple, repeats: int) -> dict:
    """Median ms of a chain forward and of a tree forward (a bushy two-level tree) of `width` rows, with the
    draft's taps, at the prompt's context; and of the tree forward with its commit (`keep_path`, one node kept)."""
    cache = target.make_cache()
    mx.eval(target(mx.array(prompt)[None], cache=cache)[0])
    nodes, half = width - 1, max(1, (width - 1) // 2)
    tree = Tree(tokens=[(7 * i) % 97 for i in range(nodes)], parents=[0 if i < half else 1 + i % half for i in range(nodes)],
                depths=[1 if i < half else 2 for i in range(nodes)], path_probs=[1.0] * nodes)  # fmt: skip
    tokens = mx.array([1, *tree.tokens], dtype=mx.int32)

    def chain() -> None:
        mx.eval(target(tokens[None], cache=cache, tap_ids=taps))
        trim_caches(cache, width)

    def tree_forward(commit: bool) -> None:
        out = tree_target_forward(target, tokens, cache, positions=tree.positions(len(prompt)), ancestors=tree.ancestors(), tap_ids=taps)
        mx.eval(out)
        if commit:
            keep_path(cache, width=width, rows=[1])
            mx.eval([c.keys for c in cache])
            trim_caches(cache, 2)
        else:
            trim_caches(cache, width)

    runs = {"chain": chain, "tree": lambda: tree_forward(False), "tree+commit": lambda: tree_forward(True)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(repeats + 1):
        for name, call in runs.items():
            start = time.perf_counter()
            call()
            if repeat:
                times[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in times.items()}


def chain_ms(target, prompt: list[int], max_width: int, taps: tuple, repeats: int) -> list[float]:
    """Median ms of a chain forward of 1..max_width tokens with the draft's taps at the prompt's context,
    the widths interleaved (a rotating order per repeat)."""
    cache = target.make_cache()
    mx.eval(target(mx.array(prompt)[None], cache=cache)[0])
    times: dict[int, list[float]] = {w: [] for w in range(1, max_width + 1)}
    for repeat in range(repeats + 1):
        order = list(times)[repeat % max_width:] + list(times)[: repeat % max_width]
        for width in order:
            start = time.perf_counter()
            mx.eval(target(mx.array([1] * width)[None], cache=cache, tap_ids=taps))
            trim_caches(cache, width)
            if repeat:
                times[width].append(1000 * (time.perf_counter() - start))
    return [statistics.median(times[w]) for w in times]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    demo = demo_pair()
    pair = mlx_dspark.load(str(demo.target), draft=str(demo.draft), dtype=demo.dtype)
    target, draft = pair.target, pair.draft
    prompt = pair.tokenizer.encode(PROMPT_TEXT)
    vocab = target.args.vocab_size
    reference = []
    for step in plain_steps(target, prompt, sampler=Sampler()):
        reference.extend(step.tokens)
        if len(reference) >= args.tokens + 8:
            break

    def ranked() -> RankedProposer:
        inner = DraftProposer(draft, target, greedy=True, temperature=1.0)
        return RankedProposer(reference, prompt_len=len(prompt), vocab_size=vocab, top1=0.6, top2=0.85, inner=inner)

    def own() -> DraftProposer:
        return DraftProposer(draft, target, greedy=True, temperature=1.0)

    # this run's costs first: auto sizes its rounds on them (widths 1..16, chain forwards with the draft's taps)
    taps = tuple(draft.args.target_layer_ids)
    context = prompt + reference[: args.tokens // 2]
    curve = measure_round_breakdown(pair, context=len(prompt) + args.tokens // 2, repeats=5)
    auto_curve = CostCurve.from_measurements(
        draft_ms=curve["draft_block_ms"], verify_ms=chain_ms(target, context, 16, taps, 5), source="bench_trees"
    )
    policies: dict[str, AutoTree] = {}

    def auto(name: str, proposer) -> object:
        policies[name] = AutoTree(auto_curve, 15)
        return tree_steps(target, proposer, prompt, num_nodes=15, max_depth=7, budget=policies[name])

    chain = SpeculationOptions(max_draft_tokens=7, lookup="off")
    modes = {
        "plain": lambda: plain_steps(target, prompt, sampler=Sampler()),
        "chain-7": lambda: speculative_steps(target, ranked(), prompt, sampler=Sampler(), speculation=chain),
        "tree-7": lambda: tree_steps(target, ranked(), prompt, num_nodes=7, max_depth=7),
        "tree-15": lambda: tree_steps(target, ranked(), prompt, num_nodes=15, max_depth=7),
        "tree-31": lambda: tree_steps(target, ranked(), prompt, num_nodes=31, max_depth=7),
        "tree-auto": lambda: auto("tree-auto", ranked()),
        "draft chain-7": lambda: speculative_steps(target, own(), prompt, sampler=Sampler(), speculation=chain),
        "draft tree-7": lambda: tree_steps(target, own(), prompt, num_nodes=7, max_depth=7),
        "draft tree-15": lambda: tree_steps(target, own(), prompt, num_nodes=15, max_depth=7),
        "draft tree-auto": lambda: auto("draft tree-auto", own()),
    }
    results: dict[str, list[dict]] = {name: [] for name in modes}
    for name, make in modes.items():  # one untimed warm-up each
        run(make(), 16)
    for repeat in range(args.repeats):
        order = list(modes)[repeat % len(modes):] + list(modes)[: repeat % len(modes)]
        for name in order:
            result = run(modes[name](), args.tokens)
            assert result["tokens"] == reference[: args.tokens + 1], f"{name}: output differs from plain decoding"
            results[name].append(result)

    plain_ms = statistics.median(r["ms_per_token"] for r in results["plain"])
    summary = {}
    print(f"demo pair, {args.tokens} tokens x {args.repeats} repeats, interleaved; loadavg {loadavg()} (shared, noisy machine)")
    print(f"{'mode':>14} {'tokens/verify':>14} {'ms/token':>9} {'speedup':>8} {'rounds':>7}")
    for name, rows in results.items():
        ms = statistics.median(r["ms_per_token"] for r in rows)
        per_verify = statistics.median(r["per_verify"] for r in rows)
        summary[name] = {"tokens_per_verify": per_verify, "ms_per_token": ms, "speedup": plain_ms / ms,
                         "rounds": rows[0]["rounds"]}  # fmt: skip
        shown = "-" if name == "plain" else f"{per_verify:.2f}"
        print(f"{name:>14} {shown:>14} {ms:9.3f} {plain_ms / ms:7.2f}x {rows[0]['rounds']:>7}")
    for name, policy in policies.items():
        print(f"  {name} (last run) picked: {dict(sorted(policy.choices.items()))}")
    print(format_cost_curve(curve))
    print("  auto's curve, chain forwards of widths 1..16 (ms): " + " ".join(f"{ms:.2f}" for ms in auto_curve.verify_ms))
    tree_ms = {w: verify_ms(target, context, w, taps, 7) for w in (8, 16, 32)}
    print("  verify forwards beside it (ms; chain = [anchor, drafts], tree = the same width as a tree):")
    for w, ms in tree_ms.items():
        print(f"    width {w:2d}: chain {ms['chain']:7.2f}  tree {ms['tree']:7.2f}  tree + commit {ms['tree+commit']:7.2f}")
    if args.out:
        args.out.write_text(json.dumps({
            "summary": summary, "cost_curve": curve, "tree_verify_ms": tree_ms, "auto_curve": auto_curve.to_json(),
            "auto_choices": {name: dict(policy.choices) for name, policy in policies.items()},
        }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
