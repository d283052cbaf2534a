"""A proposer at controlled top-1 / top-2 accuracy, for chain vs tree rounds (issue 37; benchmark and tests only).

`RankedProposer` knows the target's greedy continuation and, at every position, puts the right token at
rank 1 of its distribution with probability ~`top1`, at rank 2 with ~`top2 - top1`, and otherwise
nowhere near the top (a deterministic low-discrepancy schedule over positions, so runs repeat exactly).
Its distributions are calibrated: rank 1 holds probability `top1`, rank 2 `top2 - top1`, a decoy at rank
3 most of the rest. They do not depend on the parent token (a draft without a Markov head): as a chain
proposer it proposes its top-1 tokens; as a tree proposer (`tree_children`) it gives the marginals.
`inner`, when given (a real DraftProposer), runs its block forward every round so the draft's cost is
paid (the proposed tokens depend on its output in the graph); otherwise drafting is free.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import mlx.core as mx

from mlx_dspark.engine.proposers.base import Proposal, Proposer

GOLDEN = (math.sqrt(5) - 1) / 2


class RankedProposer(Proposer):
    grows_trees = True

    def __init__(
        self, reference: Sequence[int], *, prompt_len: int, vocab_size: int, top1: float = 0.6, top2: float = 0.85,
        tap_ids: Sequence[int] = (0,), block_size: int = 7, inner: Optional[Any] = None,
    ) -> None:  # fmt: skip
        if not 0.0 < top1 <= top2 < 1.0:
            raise ValueError(f"need 0 < top1 <= top2 < 1, got top1 {top1}, top2 {top2}")
        self.reference = list(reference)  # greedy tokens at positions prompt_len, prompt_len + 1, ...
        self.prompt_len, self.vocab_size, self.top1, self.top2 = prompt_len, vocab_size, top1, top2
        self.inner = inner
        self.tap_ids = tuple(inner.tap_ids if inner is not None else tap_ids)
        self.block_size = int(inner.block_size if inner is not None else block_size)

    def rank(self, position: int) -> int:
        """The right token's rank at `position`: 1, 2, or 0 (not among the top 3)."""
        u = (position * GOLDEN) % 1.0
        return 1 if u < self.top1 else 2 if u < self.top2 else 0

    def right_token(self, position: int) -> int:
        index = position - self.prompt_len
        return self.reference[index] if 0 <= index < len(self.reference) else 0

    def ranked(self, position: int) -> list[int]:
        """The top 3 tokens at `position`, best first."""
        right, rank = self.right_token(position), self.rank(position)
        decoys = [(right + k) % self.vocab_size for k in (1, 2, 3)]
        if rank == 1:
            return [right, decoys[0], decoys[1]]
        if rank == 2:
            return [decoys[0], right, decoys[1]]
        return decoys

    def extend(self, features: mx.array) -> None:
        if self.inner is not None:
            self.inner.extend(features)

    def _paid(self, anchor: mx.array, position: int, depth: int) -> mx.array:
        """0 (int32), depending on the inner draft's block forward when there is one."""
        if self.inner is None:
            return mx.array(0, mx.int32)
        out = self.inner.propose(anchor, position=position, num_tokens=depth)
        return (out.tokens[0, 0] * 0).astype(mx.int32)

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int) -> Proposal:
        tokens = [self.ranked(position + k)[0] for k in range(1, num_tokens + 1)]
        paid = self._paid(anchor, position, num_tokens)
        return Proposal(tokens=mx.array([tokens], dtype=mx.int32) + paid)

    def tree_children(self, anchor: mx.array, *, position: int, depth: int):
        mass = [self.top1, self.top2 - self.top1, 0.9 * (1 - self.top2)]
        rest = math.log(0.1 * (1 - self.top2) / (self.vocab_size - 3))
        rows = [k for k in range(depth) for _ in mass]
        columns = [token for k in range(1, depth + 1) for token in self.ranked(position + k)]
        logprobs = mx.full((depth, self.vocab_size), rest, dtype=mx.float32)
        logprobs[mx.array(rows), mx.array(columns)] = mx.log(mx.array(mass * depth, dtype=mx.float32))
        logprobs = logprobs + self._paid(anchor, position, depth).astype(mx.float32)

        def children(d: int, parents: mx.array, state: Any) -> tuple[mx.array, Any]:
            return logprobs[d - 1][None], None

        return children
