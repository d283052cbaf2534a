"""The cost curve of a pair on this machine: target forwards of 1..8 tokens, a draft block, plain decode.

Everything is measured at a fixed context length (caches prefilled with that many tokens) and timed
as the loop pays for it: graph building plus evaluation, medians over repeats with the widths
interleaved. Each forward is rolled back afterwards, so the context never drifts. The verify
scheduler (DSPARK.md section 5) reads the saved JSON; `ideal_speedup` turns it into the speedup an
engine with no overhead would reach at a given acceptance length.
"""

from __future__ import annotations

import random
import time
from typing import Any

import mlx.core as mx

from mlx_dspark.engine.round.accept import accept_greedy
from mlx_dspark.engine.costs.probe import undo_timed_forward
from mlx_dspark.engine.round.decode import plain_steps, prefill
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.bench.stats import loadavg, median


def random_prompt(vocab_size: int, length: int, *, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


def _cache_arrays(c: Any) -> list:
    """A cache's arrays: keys / values, or (a hybrid's recurrent caches, mlx-lm's CacheList) its state."""
    if hasattr(c, "caches"):
        return [a for inner in c.caches for a in _cache_arrays(inner)]
    if hasattr(c, "keys"):
        return [a for a in (c.keys, c.values) if a is not None]
    return [a for a in getattr(c, "cache", ()) if isinstance(a, mx.array)]


def _eval_caches(cache: list, context: list) -> None:
    mx.eval([a for c in [*cache, *context] for a in _cache_arrays(c)])


def _timed(build, *, outputs) -> tuple[float, float]:
    """(build seconds, total seconds) of building a lazy graph and evaluating `outputs(result)`."""
    start = time.perf_counter()
    result = build()
    built = time.perf_counter()
    mx.eval(outputs(result))
    return built - start, time.perf_counter() - start


def plain_loop_ms(target: Any, prompt: list[int], *, tokens: int) -> float:
    """Per-token time of the pipelined plain decode loop (the baseline's steady state), in ms."""
    stamps = []
    for step in plain_steps(target, prompt, sampler=Sampler()):
        stamps.append(time.perf_counter())
        if len(stamps) > tokens:
            break
    # skip the first gap (the first decode step follows the prefill's read)
    return 1000 * (stamps[-1] - stamps[1]) / (len(stamps) - 2)


class CostProbe:
    """A target cache and a draft context prefilled to `context` positions, timing one piece at a time.

    Every method returns (graph-building seconds, total seconds) and rolls the target cache back, so
    pieces can be timed in any order, interleaved with other runs, at a constant context.
    """

    def __init__(self, loaded: Any, *, context: int, seed: int = 0) -> None:
        target, draft = loaded.target, loaded.draft
        if draft is None:
            raise ValueError("the cost curve needs a draft: pass --draft")
        if context < 1:
            raise ValueError(f"the cost-curve context must be >= 1 token, got {context}")
        self.target, self.draft, self.context = target, draft, context
        self.block_size = int(draft.num_drafts)
        vocab = target.args.vocab_size
        self.prompt = random_prompt(vocab, context, seed=seed)
        self.proposer = DraftProposer(draft, target, greedy=True, temperature=1.0)
        self.cache = target.make_cache()
        logits = prefill(target, self.cache, self.prompt, tap_ids=self.proposer.tap_ids, proposer=self.proposer)
        self.anchor = mx.argmax(logits).astype(mx.int32).reshape(1)
        mx.eval(self.anchor)
        _eval_caches(self.cache, self.proposer.context)
        self.candidates = mx.array(random_prompt(vocab, self.block_size + 1, seed=seed + 1), dtype=mx.int32)[None]

    def verify(self, width: int) -> tuple[float, float]:
        """A target forward of `width` tokens with the draft's taps, and greedy acceptance."""
        if not 1 <= width <= self.block_size + 1:
            raise ValueError(f"verify widths go from 1 to block_size + 1 = {self.block_size + 1}, got {width}")

        def build():
            out, _ = self.target(self.candidates[:, :width], cache=self.cache, tap_ids=self.proposer.tap_ids)
            return accept_greedy(draft_tokens=self.candidates[0, 1:width], target_logits=out[0])

        timing = _timed(build, outputs=lambda a: [a.accepted, a.tokens])
        undo_timed_forward(self.cache, width)  # a hybrid's width-1 step stays: the context moves on by one
        return timing

    def decode(self) -> tuple[float, float]:
        """One plain decode step (no taps), unpipelined."""

        def build():
            out, _ = self.target(self.candidates[:, :1], cache=self.cache)
            return mx.argmax(out[0, -1])

        timing = _timed(build, outputs=lambda t: [t])
        undo_timed_forward(self.cache, 1)
        return timing

    def draft_block(self) -> tuple[float, float]:
        """One draft proposal of block_size tokens (layers, LM head, Markov steps)."""
        return _timed(
            lambda: self.proposer.propose(self.anchor, position=self.context, num_tokens=self.block_size),
            outputs=lambda p: [p.tokens],
        )

    def draft_layers(self, *, with_lm_head: bool) -> tuple[float, float]:
        """The draft's block forward alone, or with the LM head and an argmax (no Markov steps)."""

        def build():
            hidden = self.draft.block_hidden(self.anchor, self.proposer.context, target=self.target)
            return mx.argmax(self.target.lm_head_logits(hidden), axis=-1) if with_lm_head else hidden

        return _timed(build, outputs=lambda out: [out])


def measure_round_breakdown(loaded: Any, *, context: int, repeats: int = 10, max_width: int = 8, seed: int = 0) -> dict:
    """Median milliseconds of each piece of a round at `context` committed positions (JSON-ready)."""
    probe = CostProbe(loaded, context=context, seed=seed)
    if max_width > probe.block_size + 1:
        raise ValueError(f"verify widths go up to block_size + 1 = {probe.block_size + 1}, got {max_width}")
    samples: dict[str, list[float]] = {}
    build_samples: dict[str, list[float]] = {}

    def record(name: str, timing: tuple[float, float]) -> None:
        build_samples.setdefault(name, []).append(1000 * timing[0])
        samples.setdefault(name, []).append(1000 * timing[1])

    # one untimed pass of everything, then interleaved timed passes (widths in rotating order)
    widths = list(range(1, max_width + 1))
    for repeat in range(repeats + 1):
        rotation = repeat % len(widths)
        timings = [(f"verify_{w}", probe.verify(w)) for w in widths[rotation:] + widths[:rotation]]
        timings.append(("decode_step", probe.decode()))
        timings.append(("draft_block", probe.draft_block()))
        timings.append(("draft_layers", probe.draft_layers(with_lm_head=False)))
        timings.append(("draft_layers_and_lm_head", probe.draft_layers(with_lm_head=True)))
        if repeat:
            for name, timing in timings:
                record(name, timing)

    curve = {
        "context": context,
        "repeats": repeats,
        "block_size": probe.block_size,
        "verify_ms": {str(w): median(samples[f"verify_{w}"]) for w in widths},
        "verify_build_ms": {str(w): median(build_samples[f"verify_{w}"]) for w in widths},
        "decode_step_ms": median(samples["decode_step"]),
        "draft_block_ms": median(samples["draft_block"]),
        "draft_block_build_ms": median(build_samples["draft_block"]),
        "draft_layers_ms": median(samples["draft_layers"]),
        "draft_layers_and_lm_head_ms": median(samples["draft_layers_and_lm_head"]),
        "plain_loop_ms": plain_loop_ms(loaded.target, probe.prompt, tokens=max(8, 2 * repeats)),
        "loadavg": loadavg(),
    }
    curve["verify_ratio"] = {w: curve["verify_ms"][w] / curve["verify_ms"]["1"] for w in curve["verify_ms"]}
    curve["markov_and_sampling_ms"] = curve["draft_block_ms"] - curve["draft_layers_and_lm_head_ms"]
    round_ms = curve["draft_block_ms"] + curve["verify_ms"][str(max_width)]
    curve["break_even_acceptance"] = round_ms / curve["plain_loop_ms"]
    return curve


def ideal_speedup(acceptance_length: float, *, decode_ms: float, draft_ms: float, verify_ms: float) -> float:
    """tau * t_decode / (t_draft + t_verify): the speedup of a round with no overhead."""
    return acceptance_length * decode_ms / (draft_ms + verify_ms)


def format_cost_curve(curve: dict) -> str:
    """The cost curve as a small text table."""
    lines = [f"cost curve at context {curve['context']} (median of {curve['repeats']}, loadavg {curve['loadavg']})"]
    lines.append("  target forward of L tokens (with taps and greedy acceptance):")
    for width, ms in curve["verify_ms"].items():
        lines.append(f"    L={width}: {ms:8.2f} ms  ({curve['verify_ratio'][width]:.2f}x L=1; graph building {curve['verify_build_ms'][width]:.2f} ms)")
    lines.append(f"  plain decode step (unpipelined): {curve['decode_step_ms']:8.2f} ms")
    lines.append(f"  plain decode loop (pipelined):   {curve['plain_loop_ms']:8.2f} ms/token")
    lines.append(
        f"  draft block ({curve['block_size']} tokens):        {curve['draft_block_ms']:8.2f} ms  (layers {curve['draft_layers_ms']:.2f}, "
        f"+LM head {curve['draft_layers_and_lm_head_ms']:.2f}, Markov/sampling {curve['markov_and_sampling_ms']:.2f}; "
        f"graph building {curve['draft_block_build_ms']:.2f})"
    )
    lines.append(f"  break-even acceptance length: {curve['break_even_acceptance']:.2f}")
    return "\n".join(lines)
