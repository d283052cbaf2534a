"""Proposers: what the speculative round asks for draft tokens.

The round only needs three things from a proposer: which target layers to tap, a way to take the
features of newly committed positions, and a proposal for the next block. `DraftProposer` is the real
DSpark draft; tests and benchmarks plug in others (an oracle with injected errors) through the same
protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import mlx.core as mx

LAZY_CONTEXT_LIMIT = 64  # context positions appended without a proposal before they are evaluated


@dataclass
class Proposal:
    """A block of draft tokens (batch size 1 in the loop)."""

    tokens: mx.array  # (1, K) int
    draft_probs: mx.array | None = None  # (1, K, V) distributions drawn from; None = greedy (one-hot)
    token_probs: mx.array | None = None  # (1, K) top draft probability at each position (before a draw), for p_min
    confidence: mx.array | None = None  # (1, K) confidence head outputs c(k)


class Proposer(Protocol):
    """A proposer whose `takes_logits_hook` is true accepts `logits_hook=` in `propose` (the round's
    penalties / bias / grammar mask for its draft positions); others propose unprocessed (still lossless)."""

    tap_ids: Sequence[int]
    block_size: int  # the most draft tokens one proposal can hold

    def extend(self, features: mx.array) -> None:
        """Take the target features (1, n, F) of the next n committed positions."""

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int) -> Proposal:
        """Draft tokens for positions position+1 .. position+num_tokens; anchor (1,) sits at `position`."""


class DraftProposer:
    """The DSpark draft: one block forward per round over its own windowed context cache."""

    takes_logits_hook = True

    def __init__(
        self, draft: Any, target: Any, *, greedy: bool, temperature: float, context: list | None = None
    ) -> None:
        """`context`: an existing draft context cache to extend (a prompt cache's); default a new one."""
        self.draft = draft
        self.target = target
        self.greedy = greedy
        self.temperature = temperature
        self.tap_ids = tuple(draft.args.target_layer_ids)
        # The block [anchor, mask x (block_size - 1)] predicts block_size tokens (DSPARK.md 3.4), or
        # block_size - 1 when its anchor row yields no draft (a bonus-anchor packaging).
        self.block_size = int(draft.num_drafts)
        self.context = draft.make_cache() if context is None else context
        self._lazy = 0  # positions appended since the context was last evaluated

    def extend(self, features: mx.array) -> None:
        self.draft.append_context(features, self.context)
        # A proposal evaluates the context; rounds without one (a parked draft length, draft_length.py)
        # leave it lazy: evaluate now and then so the graph stays short however long the draft rests.
        self._lazy += features.shape[1]
        if self._lazy >= LAZY_CONTEXT_LIMIT:
            mx.async_eval(*(a for c in self.context for a in (c.keys, c.values) if a is not None))
            self._lazy = 0

    def propose(
        self, anchor: mx.array, *, position: int, num_tokens: int, logits_hook: Callable | None = None
    ) -> Proposal:
        self._lazy = 0
        out = self.draft.propose(
            anchor,
            self.context,
            target=self.target,
            greedy=self.greedy,
            temperature=self.temperature,
            num_tokens=num_tokens,
            logits_hook=logits_hook,
        )
        return Proposal(
            tokens=out.tokens,
            draft_probs=out.draft_probs,
            token_probs=out.token_probs,
            confidence=out.confidence,
        )
