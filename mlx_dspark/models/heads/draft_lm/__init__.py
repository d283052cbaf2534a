"""A small causal LM of the target's vocabulary as a draft head (mlx-lm's `--draft-model`, LM Studio's draft
model, llama.cpp's `-md`): mlx-lm's own model of the draft's config, over its own caches.

What is ours is thin: `DraftLM` holds mlx-lm's model, gives its caches (`make_cache`: mlx-lm's own, each of
a kind `models/caches/rollback` rolls back), and its logits over the target's vocabulary (a draft table
padded or cut to the target's rows: a padded id is never drafted, a cut one is no token of the shared
tokenizer). Its caches go back after speculative steps with models/caches/snapshot's `cache_states` /
`restore_caches`, exactly for every cache kind (trimmable KV caches move their offset; rotating windows and a
hybrid draft's recurrent / conv states are restored from the state kept before the steps). A batch's rows
take their chain steps together (`packed`: models/packed/lm_steps.py) where its probe passes (`packing_problem`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_dspark.models.caches.rollback import cache_kind
from mlx_dspark.models.packed.lm_steps import packed_steps, steps_packing_problem


class DraftLM(nn.Module):
    """mlx-lm's `model` (any causal LM mlx-lm runs) drafting over a target of `vocab_size` ids."""

    def __init__(self, model: nn.Module, *, vocab_size: int, model_type: str):
        super().__init__()
        self.model = model  # parameters under `model.`: mlx-lm's own names below it
        self.vocab_size = int(vocab_size)
        self.model_type = model_type

    def make_cache(self) -> list[Any]:
        """mlx-lm's own caches of the draft; a kind with no exact rollback is refused here (cache_kind)."""
        caches = make_prompt_cache(self.model)
        for c in caches:
            cache_kind(c)
        return caches

    def __call__(self, ids: mx.array, cache: list[Any]) -> mx.array:
        """Logits (B, L, V) over the target's vocabulary, float32, of tokens `ids` (B, L) after the cache's."""
        logits = self.model(ids, cache=cache).astype(mx.float32)
        own = logits.shape[-1]
        if own > self.vocab_size:
            return logits[..., : self.vocab_size]
        if own < self.vocab_size:  # ids past the draft's table: never drafted (probability 0)
            pad = mx.full((*logits.shape[:-1], self.vocab_size - own), -mx.inf, dtype=logits.dtype)
            return mx.concatenate([logits, pad], axis=-1)
        return logits

    def packed(self, ids: mx.array, caches: Sequence[list]) -> mx.array:
        """Logits (b, 1, V) of one token per sequence, ids (b, 1), sequence i after its own caches `caches[i]`:
        one forward of mlx-lm's model for the b rows (models/packed/lm_steps.py)."""
        return packed_steps(self.model, lambda views: self(ids, views), caches, name=self._name)

    def packing_problem(self) -> Optional[str]:
        """Why `packed` cannot stand for the rows' own steps (its probe, run once per model), or None."""
        return steps_packing_problem(self.model, lambda ids, caches: self.model(ids, cache=caches),
                                     make_cache=self.make_cache, vocab=self.vocab_size, name=self._name)  # fmt: skip

    @property
    def _name(self) -> str:
        return f"the draft model (model_type {self.model_type!r})"
