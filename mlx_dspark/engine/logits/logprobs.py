"""Log-probabilities of committed tokens, taken from the logits the round already has.

A token's logprob is the log-softmax, at its position, of the target's processed logits (after the
penalties, logit_bias and the constraint's mask; before temperature and the top-k / top-p / min-p
filters), as mlx-lm's generator reports them. The arrays are built lazily next to the acceptance and
read in the round's one host read; `read` turns them into `TokenLogprob`s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


def logprob_arrays(logits: mx.array, tokens: mx.array, top: int) -> tuple[mx.array, ...]:
    """Lazy (chosen (n,), top ids (n, top), top logprobs (n, top)) for rows `logits` (n, V) and `tokens` (n,)."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens.astype(mx.int32).reshape(-1, 1), axis=-1)[:, 0]
    if top == 0:
        return (chosen,)
    ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
    return chosen, ids, mx.take_along_axis(logprobs, ids, axis=-1)


def read(arrays: tuple[mx.array, ...], tokens: list[int]) -> list[TokenLogprob]:
    """The first len(tokens) rows of evaluated `logprob_arrays` output; tokens a constraint forbids are left out of `top`."""
    chosen = arrays[0].tolist()
    ids = arrays[1].tolist() if len(arrays) > 1 else None
    values = arrays[2].tolist() if len(arrays) > 1 else None
    out = []
    for row, token in enumerate(tokens):
        top: list[tuple[int, float]] = []
        if ids is not None:
            pairs = sorted(zip(values[row], ids[row]), key=lambda pair: (-pair[0], pair[1]))
            top = [(int(t), float(v)) for v, t in pairs if v != -math.inf]
        out.append(TokenLogprob(token=token, logprob=float(chosen[row]), top=top))
    return out
