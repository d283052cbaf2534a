"""DSpark's Markov heads (vanilla, gated, rnn) and confidence head (DSPARK.md 3.5, 3.6).

Each Markov head turns the previous draft token `x(k-1)` (and, for gated/rnn, the block output
`o(k)`) into a vocabulary bias added to the base logits `z(k)`. A step is a few rank-sized products
plus one `(B, r) @ (r, V)` projection, so the sequential loop over the block stays cheap.
Attribute names mirror DeepSpec's checkpoints (`markov_head.*`, `confidence_head.proj.*`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.models.heads.d2t import scatter_probs, to_target
from mlx_dspark.models.heads.proposal import Proposal

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class VanillaMarkov(nn.Module):
    """bias(k) = W2 · W1[x(k-1)]."""

    def __init__(self, *, vocab_size: int, markov_rank: int, output_size: Optional[int] = None, bias_scale: Optional[float] = None):
        """output_size: W2's rows (a reduced draft vocabulary's size; default vocab_size);
        bias_scale: the bias times this (a GGUF's `markov_w2.scale`)."""
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, markov_rank)
        self.markov_w2 = nn.Linear(markov_rank, output_size or vocab_size, bias=False)
        self._bias_scale = bias_scale  # config, not a parameter

    def project(self, x: mx.array, *, out: Optional[Callable] = None) -> mx.array:
        """W2 · x (B, r) -> (B, V); `out` in place of W2 (a reduced vocabulary's rows of it)."""
        bias = (out or self.markov_w2)(x)
        return bias if self._bias_scale is None else bias * self._bias_scale

    def prev_embedding(self, tokens: mx.array) -> mx.array:
        return self.markov_w1(tokens)  # (B, r)

    def initial_state(self, prev_embedding: mx.array) -> mx.array | None:
        return None

    def step(
        self, prev_embedding: mx.array, hidden: mx.array, state: mx.array | None, *, out: Optional[Callable] = None
    ) -> tuple[mx.array, mx.array | None]:
        """(bias (B, V), next state) from W1[x(k-1)] (B, r) and o(k) (B, H); `out` replaces the
        rank -> vocabulary projection W2 (a reduced vocabulary's rows of it)."""
        return self.project(prev_embedding, out=out), state


class GatedMarkov(VanillaMarkov):
    """bias(k) = W2 · (sigmoid(gate_proj([o(k); W1[x(k-1)]])) * W1[x(k-1)])."""

    def __init__(self, *, vocab_size: int, markov_rank: int, hidden_size: int, **kw):
        super().__init__(vocab_size=vocab_size, markov_rank=markov_rank, **kw)
        self.gate_proj = nn.Linear(hidden_size + markov_rank, markov_rank)

    def step(self, prev_embedding, hidden, state, *, out=None):
        gate = mx.sigmoid(self.gate_proj(mx.concatenate([hidden, prev_embedding], axis=-1)))
        return self.project(gate * prev_embedding, out=out), state


class RNNMarkov(VanillaMarkov):
    """[a; b; u] = joint_proj([s(k-1); W1[x(k-1)]; o(k)]); s(k) = σ(a)s(k-1) + (1-σ(a))tanh(b); bias W2·tanh(u)."""

    def __init__(self, *, vocab_size: int, markov_rank: int, hidden_size: int, **kw):
        super().__init__(vocab_size=vocab_size, markov_rank=markov_rank, **kw)
        self.joint_proj = nn.Linear(2 * markov_rank + hidden_size, 3 * markov_rank)

    def initial_state(self, prev_embedding):
        return mx.zeros_like(prev_embedding)  # s(0) = 0, (B, r)

    def step(self, prev_embedding, hidden, state, *, out=None):
        joint = self.joint_proj(mx.concatenate([state, prev_embedding, hidden], axis=-1))
        gate_raw, candidate_raw, output_raw = mx.split(joint, 3, axis=-1)
        gate = mx.sigmoid(gate_raw)
        state = gate * state + (1 - gate) * mx.tanh(candidate_raw)
        return self.project(mx.tanh(output_raw), out=out), state


def make_markov_head(
    *,
    head_type: str | None,
    vocab_size: int,
    markov_rank: int,
    hidden_size: int,
    output_size: Optional[int] = None,
    bias_scale: Optional[float] = None,
) -> VanillaMarkov | None:
    """The Markov head of a draft, or None when `markov_rank` is 0 (output_size / bias_scale: see VanillaMarkov)."""
    if markov_rank == 0:
        return None
    kw = {"vocab_size": vocab_size, "markov_rank": markov_rank, "output_size": output_size, "bias_scale": bias_scale}
    if head_type == "vanilla":
        return VanillaMarkov(**kw)
    if head_type == "gated":
        return GatedMarkov(hidden_size=hidden_size, **kw)
    if head_type == "rnn":
        return RNNMarkov(hidden_size=hidden_size, **kw)
    raise ValueError(f"markov_head_type {head_type!r} is not supported; expected one of {MARKOV_HEAD_TYPES}")


class ConfidenceHead(nn.Module):
    """c(k) = sigmoid(proj([o(k); W1[x(k-1)]]) / T(k)) (or of o(k) alone): P(draft k survives | 1..k-1 did).

    `temperatures` (one per block position, from config.json's `confidence_temperatures`) are the
    calibration fitted after training; without them T(k) = 1. They are config, not parameters.
    """

    def __init__(self, input_dim: int, *, temperatures: Optional[Sequence[float]] = None):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)
        self.temperatures = None if temperatures is None else tuple(float(t) for t in temperatures)

    def logits(self, features: mx.array) -> mx.array:
        """Uncalibrated logits (..., K) of features (..., K, input_dim); training fits these."""
        return self.proj(features).squeeze(-1).astype(mx.float32)

    def __call__(self, features: mx.array) -> mx.array:
        logits = self.logits(features)  # (B, K): position k-1 is draft token k
        if self.temperatures is not None:
            logits = logits / mx.array(self.temperatures[: logits.shape[-1]], dtype=mx.float32)
        return mx.sigmoid(logits)


def draft_tokens(
    anchor: mx.array,
    hidden: mx.array,
    base: mx.array,
    *,
    markov_head: Optional[VanillaMarkov],
    confidence_head: Optional[ConfidenceHead],
    confidence_with_markov: bool,
    greedy: bool,
    temperature: float,
    draft_to_target: Optional[mx.array] = None,
    vocab_size: Optional[int] = None,
    vocabulary: Optional[Any] = None,
    logits_hook: Optional[Callable[[mx.array, list], Optional[mx.array]]] = None,
) -> Proposal:
    """Sequential drafting over k = 1..K with x(0) = anchor (B,): o(k) = hidden[:, k-1], z(k) = base[:, k-1].

    Greedy: x(k) = argmax logits(k); else a draw from softmax(logits(k) / T) with the global MLX RNG.
    With `draft_to_target` (a draft trained with a reduced vocabulary, `models/heads/d2t.py`) the logits are
    over the draft rows: the pick is mapped to its target id and `draft_probs` spread over `vocab_size`.
    With a `vocabulary` (FR-Spec, `models/heads/draft_vocab.py`) `base` and the Markov bias cover its K ids
    only; the tokens are mapped back to target ids and `draft_probs` scattered onto the full vocabulary.
    `logits_hook(logits(k), [x(1), .., x(k-1)])` (the engine's penalties / bias / grammar mask, over the
    target's vocabulary) replaces logits(k) before the draw, or returns None to end the proposal before
    position k; a reduced vocabulary's logits go through it spread over the target's ids (-inf elsewhere).
    Lazy: builds the graph only (no host synchronization), unless the hook reads the tokens.
    """
    out = None if vocabulary is None else vocabulary.markov_bias
    row_ids = draft_to_target if draft_to_target is not None else (None if vocabulary is None else vocabulary.ids)
    if vocabulary is not None:
        vocab_size = vocabulary.vocab_size
    prev = anchor
    prev_embeddings, tokens, token_probs, draft_probs = [], [], [], []
    state = None
    for k in range(base.shape[1]):
        logits = base[:, k]  # (B, V) float32
        if markov_head is not None:
            embedding = markov_head.prev_embedding(prev)  # W1[x(k-1)], (B, r)
            if k == 0:
                state = markov_head.initial_state(embedding)
            bias, state = markov_head.step(embedding, hidden[:, k], state, out=out)
            logits = logits + bias.astype(mx.float32)
            prev_embeddings.append(embedding)
        if logits_hook is not None:
            if row_ids is None:
                logits = logits_hook(logits, tokens)
            else:  # the hook reads target ids: spread the reduced rows over them, then take them back
                full = mx.full((*logits.shape[:-1], vocab_size), -mx.inf, dtype=logits.dtype)
                full[..., row_ids] = logits
                hooked = logits_hook(full, tokens)
                logits = None if hooked is None else hooked[..., row_ids]
            if logits is None:
                prev_embeddings = prev_embeddings[:k]
                break
        if greedy:
            token = mx.argmax(logits, axis=-1)
        else:
            scaled = logits * (1.0 / temperature)
            token = mx.random.categorical(scaled)
            probs = mx.softmax(scaled, axis=-1)
            if draft_to_target is not None:
                probs = scatter_probs(probs, draft_to_target, vocab_size)
            elif vocabulary is not None:
                probs = vocabulary.scatter(probs)
            draft_probs.append(probs)
        if draft_to_target is not None:
            token = to_target(token, draft_to_target)
        elif vocabulary is not None:
            token = vocabulary.to_target(token)  # W1 and the target read target ids
        token = token.astype(anchor.dtype)
        token_probs.append(mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1)))
        tokens.append(token)
        prev = token
    confidence = None
    if not tokens:  # the hook ended the proposal before its first position
        empty = mx.zeros((anchor.shape[0], 0), anchor.dtype)
        return Proposal(tokens=empty, draft_probs=None, token_probs=empty.astype(mx.float32), confidence=None)
    hidden = hidden[:, : len(tokens)]
    if confidence_head is not None:
        features = hidden
        if confidence_with_markov:
            features = mx.concatenate([hidden, mx.stack(prev_embeddings, axis=1).astype(hidden.dtype)], axis=-1)
        confidence = confidence_head(features)  # one (B, K, in) @ (in, 1) product
    return Proposal(
        tokens=mx.stack(tokens, axis=1),
        draft_probs=None if greedy else mx.stack(draft_probs, axis=1),
        token_probs=mx.stack(token_probs, axis=1),
        confidence=confidence,
    )
