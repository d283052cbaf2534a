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

from mlx_dspark.accept import accept_greedy
from mlx_dspark.cache import trim_caches
from mlx_dspark.decode import plain_steps, prefill
from mlx_dspark.propose import DraftProposer
from mlx_dspark.sample import Sampler
from mlx_dspark.bench.stats import loadavg, median


def random_prompt(vocab_size: int, length: int, *, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


def _eval_caches(cache: list, context: list) -> None:
    arrays = [c.keys for c in cache if c.keys is not None] + [c.values for c in cache if c.values is not None]
    arrays += [c.keys for c in context if c.keys is not None] + [c.values for c in context if c.values is not None]
    mx.eval(arrays)


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


def measure_cost_curve(loaded: Any, *, context: int, repeats: int = 10, max_width: int = 8, seed: int = 0) -> dict:
    """Median milliseconds of each piece of a round at `context` committed positions (JSON-ready)."""
    target, draft = loaded.target, loaded.draft
    if draft is None:
        raise ValueError("the cost curve needs a draft: pass --draft")
    if context < 1:
        raise ValueError(f"the cost-curve context must be >= 1 token, got {context}")
    block = int(draft.args.block_size)
    if max_width > block + 1:
        raise ValueError(f"verify widths go up to block_size + 1 = {block + 1}, got {max_width}")
    vocab = target.args.vocab_size
    prompt = random_prompt(vocab, context, seed=seed)
    proposer = DraftProposer(draft, target, greedy=True, temperature=1.0)
    cache = target.make_cache()
    logits = prefill(target, cache, prompt, tap_ids=proposer.tap_ids, proposer=proposer)
    anchor = mx.argmax(logits).astype(mx.int32).reshape(1)
    mx.eval(anchor)
    _eval_caches(cache, proposer.context)
    taps = proposer.tap_ids
    candidates = mx.array(random_prompt(vocab, max_width, seed=seed + 1), dtype=mx.int32)[None]  # (1, W)

    def verify(width: int):
        def build():
            out, _ = target(candidates[:, :width], cache=cache, tap_ids=taps)
            return accept_greedy(draft_tokens=candidates[0, 1:width], target_logits=out[0])

        return _timed(build, outputs=lambda a: [a.accepted, a.tokens])

    def decode():
        def build():
            out, _ = target(candidates[:, :1], cache=cache)
            return mx.argmax(out[0, -1])

        return _timed(build, outputs=lambda t: [t])

    samples: dict[str, list[float]] = {}
    build_samples: dict[str, list[float]] = {}

    def record(name: str, timing: tuple[float, float]) -> None:
        build_samples.setdefault(name, []).append(1000 * timing[0])
        samples.setdefault(name, []).append(1000 * timing[1])

    # one untimed pass of everything, then interleaved timed passes
    for repeat in range(repeats + 1):
        widths = list(range(1, max_width + 1))
        rotation = repeat % len(widths)
        for width in widths[rotation:] + widths[:rotation]:
            timing = verify(width)
            trim_caches(cache, width)
            if repeat:
                record(f"verify_{width}", timing)
        timing = decode()
        trim_caches(cache, 1)
        if repeat:
            record("decode_step", timing)
        timing = _timed(lambda: proposer.propose(anchor, position=context, num_tokens=block), outputs=lambda p: [p.tokens])
        if repeat:
            record("draft_block", timing)
        timing = _timed(lambda: draft.block_hidden(anchor, proposer.context, target=target), outputs=lambda h: [h])
        if repeat:
            record("draft_layers", timing)
        timing = _timed(
            lambda: mx.argmax(target.lm_head_logits(draft.block_hidden(anchor, proposer.context, target=target)), axis=-1),
            outputs=lambda t: [t],
        )
        if repeat:
            record("draft_layers_and_lm_head", timing)

    curve = {
        "context": context,
        "repeats": repeats,
        "block_size": block,
        "verify_ms": {str(w): median(samples[f"verify_{w}"]) for w in range(1, max_width + 1)},
        "verify_build_ms": {str(w): median(build_samples[f"verify_{w}"]) for w in range(1, max_width + 1)},
        "decode_step_ms": median(samples["decode_step"]),
        "draft_block_ms": median(samples["draft_block"]),
        "draft_block_build_ms": median(build_samples["draft_block"]),
        "draft_layers_ms": median(samples["draft_layers"]),
        "draft_layers_and_lm_head_ms": median(samples["draft_layers_and_lm_head"]),
        "plain_loop_ms": plain_loop_ms(target, prompt, tokens=max(8, 2 * repeats)),
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
