"""The proposer over an EAGLE-3 draft (models/heads/eagle3/model.py): a chain_propose.ChainProposer whose features are
the target's three aux layers, fused by the draft's `fc`; chained steps feed the layer's own pre-norm
output back (not through `fc`), as vLLM's proposer does.

Taps: EAGLE's hidden-state index i (0 the embedding output, i the input of layer i) is our tap i - 1
(models/base.check_tap_ids counts layer outputs, -1 the embedding): `Eagle3Args.tap_ids`. Logits are the
draft's rows scattered onto the target's vocabulary by `d2t` (-inf elsewhere), so sampled drafting's
`draft_probs` are over the whole vocabulary, zero outside the draft's rows.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx

from mlx_dspark.engine.proposers.chain_context import ChainContext
from mlx_dspark.engine.proposers.base import CHAIN
from mlx_dspark.engine.proposers.chain import ChainProposer

DEFAULT_TOKENS = 3  # drafts per proposal when the config names no speculative_tokens (speculators' ttt_steps)


COST_KIND = CHAIN


def default_block(draft: Any) -> int:
    """The chain length the draft was trained for (`speculative_tokens`), else DEFAULT_TOKENS."""
    return draft.args.speculative_tokens or DEFAULT_TOKENS


def make_proposer(draft: Any, target: Any, *, prompt: Sequence[int], greedy: bool, temperature: float,
                  block_size: int | None = None, prompt_cache: Any = None) -> "Eagle3Proposer":  # fmt: skip
    context = None if prompt_cache is None else prompt_cache.chain_context("eagle3", draft.make_cache)
    return Eagle3Proposer(draft, target, prompt=prompt, greedy=greedy, temperature=temperature,
                          block_size=block_size or default_block(draft), context=context)  # fmt: skip


class Eagle3Proposer(ChainProposer):
    def __init__(self, draft: Any, target: Any, *, prompt: Sequence[int], greedy: bool, temperature: float,
                 block_size: Optional[int] = None, context: ChainContext | None = None) -> None:
        size = default_block(draft) if block_size is None else block_size
        super().__init__(prompt=prompt, greedy=greedy, temperature=temperature, block_size=size, what="EAGLE-3",
                         make_cache=draft.make_cache, context=context)  # fmt: skip
        self.draft, self.target = draft, target
        self.module = draft  # the drafter a batch's packed chain step runs (models/packed/chain.py)
        self.tap_ids = draft.args.tap_ids(target.args.num_hidden_layers)

    def _entries(self, next_ids: mx.array, features: mx.array) -> mx.array:
        return self.draft(self.draft.embed(next_ids, self.target), self.draft.fuse(features), self.cache)

    def _step(self, token_ids: mx.array, hidden: mx.array, step: int = 0, cache: list | None = None) -> mx.array:
        return self.draft(self.draft.embed(token_ids, self.target), hidden, self.cache if cache is None else cache)

    def _logits(self, hidden: mx.array, step: int = 0) -> mx.array:
        return self.draft.logits(hidden)
