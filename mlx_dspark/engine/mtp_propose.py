"""The proposer over a target's own MTP layers (models/mtp_qwen3_5.py): a chain_propose.ChainProposer whose
features are the target's final hidden states (tap `FINAL_TAP`), embedding and LM head the target's own.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from mlx_dspark.engine.chain_propose import ChainProposer
from mlx_dspark.models.base import FINAL_TAP

DEFAULT_CHAIN = 4  # the most MTP steps per proposal (acceptance falls fast with depth: DRAFTERS.md section 2)


class MTPProposer(ChainProposer):
    def __init__(self, mtp: Any, target: Any, *, prompt: Sequence[int], greedy: bool, temperature: float,
                 block_size: int = DEFAULT_CHAIN) -> None:
        super().__init__(prompt=prompt, greedy=greedy, temperature=temperature, block_size=block_size, what="MTP")
        self.mtp, self.target = mtp, target
        self.tap_ids = (FINAL_TAP,)
        self.cache = mtp.make_cache()

    def _entries(self, next_ids: mx.array, features: mx.array) -> mx.array:
        return self.mtp(self.target.embed(next_ids), features, self.cache)

    def _step(self, token_ids: mx.array, hidden: mx.array) -> mx.array:
        return self.mtp(self.target.embed(token_ids), hidden, self.cache)

    def _logits(self, hidden: mx.array) -> mx.array:
        return self.target.lm_head_logits(hidden)
