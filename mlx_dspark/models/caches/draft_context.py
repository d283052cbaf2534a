"""The DSpark draft's per-layer context cache: keys/values of committed positions, in position order.

Context K/V are computed once per committed position and never rolled back (the loop appends only
accepted positions). A `sliding_attention` layer keeps only the positions a block can still see, so
its memory stays flat however long the conversation grows; a `full_attention` layer keeps them all.
"""

from __future__ import annotations

import mlx.core as mx


def context_keep(window: int | None) -> int | None:
    """How many context positions a layer must keep (None: all).

    A block query at `q >= p` sees a context position `t < p` iff `q - t < window`; the earliest such
    `t` over the block is `p - window + 1` (for `q = p`), so `window - 1` positions suffice.
    """
    if window is None:
        return None
    return max(window - 1, 0)


class ContextCache:
    """Context keys/values of one draft layer: `(B, kv_heads, n, head_dim)` for positions `[start, offset)`."""

    step = 256

    def __init__(self, *, window: int | None = None):
        self.window = window
        self.keep = context_keep(window)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0  # positions appended so far: the next anchor's position
        self._used = 0  # filled slots of the buffers

    @property
    def length(self) -> int:
        """Number of context positions `fetch` returns."""
        return self._used if self.keep is None else min(self._used, self.keep)

    @property
    def start(self) -> int:
        """Position of the first context position `fetch` returns."""
        return self.offset - self.length

    @property
    def capacity(self) -> int:
        """Positions the buffers can hold (memory), for tests of the bound."""
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: mx.array, values: mx.array, *, num_positions: int | None = None) -> None:
        """Append the K/V of the next `num_positions` positions (default: as many as `keys` rows).

        `keys` may hold only the last rows of those positions when the layer would drop the others.
        """
        rows = keys.shape[2]
        num_positions = rows if num_positions is None else num_positions
        needed = num_positions if self.keep is None else min(num_positions, self.keep)
        assert needed <= rows <= num_positions, "context rows must cover the positions the layer keeps"
        self.offset += num_positions
        if self.keep is not None and rows >= self.keep:
            # The new rows alone fill the window: drop everything older.
            self.keys = keys[..., rows - self.keep :, :]
            self.values = values[..., rows - self.keep :, :]
            self._used = self.keep
            return
        if self.keys is None or self._used + rows > self.keys.shape[2]:
            self._grow(keys, values, rows)
        self.keys[..., self._used : self._used + rows, :] = keys
        self.values[..., self._used : self._used + rows, :] = values
        self._used += rows

    def advance(self, num_positions: int) -> None:
        """Count positions that a layer keeping none of its context (window 1) never stores."""
        assert self.keep == 0, "only a layer that keeps no context may skip positions"
        self.offset += num_positions

    def _grow(self, keys: mx.array, values: mx.array, rows: int) -> None:
        # New buffers holding the kept positions plus room for this append and a step more.
        kept = self.length
        if self.keep is None:
            capacity = ((kept + rows) // self.step + 1) * self.step
        else:
            capacity = self.keep + max(rows, self.step)
        batch, heads, _, k_dim = keys.shape
        new_keys = mx.zeros((batch, heads, capacity, k_dim), keys.dtype)
        new_values = mx.zeros((batch, heads, capacity, values.shape[3]), values.dtype)
        if kept:
            new_keys[..., :kept, :] = self.keys[..., self._used - kept : self._used, :]
            new_values[..., :kept, :] = self.values[..., self._used - kept : self._used, :]
        self.keys, self.values, self._used = new_keys, new_values, kept

    def fetch(self) -> tuple[mx.array, mx.array] | None:
        """The kept context keys and values (positions `[start, offset)`), or None when empty."""
        if self.length == 0:
            return None
        lo = self._used - self.length
        return self.keys[..., lo : self._used, :], self.values[..., lo : self._used, :]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def trimmable(self) -> int:
        """How many positions `trim` may remove now without losing one a block could still see."""
        if self.keep is None or self.keep == 0 or self._used == self.offset:
            return self.offset  # all positions stored, or none needed
        return max(0, self._used - self.keep)

    def trim(self, n: int) -> None:
        """Forget the last `n` positions (a prompt cache rewinding to a shared prefix)."""
        if not 0 <= n <= self.trimmable():
            raise ValueError(f"ContextCache.trim: can remove 0 .. {self.trimmable()} positions now, asked for {n}")
        if self.keep != 0:
            self._used -= n
        self.offset -= n

    def snapshot(self) -> tuple[mx.array | None, mx.array | None, int]:
        """Copies of the positions `fetch` returns, and the offset (for a windowed layer: small)."""
        kept = self.fetch()
        if kept is None:
            return None, None, self.offset
        return mx.array(kept[0]), mx.array(kept[1]), self.offset

    def restore(self, snapshot: tuple[mx.array | None, mx.array | None, int]) -> None:
        """Go back to a `snapshot()`; `(None, None, 0)` empties the cache."""
        keys, values, offset = snapshot
        rows = 0 if keys is None else keys.shape[2]
        needed = offset if self.keep is None else min(offset, self.keep)
        assert needed <= rows <= offset, "a snapshot must hold the positions this layer keeps"
        self.keys = None if keys is None else mx.array(keys)
        self.values = None if values is None else mx.array(values)
        self.offset, self._used = offset, rows
