"""Losslessness in practice: is greedy speculative output token-identical to plain greedy decoding?

Kernels of different widths (1-token decode vs 8-token verify) may round differently, so a near-tie
between the target's top two logits can flip. For a differing prompt we report the first differing
position and the target's top-2 logit margin there (computed on the shared prefix): a tiny margin
means a floating-point tie, a large one a bug.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx


def first_difference(baseline: Sequence[int], speculative: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end), None if equal."""
    for i, (a, b) in enumerate(zip(baseline, speculative)):
        if a != b:
            return i
    if len(baseline) != len(speculative):
        return min(len(baseline), len(speculative))
    return None


def top2_margin(target: Any, prompt_ids: Sequence[int], prefix: Sequence[int]) -> float:
    """The target's top-1 minus top-2 logit for the token after prompt + prefix (one full forward, over a
    fresh cache: a target split over ranks runs its forwards with caches the other ranks can follow)."""
    tokens = mx.array(list(prompt_ids) + list(prefix), dtype=mx.int32)[None]
    logits, _ = target(tokens, cache=target.make_cache(), last_only=True)
    top2 = mx.topk(logits[0, -1].astype(mx.float32), 2)  # ascending
    return float((top2[1] - top2[0]).item())


def compare_greedy(target: Any, prompt_ids: Sequence[int], baseline: Sequence[int], speculative: Sequence[int]) -> dict:
    position = first_difference(baseline, speculative)
    if position is None:
        return {"identical": True, "first_difference": None, "top2_margin": None}
    margin = top2_margin(target, prompt_ids, baseline[:position]) if position < min(len(baseline), len(speculative)) else None
    return {"identical": False, "first_difference": position, "top2_margin": margin}
