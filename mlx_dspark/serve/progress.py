"""The prefill's progress in the server log: a long prompt (an agent's 30k tokens) takes minutes, and
the log says how far it got instead of staying silent until the first token.

The engine checks its cancel event before each prefill chunk (and between rounds); `PrefillWatch`
stands in for the job's event, answers as it does, and counts the checks made before the first step:
each is one chunk of `step` prompt tokens about to run.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("mlx_dspark.server")

LOG_EVERY_S = 10.0


class PrefillWatch:
    """A cancel event (`is_set` / `set` / `wait` delegate to `event`) that logs the prefill's chunks."""

    def __init__(self, event: threading.Event, kind: str, prompt_tokens: int, step: int,
                 steps: Callable[[], int], *, every_s: float = LOG_EVERY_S) -> None:
        self.event, self.kind, self.prompt_tokens, self.step = event, kind, prompt_tokens, step
        self._steps, self._every_s = steps, every_s
        self.chunks = 0
        self._start = self._logged = time.monotonic()

    def is_set(self) -> bool:
        if self._steps() == 0 and self.prompt_tokens > self.step:
            self.chunks += 1
            now = time.monotonic()
            done = min(self.prompt_tokens, (self.chunks - 1) * self.step)
            if now - self._logged >= self._every_s and done < self.prompt_tokens:
                self._logged = now
                log.info("%s request: prefill at most %d of %d prompt tokens to go after %.0f s (%d chunks of %d done)",
                         self.kind, self.prompt_tokens - done, self.prompt_tokens, now - self._start, self.chunks - 1,
                         self.step)
        return self.event.is_set()

    def set(self) -> None:
        self.event.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.event.wait(timeout)
