"""Where a speculative round's time goes, measured from outside the engine.

`profile_rounds` runs `decode.speculative_steps` unchanged, with the target and the proposer behind
thin timing proxies: they time the Python graph building of the verify forward, of the draft
proposal and of the draft-context append. The rest of each round (between two yields) is the one
evaluation (draft + verify compute, host read), acceptance graph, trims and loop bookkeeping;
comparing it with the compute-only time of a draft block plus a verify forward (timed separately,
graph building excluded) separates compute from overhead.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from mlx_dspark.engine.proposers.base import Proposer
from mlx_dspark.engine.round.decode import PREFILL_STEP_SIZE, speculative_steps
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.bench.stats import median

class _TimedTarget:
    def __init__(self, target: Any) -> None:
        self.target = target
        self.args = target.args
        self.build: list[float] = []

    def make_cache(self) -> list:
        return self.target.make_cache()

    def __call__(self, inputs, cache=None, *, tap_ids=(), last_only=False):
        start = time.perf_counter()
        out = self.target(inputs, cache=cache, tap_ids=tap_ids, last_only=last_only)
        self.build.append(time.perf_counter() - start)
        return out


class _TimedProposer(Proposer):
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.tap_ids = inner.tap_ids
        self.block_size = inner.block_size
        self.takes_target_cache = inner.takes_target_cache
        self.propose_build: list[float] = []
        self.extend_build: list[float] = []

    def extend(self, features) -> None:
        start = time.perf_counter()
        self.inner.extend(features)
        self.extend_build.append(time.perf_counter() - start)

    def commit(self, tokens) -> None:  # a chained head's cache pairs features with the committed tokens
        self.inner.commit(tokens)

    def propose(self, anchor, *, position: int, num_tokens: int, target_cache=None):
        extra = {} if target_cache is None else {"target_cache": target_cache}
        start = time.perf_counter()
        proposal = self.inner.propose(anchor, position=position, num_tokens=num_tokens, **extra)
        self.propose_build.append(time.perf_counter() - start)
        return proposal


def profile_rounds(target: Any, proposer: Any, prompt: Sequence[int], *, rounds: int, compute_ms: float) -> dict:
    """Median milliseconds per round of each part (JSON-ready); skips the prefill and the first round."""
    timed_target = _TimedTarget(target)
    timed_proposer = _TimedProposer(proposer)
    stamps: list[float] = []
    accepted: list[int] = []
    for step in speculative_steps(timed_target, timed_proposer, prompt, sampler=Sampler()):
        stamps.append(time.perf_counter())
        if step.verified:
            accepted.append(step.accepted)
        if len(stamps) > rounds + 1:
            break
    # Round r runs between yields r-1 and r (yield 0 is the prefill's token); round 1 is skipped.
    # Target calls: the prefill's chunks, then one verify per round.
    round_ms = [1000 * (b - a) for a, b in zip(stamps[1:], stamps[2:])]
    prefill_calls = -(-len(prompt) // PREFILL_STEP_SIZE)
    verify_build = [1000 * t for t in timed_target.build[prefill_calls + 1 : prefill_calls + 1 + len(round_ms)]]
    propose_build = [1000 * t for t in timed_proposer.propose_build[1 : 1 + len(round_ms)]]
    # extend calls: [prefill chunk(s)..., round 1, round 2, ...]: the last len(round_ms) belong to timed rounds
    extend_build = [1000 * t for t in timed_proposer.extend_build[-len(round_ms) :]]
    parts = {
        "round_ms": median(round_ms),
        "draft_graph_build_ms": median(propose_build),
        "verify_graph_build_ms": median(verify_build),
        "context_append_build_ms": median(extend_build),
        "compute_draft_and_verify_ms": compute_ms,
    }
    parts["other_ms"] = parts["round_ms"] - sum(v for k, v in parts.items() if k not in ("round_ms",))
    parts["rounds"] = len(round_ms)
    parts["mean_accepted"] = sum(accepted) / len(accepted) if accepted else 0.0
    return parts


def format_profile(parts: dict) -> str:
    lines = [f"round profile (median of {parts['rounds']} rounds, mean accepted {parts['mean_accepted']:.2f}):"]
    for key in ("round_ms", "draft_graph_build_ms", "verify_graph_build_ms", "context_append_build_ms", "compute_draft_and_verify_ms", "other_ms"):
        lines.append(f"  {key:<28} {parts[key]:8.2f}")
    return "\n".join(lines)
