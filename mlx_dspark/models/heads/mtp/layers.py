"""What every MTP module shares (models/heads/mtp/qwen3_5.py, mtp_qwen3_next.py, mtp_deepseek.py, mtp_mimo.py,
mtp_nemotron_h.py): a list of layers, one KV cache each (Nemotron-H: one per attention layer of its block), and
the target's embedding for the tokens it reads (a module with its own copy overrides `embed`). The proposer
(engine/proposers/mtp.py) reads only this and each module's `__call__` / `logits`."""

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

    def step_inputs(self, embeddings: mx.array, cache: Any, step: int) -> tuple[Any, Any, mx.array]:
        """(layer `step` mod n, its cache, the embeddings with position 0's zeroed: the entry at position 0
        has no embedding, as vLLM's next-n / MiMo layers run it)."""
        index = step % len(self.layers)
        layer, c = self.layers[index], (cache[index] if cache else None)
        # a packed chain step's offset is every row's position (models/packed/chain.py): never a first entry
        if c is None or (isinstance(c.offset, int) and c.offset == 0):
            embeddings = mx.concatenate([mx.zeros_like(embeddings[:, :1]), embeddings[:, 1:]], axis=1)
        return layer, c, embeddings
