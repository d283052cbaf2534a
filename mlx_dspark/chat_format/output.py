"""The model's text read as reasoning, content and tool calls, streamed or whole.

The markers are the tokenizer's (mlx-lm's `TokenizerWrapper`): `think_start` / `think_end` inferred
from the vocabulary, `tool_call_start` / `tool_call_end` and the `tool_parser` inferred from the chat
template (or named with `--tool-parser`). The parser works on text, so a marker split over tokens (or
over steps) is found all the same: text that could still grow into a marker is held back until the
next piece says. Whitespace that only separates sections (after `</think>`, around calls) is dropped.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mlx_dspark.chat_format.tools import ToolCall

log = logging.getLogger("mlx_dspark.chat_format")

CONTENT, REASONING, TOOL = "content", "reasoning", "tool"


@dataclass
class ParsedOutput:
    """A whole output: `content` without reasoning and calls, `reasoning` (None when there was none)."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def _partial_marker(text: str, markers: Sequence[str]) -> int:
    """How many trailing characters of `text` are a proper prefix of a marker."""
    hold = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), hold, -1):
            if text.endswith(marker[:n]):
                hold = n
                break
    return hold


class OutputParser:
    """Feed text pieces, get events: ("content", str), ("reasoning", str) and ("tool_call", ToolCall).

    `think`: the (start, end) markers or None; `tools`: the (start, end) call markers and the parser
    (text between the markers -> a dict or list of dicts with "name" and "arguments"), or None to leave
    calls as content; `in_reasoning`: the prompt opened a thinking block.
    """

    def __init__(
        self,
        *,
        think: tuple[str, str] | None = None,
        tools: tuple[str, str, Callable[[str], Any]] | None = None,
        in_reasoning: bool = False,
    ) -> None:
        self._think = think
        self._tools = tools
        self.state = REASONING if in_reasoning and think else CONTENT
        self._buffer = ""  # text of the current section not yet emitted
        self._after_marker = in_reasoning  # drop the whitespace that opens a section after a marker
        self._calls = 0
        self._gap = ""  # whitespace dropped before an opened call: restored if the call stays text

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, *, in_reasoning: bool = False, parse_tools: bool = True,
                      tools: Sequence[dict] | None = None) -> OutputParser:
        think = None
        if getattr(tokenizer, "has_thinking", False):
            think = (tokenizer.think_start, tokenizer.think_end)
        calls = None
        if parse_tools and getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None:
            parser = tokenizer.tool_parser
            calls = (tokenizer.tool_call_start, tokenizer.tool_call_end, lambda text: parser(text, list(tools or [])))
        return cls(think=think, tools=calls, in_reasoning=in_reasoning)

    @property
    def called(self) -> bool:
        return self._calls > 0

    def _markers(self) -> list[str]:
        if self.state == REASONING:
            return [self._think[1]]
        if self.state == TOOL:
            return [self._tools[1]]
        return [m for m in ((self._think or (None,))[0], (self._tools or (None,))[0]) if m]

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buffer += text
        events: list[tuple[str, Any]] = []
        while True:
            found = [(self._buffer.find(m), m) for m in self._markers()]
            found = [(i, m) for i, m in found if i >= 0]
            if not found:
                break
            index, marker = min(found)
            self._close_section(self._buffer[:index], events)
            self._buffer = self._buffer[index + len(marker):]
            self._switch(marker)
        if self.state != TOOL:
            keep = _partial_marker(self._buffer, self._markers())
            ready = self._buffer[: len(self._buffer) - keep]
            # trailing whitespace waits too: it is dropped if a marker follows
            ready_stripped = ready.rstrip()
            self._emit(ready_stripped, events)
            self._buffer = self._buffer[len(ready_stripped):]
        return events

    def finish(self) -> list[tuple[str, Any]]:
        """The end of the output: what was held back; an unclosed call stays text (as content)."""
        events: list[tuple[str, Any]] = []
        if self.state == TOOL:
            self.state, self._after_marker = CONTENT, False
            self._emit(self._gap + self._tools[0] + self._buffer, events)
        elif not (self.called and self.state == CONTENT and not self._buffer.strip()):
            self._emit(self._buffer, events)
        self._buffer = ""
        return events

    def _emit(self, text: str, events: list) -> None:
        if self._after_marker:
            text = text.lstrip()
        if not text:
            return
        self._after_marker = False
        kind = REASONING if self.state == REASONING else CONTENT
        if events and events[-1][0] == kind:
            events[-1] = (kind, events[-1][1] + text)
        else:
            events.append((kind, text))

    def _close_section(self, text: str, events: list) -> None:
        if self.state == TOOL:
            self._parse_call(text, events)
        else:
            self._emit(text.rstrip(), events)
            self._gap = "" if self._after_marker else text[len(text.rstrip()):]

    def _switch(self, marker: str) -> None:
        if self._think and marker == self._think[0]:
            self.state = REASONING
        elif self._tools and marker == self._tools[0]:
            self.state = TOOL
        else:
            self.state = CONTENT
        self._after_marker = True

    def _parse_call(self, text: str, events: list) -> None:
        try:
            parsed = self._tools[2](text)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as err:
            # Not a call we can read: the text stays visible as content rather than vanish.
            log.warning("tool call text could not be parsed (%s: %s); kept as content", type(err).__name__, err)
            self.state, self._after_marker = CONTENT, False
            self._emit(f"{self._gap}{self._tools[0]}{text}{self._tools[1]}", events)
            return
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                log.warning("tool parser returned %r, not a call; ignored", call)
                continue
            events.append(("tool_call", ToolCall.new(call["name"], call.get("arguments", {}))))
            self._calls += 1


def parse_output(parser: OutputParser, text: str) -> ParsedOutput:
    """A whole output through `parser` (a fresh one)."""
    out = ParsedOutput()
    reasoning: list[str] = []
    for kind, value in parser.feed(text) + parser.finish():
        if kind == "tool_call":
            out.tool_calls.append(value)
        elif kind == REASONING:
            reasoning.append(value)
        else:
            out.content += value
    out.reasoning = "".join(reasoning) if reasoning else None
    return out
