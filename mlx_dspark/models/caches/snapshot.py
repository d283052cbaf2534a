"""A cache list's state kept and put back around steps no forward records: a probe's plain steps, a drafter's
chained steps (a draft model's over its own caches, self-speculation's over the target's). Every cache kind
`rollback` knows: trimmable caches move their offset, rotating windows and recurrent / conv states are restored."""

from __future__ import annotations

from typing import Any, Sequence

from mlx_dspark.models.caches.rollback import TRIM, LayerState, cache_kind, layer_state, restore_layer


def trims_exactly(caches: Sequence[Any]) -> bool:
    """Whether every cache goes back any number of positions by trimming (full-attention KV caches only)."""
    return all(cache_kind(c) == TRIM for c in caches)


def cache_states(caches: Sequence[Any]) -> list[LayerState]:
    """Every layer's state now, for `restore_caches` after unrecorded steps (a probe's, a drafter's chain)."""
    return [layer_state(c, copy=True) for c in caches]


def snapshot_caches(caches: Sequence[Any]) -> list[LayerState] | None:
    """`cache_states` when some cache cannot trim a width-1 forward (a hybrid's; never recorded), else None."""
    return None if trims_exactly(caches) else cache_states(caches)


def restore_caches(caches: Sequence[Any], saved: Sequence[LayerState], *, copy: bool = True) -> None:
    """Every cache back to `saved`; `copy` False where `saved` is restored once (its buffers taken as they are)."""
    for cache, state in zip(caches, saved):
        restore_layer(cache, state, copy=copy)
