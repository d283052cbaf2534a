"""The block draft's proposer (DSpark, DFlash, DFlash 2): one block forward per round over the draft's
own windowed context cache, fed the target's tapped features of committed positions."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import mlx.core as mx

from mlx_dspark.engine.proposers.base import BLOCK, Proposal, Proposer

PENDING_LIMIT = 32  # single committed positions batched into one context append
CATCH_UP = 8  # waiting positions past which a proposal's context append is a catch-up, timed apart
COST_KIND = BLOCK


def default_block(draft: Any) -> int:
    return int(draft.num_drafts)


def make_proposer(draft: Any, target: Any, *, prompt: Sequence[int], greedy: bool, temperature: float,
                  block_size: int | None = None, prompt_cache: Any = None) -> "DraftProposer":  # fmt: skip
    """The block draft over `prompt_cache`'s draft context when given; its block is the draft's own."""
    context = None if prompt_cache is None else prompt_cache.draft_context
    return DraftProposer(draft, target, greedy=greedy, temperature=temperature, context=context)


class DraftProposer(Proposer):
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
        self.grows_trees = bool(draft.grows_trees)  # a block draft with a Markov head
        self.context = draft.make_cache() if context is None else context
        self._pending: list[mx.array] = []  # features of single positions not in the context yet
        self._pending_positions = 0  # positions they stand for (windowed drafts drop the oldest entries)
        self._waiting = 0  # positions the entries in `_pending` hold
        self.catch_up_ms = 0.0  # time the proposals spent on catch-ups (take_catch_up_ms)
        rows = getattr(draft, "context_rows", None)
        self._keep = None if rows is None else rows(self.context)  # None: every position is needed

    def extend(self, features: mx.array) -> None:
        self.flush()
        self.draft.append_context(features, self.context)

    def extend_later(self, features: mx.array) -> None:
        """A parked round's committed position (draft_length.py: no proposal): the features wait and go
        into the context together before the next proposal or `flush()`: one draft forward for up to
        `PENDING_LIMIT` positions instead of one each, or, for a draft whose context layers are all
        windowed, one for the positions the window keeps, however long the park."""
        self._pending.append(features)
        self._pending_positions += features.shape[1]
        self._waiting += features.shape[1]
        if self._keep is None:
            if self._pending_positions >= PENDING_LIMIT:
                self.flush()
            return
        # Windowed context layers keep the last `_keep` positions: older waiting features are never
        # computed (a long park costs no draft work beyond the window), only counted.
        while self._pending and self._waiting - self._pending[0].shape[1] >= self._keep:
            self._waiting -= self._pending.pop(0).shape[1]

    def flush(self) -> None:
        """Put the waiting positions into the context (a proposal calls it first, `steps.make_steps` when
        a generation ends: a caller of `decode.speculative_steps` with a parked policy and a prompt cache
        calls it when it stops)."""
        if not self._pending:
            return
        features = mx.concatenate(self._pending, axis=1) if len(self._pending) > 1 else self._pending[0]
        positions = self._pending_positions
        self._pending, self._pending_positions, self._waiting = [], 0, 0
        self.draft.append_context(features, self.context, num_positions=positions)
        mx.async_eval(*self._context_arrays())

    def _context_arrays(self) -> list[mx.array]:
        return [a for c in self.context for a in (c.keys, c.values) if a is not None]

    def _catch_up(self) -> None:
        """Before a proposal: the waiting positions into the context. After a park or a prompt that is a
        one-off append of many rows; it runs to its end here and is timed apart (`take_catch_up_ms`), so
        the cost curve's healer does not charge it to the draft block (the device is idle here anyway:
        the round before was read)."""
        if self._waiting <= CATCH_UP:
            self.flush()
            return
        start = time.perf_counter()
        self.flush()
        mx.eval(*self._context_arrays())
        self.catch_up_ms += 1000 * (time.perf_counter() - start)

    def take_catch_up_ms(self) -> float:
        """The catch-up time since the last call (decode.py hands it to the length policy's `untimed`)."""
        ms, self.catch_up_ms = self.catch_up_ms, 0.0
        return ms

    def propose(
        self, anchor: mx.array, *, position: int, num_tokens: int, logits_hook: Callable | None = None
    ) -> Proposal:
        self._catch_up()
        return self.draft.propose(
            anchor, self.context, target=self.target, greedy=self.greedy, temperature=self.temperature,
            num_tokens=num_tokens, logits_hook=logits_hook,
        )  # fmt: skip

    def tree_children(self, anchor: mx.array, *, position: int, depth: int) -> Any:
        """The draft's distributions for a token tree `depth` deep after `anchor` (engine/tree.grow_tree's
        `children`): the Markov head's conditional logits per parent (models/heads/dspark/tree.py)."""
        self._catch_up()
        return self.draft.tree_children(anchor, self.context, target=self.target, depth=depth)
