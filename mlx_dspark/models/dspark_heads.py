"""DSpark's Markov heads (vanilla, gated, rnn) and confidence head (DSPARK.md 3.5, 3.6).

Each Markov head turns the previous draft token `x(k-1)` (and, for gated/rnn, the block output
`o(k)`) into a vocabulary bias added to the base logits `z(k)`. A step is a few rank-sized products
plus one `(B, r) @ (r, V)` projection, so the sequential loop over the block stays cheap.
Attribute names mirror DeepSpec's checkpoints (`markov_head.*`, `confidence_head.proj.*`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class VanillaMarkov(nn.Module):
    """bias(k) = W2 · W1[x(k-1)]."""

    def __init__(self, *, vocab_size: int, markov_rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, markov_rank)
        self.markov_w2 = nn.Linear(markov_rank, vocab_size, bias=False)

    def prev_embedding(self, tokens: mx.array) -> mx.array:
        return self.markov_w1(tokens)  # (B, r)

    def initial_state(self, prev_embedding: mx.array) -> mx.array | None:
        return None

    def step(
        self, prev_embedding: mx.array, hidden: mx.array, state: mx.array | None
    ) -> tuple[mx.array, mx.array | None]:
        """(bias (B, V), next state) from W1[x(k-1)] (B, r) and o(k) (B, H)."""
        return self.markov_w2(prev_embedding), state


class GatedMarkov(VanillaMarkov):
    """bias(k) = W2 · (sigmoid(gate_proj([o(k); W1[x(k-1)]])) * W1[x(k-1)])."""

    def __init__(self, *, vocab_size: int, markov_rank: int, hidden_size: int):
        super().__init__(vocab_size=vocab_size, markov_rank=markov_rank)
        self.gate_proj = nn.Linear(hidden_size + markov_rank, markov_rank)

    def step(self, prev_embedding, hidden, state):
        gate = mx.sigmoid(self.gate_proj(mx.concatenate([hidden, prev_embedding], axis=-1)))
        return self.markov_w2(gate * prev_embedding), state


class RNNMarkov(VanillaMarkov):
    """[a; b; u] = joint_proj([s(k-1); W1[x(k-1)]; o(k)]); s(k) = σ(a)s(k-1) + (1-σ(a))tanh(b); bias W2·tanh(u)."""

    def __init__(self, *, vocab_size: int, markov_rank: int, hidden_size: int):
        super().__init__(vocab_size=vocab_size, markov_rank=markov_rank)
        self.joint_proj = nn.Linear(2 * markov_rank + hidden_size, 3 * markov_rank)

    def initial_state(self, prev_embedding):
        return mx.zeros_like(prev_embedding)  # s(0) = 0, (B, r)

    def step(self, prev_embedding, hidden, state):
        joint = self.joint_proj(mx.concatenate([state, prev_embedding, hidden], axis=-1))
        gate_raw, candidate_raw, output_raw = mx.split(joint, 3, axis=-1)
        gate = mx.sigmoid(gate_raw)
        state = gate * state + (1 - gate) * mx.tanh(candidate_raw)
        return self.markov_w2(mx.tanh(output_raw)), state


def make_markov_head(
    *, head_type: str | None, vocab_size: int, markov_rank: int, hidden_size: int
) -> VanillaMarkov | None:
    """The Markov head of a draft, or None when `markov_rank` is 0."""
    if markov_rank == 0:
        return None
    if head_type == "vanilla":
        return VanillaMarkov(vocab_size=vocab_size, markov_rank=markov_rank)
    if head_type == "gated":
        return GatedMarkov(vocab_size=vocab_size, markov_rank=markov_rank, hidden_size=hidden_size)
    if head_type == "rnn":
        return RNNMarkov(vocab_size=vocab_size, markov_rank=markov_rank, hidden_size=hidden_size)
    raise ValueError(f"markov_head_type {head_type!r} is not supported; expected one of {MARKOV_HEAD_TYPES}")


class ConfidenceHead(nn.Module):
    """c(k) = sigmoid(proj([o(k); W1[x(k-1)]])) (or of o(k) alone): P(draft k survives | 1..k-1 did)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def __call__(self, features: mx.array) -> mx.array:
        return mx.sigmoid(self.proj(features).squeeze(-1).astype(mx.float32))
