"""A chained drafter's state (engine/proposers/chain.py), kept apart
from its proposer so a prompt cache can hold it between generations (engine/prompt_cache.py).

Entry t of the drafter's cache pairs the target's features at position t with the token at t + 1, so the
state is: the drafter's caches (`entries` positions, full attention: they trim any amount), `tokens` (the
sequence the entries were paired with: entry t with tokens[t + 1]), the features still waiting for their
next token (positions entries .. entries + waiting - 1), and the features of the newest entry
(`last_features`), which let that entry be written again with another next token.

Resuming on a new prompt whose common prefix with the target's held tokens is L: entries whose next token
is still the prompt's stay; the entry at the boundary (position s - 1, paired with a token that changed)
is written again from its features when they are kept (the newest entry's, or waiting ones), else the
resume starts one position earlier (`reach`), where every kept entry is still right. Never approximate.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChainContext:
    """See the module docstring. `make_cache` builds the drafter's caches (a fresh context, a cold reset)."""

    def __init__(self, make_cache: Callable[[], list], tokens: Sequence[int] = ()) -> None:
        self.make_cache = make_cache
        self.cache: list[Any] = make_cache()
        self.tokens: list[int] = [int(t) for t in tokens]  # entry t pairs features(t) with tokens[t + 1]
        self.entries = 0  # positions in the drafter's caches
        self.features: list[mx.array] = []  # (1, n, F) features of positions entries .. entries + waiting - 1
        self.waiting = 0
        self.last: mx.array | None = None  # (1, 1, C): the drafter's output at entry entries - 1
        self.last_features: mx.array | None = None  # (1, 1, F): the target's features at position entries - 1

    @property
    def nbytes(self) -> int:
        held = [a for f in (self.features, [self.last_features]) for a in f if a is not None]
        return sum(c.nbytes for c in self.cache if c.keys is not None) + sum(a.nbytes for a in held)

    @property
    def first_kept(self) -> int:
        """The first position whose features are kept: the newest entry's when they are, else the waiting ones'."""
        return self.entries - 1 if self.last_features is not None else self.entries

    def drop_speculative(self) -> None:
        """The drafter's caches back to the committed entries (a proposal's chained entries; offsets only)."""
        for c in self.cache:
            c.trim(c.offset - self.entries)

    def reach(self, prompt: Sequence[int]) -> int:
        """The most positions of `prompt` this state resumes exactly (the caller also caps it at the target's
        common prefix): entries up to the first changed next token, plus kept features beyond them."""
        keep = max(0, min(self.entries, common_prefix(self.tokens, prompt) - 1))
        return self.entries + self.waiting if keep >= self.first_kept else keep

    def rewind(self, start: int, prompt: Sequence[int] | None = None) -> None:
        """Hold positions 0 .. start - 1 of `prompt` (start <= `reach(prompt)`): the entries whose next token
        is still the prompt's, then the kept features up to `start` waiting. `prompt` None: the held tokens
        are cut at `start` (a prompt cache forgetting tokens past a stop), the pairing tokens stay."""
        keep = min(self.entries, start)
        if prompt is not None:
            keep = max(0, min(keep, common_prefix(self.tokens, prompt) - 1))
        first_kept = self.first_kept
        rows = None
        if start > keep:
            assert keep >= first_kept and start <= self.entries + self.waiting, (keep, start, self.entries, self.waiting)
            kept = ([self.last_features] if first_kept < self.entries else []) + self.features
            rows = mx.concatenate(kept, axis=1)[:, keep - first_kept : start - first_kept]  # (1, start - keep, F)
        for c in self.cache:
            c.trim(max(0, c.offset - keep))
        if keep < self.entries:
            self.last = self.last_features = None  # the newest entry is gone
        self.entries = keep
        self.features, self.waiting = ([] if rows is None else [rows]), start - keep
        if prompt is not None:
            self.tokens = [int(t) for t in prompt]

    def reset(self, tokens: Sequence[int] = ()) -> None:
        """Empty (a cold prefill of `tokens` follows)."""
        self.cache[:] = self.make_cache()  # in place: a proposer may hold this list
        self.tokens = [int(t) for t in tokens]
        self.entries, self.features, self.waiting = 0, [], 0
        self.last = self.last_features = None
