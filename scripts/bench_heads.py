"""The round's choice between draft heads against each head alone, on a workload whose segments favour
one head or the other (issue 35.4), at controlled acceptance.

Random-weight heads accept nothing, so acceptance is controlled as in `bench/controlled.py`: every head
runs its real forward each time it proposes (its cost is paid), then its tokens are replaced by the
target's greedy continuation with errors at a rate that depends on the head and on the workload segment
(segments of `--segment` tokens alternate between two kinds: "prose-like", where the block draft is
right at `--good` per position and the chain at `--bad`, and "code-like", the other way round). The
heads: the pair's DSpark block draft and an EAGLE-3 chain built at the target's size (random weights,
written once), each with its own measured cost curve (block: one forward; chain: `draft_step_ms` per
draft), each with the default `auto` length policy. Settings run interleaved: plain, block alone, chain
alone, the choice; printed: forwards per token, tok/s and speed over plain, the rounds each head took.

    python scripts/bench_heads.py --model /tmp/bench/scaled/target --draft /tmp/bench/scaled/draft --openblas
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _reexec_with_openblas() -> None:
    if os.environ.get("LD_PRELOAD", "").find("openblas") < 0:
        env = {**os.environ, "LD_PRELOAD": "libopenblas.so.0", "OPENBLAS_NUM_THREADS": "1"}
        os.execvpe(sys.executable, [sys.executable, *sys.argv], env)


class SegmentControlled:
    """A head whose real forward runs, its tokens replaced by the reference with errors at a rate set by
    the head and the segment of the position (decided before the draft is read: a deterministic rng)."""

    def __init__(self, inner: Any, reference: list[int], *, prompt_len: int, vocab: int, rates: tuple[float, float],
                 segment: int, seed: int) -> None:
        self.inner, self.reference, self.prompt_len, self.vocab = inner, reference, prompt_len, vocab
        self.rates, self.segment, self.seed = rates, segment, seed

    def __getattr__(self, name: str) -> Any:  # tap_ids, block_size, extend, commit, flush, ...
        return getattr(self.inner, name)

    def propose(self, anchor, *, position: int, num_tokens: int, logits_hook=None):
        import mlx.core as mx

        from mlx_dspark.engine.proposers.base import Proposal

        real = self.inner.propose(anchor, position=position, num_tokens=num_tokens)
        start = position - self.prompt_len + 1
        rate = self.rates[(start // self.segment) % 2]
        rng = random.Random(self.seed * 1_000_003 + position)
        tokens = list(self.reference[start : start + num_tokens]) + [0] * num_tokens
        tokens = tokens[:num_tokens]
        for k in range(num_tokens):
            if rng.random() > rate:
                tokens[k] = (tokens[k] + 1) % self.vocab
                break
        controlled = mx.array([tokens], dtype=mx.int32) + 0 * real.tokens[:, :num_tokens].astype(mx.int32)
        return Proposal(tokens=controlled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft", required=True, help="a DSpark draft of the target (the block head)")
    parser.add_argument("--eagle3", default=None, help="an EAGLE-3 draft dir (default: written next to --draft, random)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--segment", type=int, default=32)
    parser.add_argument("--good", type=float, default=0.9)
    parser.add_argument("--bad", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--openblas", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.openblas:
        _reexec_with_openblas()

    import mlx.core as mx

    import mlx_dspark
    from mlx_dspark.engine.costs.probe import measure_chain_curve, measure_cost_curve
    from mlx_dspark.engine.round.decode import plain_steps, speculative_steps
    from mlx_dspark.engine.policy.draft_length import AutoLength
    from mlx_dspark.engine.proposers.eagle3 import Eagle3Proposer
    from mlx_dspark.engine.policy.head_choice import HeadChoice
    from mlx_dspark.engine.proposers.dspark import DraftProposer
    from mlx_dspark.engine.logits.sample import Sampler
    from mlx_dspark.testing.eagle3_tiny import write_eagle3_draft

    eagle_dir = Path(args.eagle3 or Path(args.draft).parent / "eagle3")
    if not (eagle_dir / "config.json").is_file():
        write_eagle3_draft(eagle_dir, target_path=args.model, seed=5, include_embedding=False, speculative_tokens=4)
    pair = mlx_dspark.load(args.model, draft=args.draft)
    eagle = mlx_dspark.load(args.model, draft=str(eagle_dir)).heads["eagle3"]
    target, vocab = pair.target, pair.target.args.vocab_size
    prompt = [(7 + 31 * i) % vocab for i in range(256)]
    reference = []
    for step in plain_steps(target, prompt, sampler=Sampler()):
        reference.extend(step.tokens)
        if len(reference) >= args.tokens + 16:
            break

    block_curve = measure_cost_curve(target, pair.draft, deep_context=None)
    chain_curve = measure_chain_curve(target, eagle, head="eagle3")
    print(f"curves (context {block_curve.context}): verify 1..8 = {[round(v, 1) for v in block_curve.verify_ms]} ms; "
          f"block head draft {block_curve.draft_ms:.1f} ms; chain head {chain_curve.draft_ms:.1f} ms + {chain_curve.draft_step_ms:.1f} ms per draft",
          flush=True)  # fmt: skip

    def heads() -> dict:
        block = DraftProposer(pair.draft, target, greedy=True, temperature=1.0)
        chain = Eagle3Proposer(eagle, target, prompt=prompt, greedy=True, temperature=1.0, block_size=4)
        return {"block": SegmentControlled(block, reference, prompt_len=len(prompt), vocab=vocab, rates=(args.good, args.bad), segment=args.segment, seed=1),
                "chain": SegmentControlled(chain, reference, prompt_len=len(prompt), vocab=vocab, rates=(args.bad, args.good), segment=args.segment, seed=2)}  # fmt: skip

    curves = {"block": block_curve, "chain": chain_curve}

    def run(setting: str) -> dict:
        start, forwards, tokens, chosen = time.perf_counter(), 0, [], {}
        if setting == "plain":
            steps = plain_steps(target, prompt, sampler=Sampler())
        else:
            all_heads = heads()
            if setting == "choice":
                policies = {name: AutoLength(curves[name], int(h.block_size)) for name, h in all_heads.items()}
                proposer = policy = HeadChoice(all_heads, policies, curves)
            else:
                proposer = all_heads[setting]
                policy = AutoLength(curves[setting], int(proposer.block_size))
            steps = speculative_steps(target, proposer, prompt, sampler=Sampler(), draft_length=policy)
        first = None
        for step in steps:
            if first is None:
                first = time.perf_counter()
            tokens.extend(step.tokens)
            forwards += 1
            if len(tokens) >= args.tokens:
                break
        elapsed = time.perf_counter() - first
        if setting == "choice":
            chosen = dict(proposer.chosen)
        assert tokens[: args.tokens] == reference[: args.tokens], f"{setting}: not plain decoding's tokens"
        return {"tok_s": (len(tokens) - 1) / elapsed, "forwards_per_token": (forwards - 1) / (len(tokens) - 1), "chosen": chosen}

    settings = ["plain", "block", "chain", "choice"]
    results = {s: [] for s in settings}
    for repeat in range(args.repeats):
        for setting in settings[repeat % len(settings):] + settings[: repeat % len(settings)]:
            results[setting].append(run(setting))
            print(f"  {setting:6s} repeat {repeat + 1}: {results[setting][-1]}", flush=True)
    plain = statistics.median(r["tok_s"] for r in results["plain"])
    print(f"\n{args.tokens} tokens, segments of {args.segment} alternating (block head right at {args.good} / {args.bad} per "
          f"position, chain head the other way round), medians of {args.repeats} interleaved runs:")  # fmt: skip
    print(f"{'setting':8s} {'tok/s':>8s} {'x plain':>8s} {'fwd/token':>10s}  rounds per head")
    for s in settings:
        tps = statistics.median(r["tok_s"] for r in results[s])
        fpt = statistics.median(r["forwards_per_token"] for r in results[s])
        print(f"{s:8s} {tps:8.2f} {tps / plain:8.3f} {fpt:10.3f}  {results[s][-1]['chosen'] or ''}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "curves": {k: c.to_json() for k, c in curves.items()},
                                              "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
