"""The server's prompt caches: a bounded LRU pool of conversations kept warm between requests.

Each request takes the `PromptCache` that can reuse the longest prefix of its prompt (or a new one)
out of the pool, generates with it, and gives it back as the most recently used; least recently used
caches are evicted while the pool holds more than `conversations` caches or more than `nbytes` bytes
(live caches and snapshots, as `PromptCache.nbytes` counts them). A cache is out of the pool while a
request uses it, so two jobs never share one.

Which cache a request takes: the one with the longest reusable prefix, but only when that prefix is
at least half of what the cache holds. Taking a cache rewinds it, so a short match (a chat UI's title
request that shares the template's first tokens, another conversation with the same system prompt)
would throw away more of a conversation than it saves; such a request starts a new cache instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mlx_dspark.api import make_prompt_cache
from mlx_dspark.engine.prompt_cache import PromptCache

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(text: str) -> int:
    """A size such as "2GB", "512MB", "1.5G", "64KiB" or "1000000" in bytes (KB = 1000, KiB = 1024)."""
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(f"expected a size such as 2GB, 512MB or a number of bytes, got {text!r}")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    power = _UNITS[unit[:1]] if unit else 1
    if "i" in unit:
        power = 1024 ** ("kmgt".index(unit[0]) + 1)
    return int(number * power)


@dataclass(frozen=True)
class PromptCacheBudget:
    """How much the pool may keep: `conversations` caches (0 turns reuse off) within `nbytes` bytes."""

    conversations: int = 4
    nbytes: int = 2 * 10**9

    def __post_init__(self) -> None:
        if not isinstance(self.conversations, int) or self.conversations < 0:
            raise ValueError(f"the prompt cache size must be an integer >= 0, got {self.conversations!r}")
        if not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"the prompt cache byte budget must be an integer >= 0, got {self.nbytes!r}")

    @property
    def enabled(self) -> bool:
        return self.conversations > 0 and self.nbytes > 0


class PromptCachePool:
    """Cached conversations of one loaded model, least recently used first; see the module docstring."""

    def __init__(
        self,
        model: Any,
        budget: PromptCacheBudget = PromptCacheBudget(),
        *,
        make: Callable[[Any], PromptCache] = make_prompt_cache,
    ) -> None:
        self.model = model
        self.budget = budget
        self._make = make
        self._caches: list[PromptCache] = []  # least recently used first

    def __len__(self) -> int:
        return len(self._caches)

    def __contains__(self, cache: PromptCache) -> bool:
        return any(c is cache for c in self._caches)

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self._caches)

    def checkout(self, prompt: Sequence[int], *, speculative: bool) -> PromptCache | None:
        """The cache this prompt should use, taken out of the pool (None when reuse is off)."""
        if not self.budget.enabled:
            return None
        best, best_reuse = None, 0
        for cache in self._caches:
            reuse = cache.reusable(prompt, speculative=speculative)
            if reuse > best_reuse and 2 * reuse >= len(cache.tokens):
                best, best_reuse = cache, reuse
        if best is None:
            best = self._make(self.model)
            # The new cache counts against the size from now on: the pool keeps room for it.
            self._evict(conversations=self.budget.conversations - 1, nbytes=self.budget.nbytes)
        else:
            self._caches.remove(best)
            self._evict(conversations=self.budget.conversations - 1, nbytes=self.budget.nbytes - best.nbytes)
        return best

    def checkin(self, cache: PromptCache | None, *, reusable: bool = True) -> None:
        """Give a checked-out cache back as the most recently used (dropped when not `reusable`)."""
        if cache is None:
            return
        if reusable and cache.tokens:
            self._caches.append(cache)
        self._evict(conversations=self.budget.conversations, nbytes=self.budget.nbytes)

    def clear(self) -> None:
        self._caches.clear()

    def _evict(self, *, conversations: int, nbytes: int) -> None:
        """Drop least recently used caches until at most `conversations` within `nbytes` remain."""
        while self._caches and (len(self._caches) > max(conversations, 0) or self.nbytes > nbytes):
            del self._caches[0]
