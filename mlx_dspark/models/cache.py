"""Target KV caches with rollback: mlx-lm's `KVCache` for full layers, `SlidingKVCache` for sliding ones.

Rollback is "move the offset back" (`trim(n)`). mlx-lm's `RotatingKVCache` cannot be trimmed once it
wrapped, so sliding layers use `SlidingKVCache`: positions stay in order in a preallocated buffer and
the front is dropped only when the buffer fills, always keeping `window + max_rollback` positions so
that a rollback of up to `max_rollback` never loses a key still inside the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm.models.cache import QuantizedKVCache as _MlxLmQuantizedKVCache

from mlx_dspark.models.layer_types import FULL_ATTENTION, SLIDING_ATTENTION


class SlidingKVCache:
    """Bounded KV cache for a sliding-window layer, trimmable by up to `max_rollback` at any time.

    `update_and_fetch(keys, values)` appends the new positions and returns the keys and values the new
    queries can see: positions `[max(0, q_start - window + 1), offset)` with `q_start` the first new
    position and `offset` the cache offset after the update (so they always end with the new ones).
    Memory: at most `window + max_rollback` kept positions plus `max(step, largest update)`.
    """

    step = 256

    def __init__(self, window: int, *, max_rollback: int = 8):
        if window < 1:
            raise ValueError(f"SlidingKVCache: window must be >= 1, got {window}")
        if max_rollback < 0:
            raise ValueError(f"SlidingKVCache: max_rollback must be >= 0, got {max_rollback}")
        self.window = window
        self.max_rollback = max_rollback
        self.keys: Optional[mx.array] = None  # (B, H, capacity, D) buffer
        self.values: Optional[mx.array] = None
        self.offset = 0  # position after the last cached one
        self._len = 0  # buffer rows in use: positions offset - _len .. offset - 1

    def _make_room(self, keys: mx.array, values: mx.array) -> None:
        # New buffer holding the last window + max_rollback positions, then room for this update.
        num_new = keys.shape[2]
        keep = min(self._len, self.window + self.max_rollback)
        capacity = keep + max(num_new, self.step)
        B, H, _, Dk = keys.shape
        new_keys = mx.zeros((B, H, capacity, Dk), keys.dtype)
        new_values = mx.zeros((B, H, capacity, values.shape[3]), values.dtype)
        if keep:
            new_keys[..., :keep, :] = self.keys[..., self._len - keep : self._len, :]
            new_values[..., :keep, :] = self.values[..., self._len - keep : self._len, :]
        self.keys, self.values, self._len = new_keys, new_values, keep

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        num_new = keys.shape[2]  # keys, values: (B, H, L, D)
        if self.keys is None or self._len + num_new > self.keys.shape[2]:
            self._make_room(keys, values)
        self.keys[..., self._len : self._len + num_new, :] = keys
        self.values[..., self._len : self._len + num_new, :] = values
        self._len += num_new
        self.offset += num_new
        # The first new query (at offset - num_new) sees back to offset - num_new - window + 1.
        first = max(0, self._len - (self.window - 1 + num_new))
        return self.keys[..., first : self._len, :], self.values[..., first : self._len, :]

    def trimmable(self) -> int:
        """How many positions `trim` may remove now.

        `max_rollback` right after an update as long as each earlier rollback stayed within its own
        update (the speculative loop's case: verify l + 1 positions, roll back at most l).
        """
        if self._len == self.offset:  # nothing dropped yet
            return min(self.max_rollback, self.offset)
        # Positions were dropped: the kept ones must still cover the next query's window.
        return min(self.max_rollback, max(0, self._len - (self.window - 1)))

    def trim(self, n: int) -> int:
        """Move the offset back `n` positions (the rolled-back tail is overwritten later); returns `n`."""
        if n < 0:
            raise ValueError(f"SlidingKVCache.trim: n must be >= 0, got {n}")
        if n > self.max_rollback:
            raise ValueError(f"SlidingKVCache.trim: cannot roll back {n} positions; max_rollback is {self.max_rollback}")
        n = min(n, self.offset)
        if n > self.trimmable():
            raise ValueError(
                f"SlidingKVCache.trim: rolling back {n} positions would drop keys still inside the window "
                f"({self._len} kept, window {self.window}); roll back at most {self.max_rollback} between updates"
            )
        self._len -= n
        self.offset -= n
        return n

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    @property
    def state(self) -> tuple[Optional[mx.array], Optional[mx.array], int]:
        """(kept keys, kept values, offset): the kept rows are positions `offset - len .. offset - 1`."""
        if self.keys is None:
            return None, None, self.offset
        return self.keys[..., : self._len, :], self.values[..., : self._len, :], self.offset

    @state.setter
    def state(self, value: tuple[Optional[mx.array], Optional[mx.array], int]) -> None:
        self.keys, self.values, self.offset = value
        self._len = 0 if self.keys is None else self.keys.shape[2]

    def snapshot(self) -> tuple[Optional[mx.array], Optional[mx.array], int]:
        """A copy of what the next query needs: the last `window - 1` positions (all, if fewer), and the offset.

        Copies, so the snapshot owns its memory and later updates of this cache never touch it.
        """
        rows = min(self._len, self.window - 1)
        assert rows >= min(self.offset, self.window - 1), "the kept rows no longer cover the window"
        if rows == 0:
            return None, None, self.offset
        keys = mx.array(self.keys[..., self._len - rows : self._len, :])
        values = mx.array(self.values[..., self._len - rows : self._len, :])
        return keys, values, self.offset

    def restore(self, snapshot: tuple[Optional[mx.array], Optional[mx.array], int]) -> None:
        """Go back to a `snapshot()` (copied again: the snapshot stays usable)."""
        keys, values, offset = snapshot
        if keys is None:
            self.state = (None, None, offset)
        else:
            self.state = (mx.array(keys), mx.array(values), offset)


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


def make_target_cache(
    layer_types: Sequence[str],
    *,
    window: Optional[int],
    max_rollback: int = 8,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
) -> list[Any]:
    """One cache per layer: `KVCache` for full layers, `SlidingKVCache(window)` for sliding ones.

    kv_bits: full layers get mlx-lm's `QuantizedKVCache` instead (trimmable: rollback moves its offset);
    sliding layers keep float caches (bounded by their window, they are not where long contexts grow).
    """
    check_kv_bits(kv_bits)
    caches: list[Any] = []
    for i, layer_type in enumerate(layer_types):
        if layer_type == FULL_ATTENTION:
            caches.append(KVCache() if kv_bits is None else QuantizedKVCache(group_size=kv_group_size, bits=kv_bits))
        elif layer_type == SLIDING_ATTENTION:
            if window is None:
                raise ValueError(f"layer {i} is {SLIDING_ATTENTION!r} but no sliding_window is set")
            caches.append(SlidingKVCache(window, max_rollback=max_rollback))
        else:
            raise ValueError(f"layer {i} has layer type {layer_type!r}; expected one of {FULL_ATTENTION!r}, {SLIDING_ATTENTION!r}")
    return caches


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
        if isinstance(cache, SlidingKVCache) and n > cache.trimmable():
            raise ValueError(
                f"trim_caches: cache {i} can roll back at most {cache.trimmable()} positions now, asked for {n}"
            )
    for cache in caches:
        cache.trim(n)
    return n


def rollback_limit(caches: Sequence[Any], *, unbounded: int = 1 << 30) -> int:
    """The most positions `trim_caches` can roll back right after an update (a speculative round's
    rejected drafts): the smallest `max_rollback` among the caches; `unbounded` when none has one."""
    return min([int(c.max_rollback) for c in caches if getattr(c, "max_rollback", None) is not None] or [unbounded])
