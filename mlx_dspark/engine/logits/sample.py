"""Logits -> the target's sampling distribution, and token draws from it.

One `Sampler` is built per request and used by both the plain and the speculative loop, so both
sample from exactly the same distribution. Order of the filters: temperature, then top-k, top-p,
min-p (as DSPARK.md section 4 lists them), all on normalised log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class Sampler:
    """The knobs of the target distribution; `temperature == 0` means greedy (argmax).

    Users' values are checked by its subclass `options.SamplingOptions`, the form every entry point builds.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def log_probs(self, logits: mx.array) -> mx.array:
        """Filtered, renormalised log-probabilities (float32) of the sampling distribution, (..., V)."""
        logits = logits.astype(mx.float32)
        if not self.greedy:
            logits = logits * (1.0 / self.temperature)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.greedy:
            return logprobs
        filtered = False
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
            filtered = True
        if self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
            filtered = True
        if self.min_p > 0.0:
            logprobs = apply_min_p(logprobs, self.min_p)
            filtered = True
        if filtered:
            logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        return logprobs

    def probs(self, logits: mx.array) -> mx.array:
        """The sampling distribution (..., V); one-hot at the argmax when greedy."""
        if self.greedy:
            return one_hot(mx.argmax(logits, axis=-1), logits.shape[-1])
        return mx.exp(self.log_probs(logits))

    def sample(self, logits: mx.array) -> mx.array:
        """One token per row of `logits` (..., V) -> (...,) uint32/int."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        return mx.random.categorical(self.log_probs(logits), axis=-1)


def one_hot(tokens: mx.array, vocab_size: int) -> mx.array:
    """(...,) token ids -> (..., V) float32 one-hot rows."""
    return (mx.arange(vocab_size) == tokens[..., None]).astype(mx.float32)
