"""Target caches: rolling back a list of them (`trim_caches`), the quantized KV cache `kv_bits` gives.

A target's caches are mlx-lm's own (`make_cache` of its model) in a `models/rollback.RollbackCaches`,
which rolls back every kind exactly; a plain list of trimmable caches (a chained head's own) moves their
offsets back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.cache import QuantizedKVCache as _MlxLmQuantizedKVCache


class QuantizedKVCache(_MlxLmQuantizedKVCache):
    """mlx-lm's quantized cache (trim = move the offset back), whose `nbytes` also works while empty
    (mlx-lm's reads the missing buffers; a prompt cache's size is asked before its first prefill)."""

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else super().nbytes


KV_BITS = (4, 8)
KV_GROUP_SIZES = (64, 32)  # mlx-lm's default first; a group never spans two heads


def check_kv_bits(bits: Optional[int]) -> None:
    if bits is not None and bits not in KV_BITS:
        raise ValueError(f"kv_bits {bits!r} is not supported; expected one of {KV_BITS}, or none for float caches")


def kv_group_size(head_dim: int) -> int:
    """The quantization group of a head's keys / values: 64 when it divides head_dim, else 32."""
    for size in KV_GROUP_SIZES:
        if head_dim % size == 0:
            return size
    raise ValueError(f"kv_bits needs a head_dim divisible by {' or '.join(map(str, KV_GROUP_SIZES))}, got head_dim {head_dim}")


def trim_caches(caches: Sequence[Any], n: int) -> int:
    """Roll every cache back `n` positions, or none of them (ValueError) if one cannot.

    A `models/rollback.RollbackCaches` (any mlx-lm cache kind, hybrids included) rolls itself back exactly.
    """
    if n < 0:
        raise ValueError(f"trim_caches: n must be >= 0, got {n}")
    rollback = getattr(caches, "rollback", None)
    if rollback is not None:
        return rollback(n)
    for i, cache in enumerate(caches):
        if not cache.is_trimmable():
            raise ValueError(f"trim_caches: cache {i} ({type(cache).__name__}) cannot be trimmed")
        if n > cache.offset:
            raise ValueError(f"trim_caches: cannot roll back {n} positions; cache {i} holds {cache.offset}")
    for cache in caches:
        cache.trim(n)
    return n


def rollback_limit(caches: Sequence[Any], *, unbounded: int = 1 << 30) -> int:
    """The most positions `trim_caches` can roll back right after an update (a speculative round's
    rejected drafts): the smallest `max_rollback` among the caches; `unbounded` when none has one."""
    return min([int(c.max_rollback) for c in caches if getattr(c, "max_rollback", None) is not None] or [unbounded])


def kv_rows(cache: Any) -> tuple[mx.array, mx.array]:
    """The keys and values (B, H, n, D) a float KV cache holds now, oldest first, none past its offset (a
    rolled-back cache's rejected rows stay in its buffer): a KVCache's first `offset` rows, a RotatingKVCache's
    held window in temporal order. What a drafter that reads the target's K/V (a Gemma 4 assistant) attends to."""
    if isinstance(cache, RotatingKVCache):
        if cache.keys is None:
            raise ValueError("kv_rows: the rotating cache is empty")
        keys, values = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
        held = min(keys.shape[2], cache.offset)
        return keys[..., keys.shape[2] - held :, :], values[..., values.shape[2] - held :, :]
    if type(cache) is KVCache:
        if cache.keys is None:
            raise ValueError("kv_rows: the KV cache is empty")
        return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
    raise ValueError(f"kv_rows: the keys and values of a {type(cache).__name__} are not read here (float KVCache / RotatingKVCache only)")
