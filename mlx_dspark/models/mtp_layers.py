"""What every MTP module shares (models/mtp_qwen3_5.py, mtp_deepseek.py, mtp_mimo.py): a list of layers,
one KV cache each, and the target's embedding for the tokens it reads (a module with its own copy overrides
`embed`). The proposer (engine/mtp_propose.py) reads only this and each module's `__call__` / `logits`."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache


class MTPLayers(nn.Module):
    layers: list

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def embed(self, ids: mx.array, target: Any) -> mx.array:
        return target.embed(ids)
