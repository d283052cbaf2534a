"""The proposer over a target's own MTP layers (models/heads/mtp/qwen3_5.py, mtp_qwen3_next.py, mtp_deepseek.py,
mtp_mimo.py, mtp_nemotron_h.py): a chain_propose.ChainProposer whose features are the target's final hidden
states (tap `FINAL_TAP`). The MTP module says what its output is (Qwen, MiMo, Nemotron-H: normed; DeepSeek /
GLM: pre-norm), which embedding and head it reads (`embed`, `logits`: its own copies or the target's) and which
layer step k runs (`step=`).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from mlx_dspark.engine.proposers.chain_context import ChainContext
from mlx_dspark.engine.proposers.base import CHAIN
from mlx_dspark.engine.proposers.chain import ChainProposer
from mlx_dspark.models.layers.base import FINAL_TAP

DEFAULT_CHAIN = 4  # the most MTP steps per proposal (acceptance falls fast with depth: DRAFTERS.md section 2)
COST_KIND = CHAIN


def default_block(mtp: Any) -> int:
    return DEFAULT_CHAIN


def make_proposer(mtp: Any, target: Any, *, prompt: Sequence[int], greedy: bool, temperature: float,
                  block_size: int | None = None, prompt_cache: Any = None) -> "MTPProposer":  # fmt: skip
    context = None if prompt_cache is None else prompt_cache.chain_context("mtp", mtp.make_cache)
    return MTPProposer(mtp, target, prompt=prompt, greedy=greedy, temperature=temperature,
                       block_size=block_size or DEFAULT_CHAIN, context=context)  # fmt: skip


class MTPProposer(ChainProposer):
    def __init__(self, mtp: Any, target: Any, *, prompt: Sequence[int], greedy: bool, temperature: float,
                 block_size: int = DEFAULT_CHAIN, context: ChainContext | None = None) -> None:
        super().__init__(prompt=prompt, greedy=greedy, temperature=temperature, block_size=block_size, what="MTP",
                         make_cache=mtp.make_cache, context=context)  # fmt: skip
        self.mtp, self.target = mtp, target
        self.module = mtp  # the drafter a batch's packed chain step runs (models/packed/chain.py)
        self.tap_ids = (FINAL_TAP,)

    def _entries(self, next_ids: mx.array, features: mx.array) -> mx.array:
        return self.mtp(self.mtp.embed(next_ids, self.target), features, self.cache)

    def _step(self, token_ids: mx.array, hidden: mx.array, step: int = 0, cache: list | None = None) -> mx.array:
        return self.mtp(self.mtp.embed(token_ids, self.target), hidden, self.cache if cache is None else cache, step=step)

    def _logits(self, hidden: mx.array, step: int = 0) -> mx.array:
        return self.mtp.logits(hidden, self.target, step=step)
