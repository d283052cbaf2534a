"""What a draft head proposes: one dataclass for a draft model's output and the round's proposal."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class Proposal:
    """A block of draft tokens (batch size 1 in the round; B rows from a draft model's forward)."""

    tokens: mx.array  # (B, K) int draft tokens x(1..K)
    draft_probs: mx.array | None = None  # (B, K, V) softmax(logits(k) / T) each was drawn from; None = greedy (one-hot)
    # (B, K) max softmax(logits(k)) at T = 1, for p_min: x(k)'s own probability under greedy drafting; for
    # sampled drafts it is known before the draw, so a cut on it never looks at x(k) (lossless)
    token_probs: mx.array | None = None
    confidence: mx.array | None = None  # (B, K) confidence head outputs c(k) in (0, 1); None without one
    # drafted through the round's logits hook (penalties, bias, grammar mask); False: a proposal the
    # grammar has not seen (a lookup continuation), which the round validates before verifying
    hooked: bool = True
    source: str = "draft"  # "draft", or "lookup" / "forced" (proposal_choice.py): sized by their chooser, not scheduled
