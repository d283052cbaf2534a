"""A DSpark block's distributions for a token tree (issue 37): what engine/tree/grow.py grows a tree from.

A chain drafts x(k) from logits(k) = z(k) + bias(x(k-1), o(k), s(k-1)) (dspark_heads.draft_tokens). In a
tree every node at depth k-1 is a possible x(k-1): its children's distribution is the Markov head's
conditional logits given that node's token (and, for the rnn head, the state carried along its own
path), exactly as the chain would compute them had it drafted that node. Without a Markov head every
parent's children share the per-position marginal softmax(z(k)).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx


class TreeChildren:
    """`children(depth, parents, state)`: log-probabilities of the token at `depth` after each parent.

    hidden: o(1..K) (K, H); base: z(1..K) (K, V') float32 over the draft's rows; `row_ids` (V',) maps
    rows to target ids (a `d2t` head or a reduced vocabulary), None when V' is the target's vocabulary.
    """

    def __init__(
        self, hidden: mx.array, base: mx.array, *, markov_head: Any, vocab_size: int,
        row_ids: Optional[mx.array] = None, markov_out: Optional[Callable] = None,
    ) -> None:  # fmt: skip
        self.hidden, self.base, self.markov_head = hidden, base, markov_head
        self.vocab_size, self.row_ids, self.markov_out = vocab_size, row_ids, markov_out
        self.depth = base.shape[0]  # the deepest position the block drafts

    def __call__(self, depth: int, parents: mx.array, state: Any) -> tuple[mx.array, Any]:
        """parents: (F,) target ids of the nodes at depth - 1 (the anchor at depth 1); state: what this
        returned for their parents, gathered per parent (None at depth 1). Returns (log-probabilities
        (F, V) of their children, or (1, V) when they do not depend on the parent; the state per parent)."""
        logits = self.base[depth - 1][None]  # (1, V')
        head = self.markov_head
        if head is not None:
            embedding = head.prev_embedding(parents)  # W1[x(k-1)], (F, r)
            if state is None:
                state = head.initial_state(embedding)
            hidden = mx.broadcast_to(self.hidden[depth - 1][None], (parents.shape[0], self.hidden.shape[-1]))
            bias, state = head.step(embedding, hidden, state, out=self.markov_out)
            logits = logits + bias.astype(mx.float32)  # (F, V')
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.row_ids is not None:  # spread the draft's rows over the target's ids
            full = mx.full((logprobs.shape[0], self.vocab_size), -mx.inf, dtype=logprobs.dtype)
            full[:, self.row_ids] = logprobs
            logprobs = full
        return logprobs, state
