"""Where each generated character came from, for the server's live view of speculation.

A verify round commits `accepted` tokens that its block proposed (the DSpark draft, a prompt lookup
or a grammar's forced run: the round's `source`) and then one token of the target's own; a plain
step commits the target's token alone. The streamed text is cut from the detokenizer's text, which
can hold a token's characters back (a stop string, a partial UTF-8 character), so the origins are
kept per character range of the whole text and read back for whatever range a step shows.
"""

from __future__ import annotations

from bisect import bisect_right

TARGET = "target"  # the target's own token: the bonus of a round, a plain step, the first token


def token_origins(tokens: int, accepted: int, source: str | None, verified: bool) -> list[str]:
    """The origin of each of a round's committed tokens (accepted block tokens first, then the target's)."""
    if not verified or source is None:
        return [TARGET] * tokens
    return [source if i < accepted else TARGET for i in range(tokens)]


class TextOrigins:
    """Origins by character range of one generation's text: `add` after each token's text is known."""

    def __init__(self) -> None:
        self._ends: list[int] = []  # the text's length after each token
        self._origins: list[str] = []

    def add(self, text_length: int, origin: str) -> None:
        if self._ends and text_length <= self._ends[-1]:
            return  # no characters of its own (a special token, a byte held for a later one)
        self._ends.append(text_length)
        self._origins.append(origin)

    def runs(self, start: int, end: int) -> list[list]:
        """[[characters, origin], ...] covering text[start:end] (runs of one origin merged)."""
        runs: list[list] = []
        i = bisect_right(self._ends, start)
        position = start
        while position < end and i < len(self._ends):
            stop = min(end, self._ends[i])
            if stop > position:
                if runs and runs[-1][1] == self._origins[i]:
                    runs[-1][0] += stop - position
                else:
                    runs.append([stop - position, self._origins[i]])
                position = stop
            i += 1
        if position < end:  # characters the detokenizer made at its end (finalize) belong to the last token
            runs.append([end - position, self._origins[-1] if self._origins else TARGET])
        return runs
