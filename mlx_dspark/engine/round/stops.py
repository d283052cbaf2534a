"""Where a generation ends: each committed token taken as plain decoding takes it, one at a time.

A verify round commits a block of tokens at once; plain decoding commits them one per step and stops
at the first step whose token ends the output. `StopReader.take(tokens)` reads a round's tokens through
exactly those per-step rules, in plain decoding's order, and keeps them up to the token where plain
decoding would have stopped, so every way a generation ends gives the same last token speculative or
not: a stop token (end-of-sequence, `stop_token_ids`, the end a grammar forces), `max_tokens`, a stop
string (the text is cut before it) and the end of the one tool call allowed (an output `reader`, the
chat_format collector, whose `ended` turns true). What a step shows is the detokenizer's text less what
could still grow into a stop string, as a plain step shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from mlx_dspark.engine.round.token_origins import TextOrigins


class OutputReader(Protocol):
    """The output's reader (chat_format.turn.OutputCollector): fed the shown text, says when the answer ended."""

    ended: bool

    def add(self, text: str, *, final: bool) -> Any: ...


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters could still grow into a stop string (so are not shown yet)."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold


@dataclass
class Taken:
    """What one round's tokens added: those kept (up to the stop), the text they show, why they stopped."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length" or None while generating


class StopReader:
    """The stop rules of one generation over its detokenizer (reset here); see the module docstring."""

    def __init__(
        self,
        detokenizer: Any,
        *,
        stop_ids: set[int],
        stops: Sequence[str],
        max_tokens: int,
        reader: OutputReader | None = None,
        origins: TextOrigins | None = None,
    ) -> None:
        self.detokenizer = detokenizer
        self.stop_ids = stop_ids
        self.stops = tuple(stops)
        self.max_tokens = max_tokens
        self.reader = reader
        self.origins = origins if origins is not None else TextOrigins()
        self.generated = 0  # tokens kept so far
        self.shown = 0  # characters of the detokenizer's text shown so far
        detokenizer.reset()

    def take(self, tokens: Sequence[int], origins: Sequence[str]) -> Taken:
        """A round's committed tokens (with each one's origin, token_origins.py), one plain step each,
        up to and including the first one at which plain decoding stops."""
        taken = Taken()
        for token, origin in zip(tokens, origins):
            taken.tokens.append(token)
            text, taken.finish_reason = self._step(token, origin)
            taken.text += text
            if taken.finish_reason is not None:
                break
        return taken

    def _step(self, token: int, origin: str) -> tuple[str, str | None]:
        """One plain step: the token's new text to show and the finish reason it brings."""
        detokenizer = self.detokenizer
        self.generated += 1
        finish = None
        if token in self.stop_ids:
            finish = "stop"  # a stop token is kept, never shown as text
        else:
            detokenizer.add_token(token)
            if self.generated >= self.max_tokens:
                finish = "length"
        if finish is not None:
            detokenizer.finalize()
        text = detokenizer.text
        self.origins.add(len(text), origin)
        cut = min((i for i in (text.find(s, max(0, self.shown - len(s))) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        visible = len(text) if finish else len(text) - held_back(text, self.stops)
        new_text = text[self.shown : visible] if visible > self.shown else ""
        self.shown = max(self.shown, visible)
        if self.reader is not None:
            self.reader.add(new_text, final=finish is not None)
            if self.reader.ended and finish is None:
                finish = "stop"  # the one call allowed (a named or non-parallel choice) is complete
        return new_text, finish
