"""One request's grammar state (an llguidance matcher) and its token masks for the round.

The matcher holds the committed tokens. Masks for a prefix beyond them (draft tokens) are computed by
consuming the prefix and rolling it back, so the committed state never moves until `commit`. A mask is
a bitmask row, one bit per vocabulary id (int32 words, llguidance's layout); `apply_masks` turns rows
into -inf on the device. Masks computed while drafting are kept (keyed by the draft prefix) and reused
by the verify pass of the same round.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import mlx.core as mx
import numpy as np


class GrammarState:
    def __init__(self, matcher: Any, *, vocab_size: int, eos_ids: Sequence[int]) -> None:
        import llguidance

        self.matcher = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_ids = tuple(int(t) for t in eos_ids)
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._cache: dict[tuple[int, ...], np.ndarray] = {}  # draft prefix -> mask row, this round only
        self._stopped: dict[tuple[int, ...], bool] = {}  # draft prefix -> the grammar has ended after it
        self._forced: list[int] | None = None  # the forced run after the committed tokens, once per round
        self.masks_computed = 0  # for the benchmark's overhead figures
        self.host_seconds = 0.0  # time spent in mask() / masks() / valid_prefix / commit, likewise

    # -- committed state ---------------------------------------------------------------------------

    def can_start(self) -> bool:
        """Some first token is legal (or the empty output already matches)."""
        row = np.zeros((self.words,), np.int32)
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        for token in self.eos_ids:  # llguidance allows end-of-sequence in a dead state: it does not count
            row[token // 32] &= ~np.int32(np.uint32(1 << (token % 32)).view(np.int32))
        return bool(row.any()) or self.matcher.is_accepting()

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance over committed tokens (all legal: they were drawn from masked distributions)."""
        self._cache.clear()
        self._stopped.clear()
        self._forced = None
        for token in tokens:
            if self.matcher.is_stopped():
                return  # an end-of-sequence token after the grammar's end: the generation stops here
            ok = self.matcher.consume_token(int(token))
            assert ok, f"committed token {token} is illegal: {self.matcher.get_error()}"

    @property
    def finished(self) -> bool:
        """The grammar has ended: only an end-of-sequence token may follow."""
        return self.matcher.is_stopped()

    def forced(self) -> list[int]:
        """The tokens the grammar forces after the committed ones: llguidance's fast-forward tokens (the
        canonical tokenisation of the only bytes that may follow), [] when there is a choice or it ended."""
        if self._forced is None:
            started = time.perf_counter()
            self._forced = [] if self.matcher.is_stopped() else [int(t) for t in self.matcher.compute_ff_tokens()]
            self.host_seconds += time.perf_counter() - started
        return self._forced

    # -- masks beyond the committed state ------------------------------------------------------------

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a draft) the grammar allows in a row from the committed state."""
        started = time.perf_counter()
        valid = self.matcher.validate_tokens(list(tokens)) if tokens else 0
        self.host_seconds += time.perf_counter() - started
        return valid

    def mask(self, prefix: Sequence[int]) -> np.ndarray:
        """The mask row (words,) after the committed tokens + `prefix` (a legal draft prefix)."""
        key = tuple(int(t) for t in prefix)
        row = self._cache.get(key)
        if row is None:
            started = time.perf_counter()
            row = np.zeros((1, self.words), np.int32)
            consumed = self.matcher.try_consume_tokens(list(key)) if key else 0
            # Only a prefix ending in end-of-sequence at the grammar's end stops short; nothing follows it.
            if consumed == len(key):
                self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            self._stopped[key] = consumed < len(key) or self.matcher.is_stopped()
            if consumed:
                self.matcher.rollback(consumed)
            row = self._finish(row[0])
            self._cache[key] = row
            self.host_seconds += time.perf_counter() - started
        return row

    def ends_after(self, prefix: Sequence[int]) -> bool:
        """Whether the grammar has ended after the committed tokens + `prefix`."""
        key = tuple(int(t) for t in prefix)
        if key not in self._stopped:
            consumed = self.matcher.try_consume_tokens(list(key)) if key else 0
            self._stopped[key] = consumed < len(key) or self.matcher.is_stopped()
            if consumed:
                self.matcher.rollback(consumed)
        return self._stopped[key]

    def masks(self, draft: Sequence[int]) -> np.ndarray:
        """Mask rows (len(draft) + 1, words) after each prefix draft[:j], j = 0..len(draft)."""
        draft = [int(t) for t in draft]
        missing = [j for j in range(len(draft) + 1) if tuple(draft[:j]) not in self._cache]
        if len(missing) > 1:
            started = time.perf_counter()
            # one native call walks the whole draft (it consumes and rolls back itself)
            rows = np.zeros((len(draft) + 1, self.words), np.int32)
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                [(self.matcher, 0, draft)], rows.ctypes.data, rows.shape[1] * 4, rows.shape[0]
            )
            for j in range(len(draft) + 1):
                self._cache[tuple(draft[:j])] = self._finish(rows[j])
            self.host_seconds += time.perf_counter() - started
        return np.stack([self.mask(draft[:j]) for j in range(len(draft) + 1)])

    def _finish(self, row: np.ndarray) -> np.ndarray:
        # A row with no legal token only happens at the grammar's end: let it end there (EOS), never NaN.
        self.masks_computed += 1
        if not row.any():
            row = row.copy()
            for token in self.eos_ids:
                row[token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
        return row


def allow_only(logits: mx.array, token: int) -> mx.array:
    """logits (n, V) with -inf everywhere but at `token` (a forced position)."""
    return mx.where(mx.arange(logits.shape[-1]) == token, logits, mx.array(-mx.inf, logits.dtype))


def apply_masks(logits: mx.array, masks: np.ndarray) -> mx.array:
    """logits (n, V) with -inf where the rows of `masks` (n, words) have a 0 bit."""
    vocab = logits.shape[-1]
    words = mx.array(masks)  # (n, W) int32
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1  # (n, W, 32)
    allowed = bits.reshape(words.shape[0], -1)[:, :vocab].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))
