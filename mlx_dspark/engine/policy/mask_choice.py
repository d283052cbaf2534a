"""`mask_draft="auto"`: per request, draft under the grammar's mask or unmasked, whichever measures faster.

A masked draft proposes only legal tokens (higher acceptance) but reads the host once per unforced draft
position; an unmasked draft costs one read per round and is cut at its first forbidden token. Which wins
depends on the grammar, the text and the machine (benchmarks/RESULTS.md sections 12 and 13), so the
request measures both: committed tokens per second of round (the time between two commits, so every
host read and forward counts), a few rounds each, then the faster mode, re-trying the other one every
`explore_every` rounds. Either mode is lossless: the choice only moves speed.
"""

from __future__ import annotations

import time

WARMUP = 3  # rounds measured per mode before choosing
SMOOTHING = 0.3  # weight of the newest round in a mode's rate


class MaskChoice:
    def __init__(self, *, explore_every: int = 16, clock=time.perf_counter) -> None:
        self.explore_every = explore_every
        self.clock = clock
        self.masked = True  # the mode of the round in flight
        self.rates: dict[bool, float | None] = {True: None, False: None}  # tokens per second
        self.counts = {True: 0, False: 0}
        self._last: float | None = None
        self._rounds = 0

    def observe(self, committed: int) -> None:
        """A round committed `committed` tokens: measure it, pick the next round's mode."""
        now = self.clock()
        if self._last is not None:
            rate = committed / max(now - self._last, 1e-9)
            old = self.rates[self.masked]
            self.rates[self.masked] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate
            self.counts[self.masked] += 1
            self._rounds += 1
        self._last = now
        if self.counts[True] < WARMUP:
            self.masked = True
        elif self.counts[False] < WARMUP:
            self.masked = False
        else:
            best = self.rates[True] >= self.rates[False]
            self.masked = (not best) if self._rounds % self.explore_every == 0 else best
