"""A reduced draft vocabulary (`d2t`): the draft's own LM head and Markov `W2` have one row per draft
token, and `d2t` maps draft row i to a target token id (EAGLE-3 / SpecForge exports).

Checkpoints store `d2t` as offsets (target id = d2t[i] + i; GGUF files hold the absolute ids, which
our GGUF reader turns back into offsets). The draft keeps the absolute ids as `draft_to_target`.
Drafting picks among the draft rows and maps the pick to the target id, which is what upstream's
runtime computes by scattering the draft logits into the target vocabulary with -inf elsewhere
(src/models/dflash.cpp); a distribution over the draft rows becomes one over the target vocabulary
with zeros outside the table.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

CHECKPOINT_NAME = "d2t"  # offsets, as stored
PARAMETER_NAME = "draft_to_target"  # absolute target ids, as the draft holds them
DROPPED = ("t2d",)  # the inverse table: not used for drafting


def absolute_ids(offsets: np.ndarray, *, vocab_size: int, draft_vocab_size: int, source: str) -> np.ndarray:
    """Target ids (int32) of the draft rows from stored offsets; ValueError naming what does not fit."""
    offsets = np.asarray(offsets).reshape(-1)
    if offsets.dtype.kind not in "iu":
        raise ValueError(f"{source}: tensor 'd2t' must hold integers, got {offsets.dtype}")
    if offsets.size != draft_vocab_size:
        raise ValueError(f"{source}: tensor 'd2t' has {offsets.size} entries but draft_vocab_size is {draft_vocab_size}")
    ids = offsets.astype(np.int64) + np.arange(offsets.size, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{source}: tensor 'd2t' maps to target ids outside [0, {vocab_size}) (entries are offsets: id = d2t[i] + i)")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"{source}: tensor 'd2t' maps two draft rows to the same target id")
    return ids.astype(np.int32)


def to_target(draft_rows: mx.array, draft_to_target: mx.array) -> mx.array:
    """Draft row indices (any shape) -> target token ids."""
    return mx.take(draft_to_target, draft_rows.astype(mx.int32), axis=0)


def scatter_probs(probs: mx.array, draft_to_target: mx.array, vocab_size: int) -> mx.array:
    """A distribution over the draft rows (..., Vd) -> over the target vocabulary (..., V), zeros elsewhere."""
    lead = probs.shape[:-1]
    full = mx.zeros((*lead, vocab_size), dtype=probs.dtype)
    index = mx.broadcast_to(draft_to_target.reshape(*([1] * len(lead)), -1), probs.shape)
    return mx.put_along_axis(full, index, probs, axis=-1)
