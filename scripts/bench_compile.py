"""Issue 20, less host work: does `mx.compile` of the draft's sequential part (Markov steps, argmax,
token probabilities, confidence head) or of greedy acceptance make a round cheaper here?

    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/bench_compile.py --pair DIR

Times (median of --repeats, variants interleaved in one process) one draft block at a fixed context,
split as the round pays for it: block forward + LM head (not compiled: its context length changes
with every round until the window fills), then the sequential drafting, eager vs compiled; and
greedy acceptance over an 8-token verify's logits, eager vs compiled. Both compiled functions are
checked to give the eager results exactly before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_dspark  # noqa: E402
from mlx_dspark.bench.cost import CostProbe  # noqa: E402
from mlx_dspark.bench.stats import loadavg, median  # noqa: E402
from mlx_dspark.engine.round.accept import accept_greedy  # noqa: E402
from mlx_dspark.models.heads.dspark.markov import draft_tokens  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", required=True)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    pair = mlx_dspark.load(args.pair + "/target", args.pair + "/draft")
    draft, target = pair.draft, pair.target
    probe = CostProbe(pair, context=args.context)
    ctx = probe.proposer.context

    def drafting(anchor, hidden, base):
        p = draft_tokens(
            anchor, hidden, base, markov_head=getattr(draft, "markov_head", None),
            confidence_head=getattr(draft, "confidence_head", None),
            confidence_with_markov=draft.args.confidence_head_with_markov, greedy=True, temperature=1.0,
        )  # fmt: skip
        return [x for x in (p.tokens, p.token_probs, p.confidence) if x is not None]

    def accepting(tokens, logits):
        a = accept_greedy(draft_tokens=tokens, target_logits=logits)
        return a.accepted, a.tokens

    compiled_drafting, compiled_accepting = mx.compile(drafting), mx.compile(accepting)
    hidden = draft.block_hidden(probe.anchor, ctx, target=target)
    base = target.lm_head_logits(hidden).astype(mx.float32)
    mx.eval(hidden, base)
    logits = mx.random.normal((8, target.args.vocab_size))
    tokens = mx.argmax(logits[:7], axis=-1).astype(mx.int32)
    for eager, comp in ((drafting(probe.anchor, hidden, base), compiled_drafting(probe.anchor, hidden, base)),
                        (accepting(tokens, logits), compiled_accepting(tokens, logits))):
        for a, b in zip(eager, comp):
            assert mx.array_equal(a, b).item(), "compiled result differs from eager"

    def forward():
        h = draft.block_hidden(probe.anchor, ctx, target=target)
        return h, target.lm_head_logits(h).astype(mx.float32)

    def timed(fn):
        start = time.perf_counter()
        mx.eval(fn())
        return 1000 * (time.perf_counter() - start)

    variants = {
        "block forward + LM head": forward,
        "drafting, eager": lambda: drafting(probe.anchor, hidden, base),
        "drafting, compiled": lambda: compiled_drafting(probe.anchor, hidden, base),
        "acceptance, eager": lambda: accepting(tokens, logits),
        "acceptance, compiled": lambda: compiled_accepting(tokens, logits),
    }
    samples = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(args.repeats + 2):
        order = names[repeat % len(names):] + names[: repeat % len(names)]
        for name in order:
            ms = timed(variants[name])
            if repeat >= 2:
                samples[name].append(ms)
    report = {name: round(median(s), 3) for name, s in samples.items()}
    for name, ms in report.items():
        print(f"{name:26s} {ms:8.3f} ms", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"context": args.context, "repeats": args.repeats, "ms": report, "loadavg": loadavg()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
