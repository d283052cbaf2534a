"""The model's text read as reasoning, content and tool calls, streamed or whole.

The markers are the tokenizer's (mlx-lm's `TokenizerWrapper`): `think_start` / `think_end` inferred
from the vocabulary, `tool_call_start` / `tool_call_end` and the `tool_parser` inferred from the chat
template (or named with `--tool-parser`). The parser works on text, so a marker split over tokens (or
over steps) is found all the same: text that could still grow into a marker is held back until the
next piece says. Whitespace that only separates sections (after `</think>`, around calls) is dropped;
trailing whitespace is held only while a call (or the end of thinking) may follow, so text without
tools goes out as it comes.

A call whose body is JSON (`{"name": ..., "arguments": ...}`, mlx-lm's json_tools) streams: once its
name is known a "tool_call_begin" event carries it (with the call's id), then "tool_call_delta" events
carry the arguments' text as it comes, and the closing "tool_call" event carries the parsed call
(whose `arguments` are exactly the streamed text when that text is the parsed arguments' JSON). Other
parsers' calls arrive whole, as one "tool_call" event. An output that ends inside a call (max_tokens)
gives a "tool_call_cut" event instead (the call so far, or None): never a finished call, and its
markup (a marker's start included) never becomes content. With `max_calls`, the output is over
(`ended`) once that many calls are complete: what follows is not read.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mlx_dspark.chat_format.tools import JSON_BODY_PARSERS, ToolCall

log = logging.getLogger("mlx_dspark.chat_format")

CONTENT, REASONING, TOOL = "content", "reasoning", "tool"
CALL_BEGIN, CALL_DELTA, CALL = "tool_call_begin", "tool_call_delta", "tool_call"
# a call the output ended inside (max_tokens): its ToolCall as far as it got (None when not even its name was
# read); never a finished call, and its markup never becomes content
CALL_CUT = "tool_call_cut"
# the head of a JSON call body, up to where its arguments start
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

# Whitespace held back while a call may follow: at most this much (a separator before a call is a
# newline or two); beyond it, the text goes out, so an answer of blank lines still streams as it comes
HELD_WHITESPACE = 16


def _arguments_text(body: str) -> str:
    """A JSON call body's arguments, without the whitespace before them and the object's closing brace
    (and whitespace) after them: the same string however the text was cut into pieces."""
    body = body.strip()
    return body[:-1].rstrip() if body.endswith("}") else body


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
        stream_arguments: bool = False,
        max_calls: int | None = None,
    ) -> None:
        self.max_calls = max_calls  # after this many calls the output is over (a single forced call)
        self.ended = False
        self._think = think
        self._tools = tools
        self._stream_arguments = stream_arguments and tools is not None  # the call bodies are JSON
        self._open_call: ToolCall | None = None  # a JSON call whose arguments are streaming
        self._arguments_at = 0  # where its arguments start in the buffer
        self._arguments_sent = 0  # characters of them already sent
        self.state = REASONING if in_reasoning and think else CONTENT
        self._buffer = ""  # text of the current section not yet emitted
        self._after_marker = in_reasoning  # drop the whitespace that opens a section after a marker
        self._calls = 0
        self._gap = ""  # whitespace dropped before an opened call: restored if the call stays text

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, *, in_reasoning: bool = False, parse_tools: bool = True,
                      tools: Sequence[dict] | None = None, max_calls: int | None = None) -> OutputParser:
        think = None
        if getattr(tokenizer, "has_thinking", False):
            think = (tokenizer.think_start, tokenizer.think_end)
        calls, json_bodies = None, False
        if parse_tools and getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None:
            parser = tokenizer.tool_parser
            calls = (tokenizer.tool_call_start, tokenizer.tool_call_end, lambda text: parser(text, list(tools or [])))
            json_bodies = parser.__module__.rpartition(".")[2] in JSON_BODY_PARSERS
        return cls(think=think, tools=calls, in_reasoning=in_reasoning, stream_arguments=json_bodies,
                   max_calls=max_calls if calls is not None else None)

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
        if self.ended:
            return []
        events = self._feed(text)
        if self.max_calls is not None and self._calls >= self.max_calls:
            # the last call allowed is complete: nothing after it is part of the answer
            last = max(i for i, (kind, _) in enumerate(events) if kind == CALL)
            events, self.ended, self._buffer = events[: last + 1], True, ""
        return events

    def _feed(self, text: str) -> list[tuple[str, Any]]:
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
        if self.state == TOOL and self._stream_arguments:
            self._stream_call(events)
        if self.state != TOOL:
            keep = _partial_marker(self._buffer, self._markers())
            ready = self._buffer[: len(self._buffer) - keep]
            # trailing whitespace waits too when a call (or the end of thinking) may follow: it is dropped
            # before a marker; otherwise text goes out as it comes
            ready_stripped = ready.rstrip() if self._holds_whitespace() else ready
            if len(ready) - len(ready_stripped) > HELD_WHITESPACE:  # a model writing only blank lines: not held
                ready_stripped = ready[: len(ready) - HELD_WHITESPACE]  # to the end, only the last few
            self._emit(ready_stripped, events)
            self._buffer = self._buffer[len(ready_stripped):]
        return events

    def _holds_whitespace(self) -> bool:
        return self.state == REASONING or (self.state == CONTENT and self._tools is not None)

    def finish(self) -> list[tuple[str, Any]]:
        """The end of the output: what was held back. A call whose end marker never came is a call when its
        body is whole (the model ended right after it), else a CALL_CUT event: never text."""
        events: list[tuple[str, Any]] = []
        if self.ended:
            return events
        if self.state == TOOL:
            self._finish_call(events)
            self.state = CONTENT
        elif not (self.called and self.state == CONTENT and not self._buffer.strip()):
            text = self._buffer
            partial = _partial_marker(text, [self._tools[0]]) if self.state == CONTENT and self._tools else 0
            if partial:  # the start of a call marker (and the whitespace before it) is not text
                text = text[: len(text) - partial].rstrip()
            self._emit(text, events)
        self._buffer = ""
        return events

    def _finish_call(self, events: list) -> None:
        if self._open_call is not None:
            body = self._buffer[self._arguments_at:]
            self._send_arguments(events, body)
            arguments = _arguments_text(body)
            if body.rstrip().endswith("}") and _is_json(arguments):
                self._end_call(arguments, events)
            else:
                call, self._open_call = self._open_call, None
                events.append((CALL_CUT, ToolCall(name=call.name, arguments=arguments, id=call.id)))
            return
        text = self._buffer
        try:
            parsed = self._tools[2](text) if text.strip() else None
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            parsed = None
        if parsed is None or (isinstance(parsed, list) and not parsed):
            log.info("the output ended inside a tool call (%d characters of it): the call is left out", len(text))
            events.append((CALL_CUT, None))
            return
        self._parse_call(text, events)

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

    def _begin_call(self, text: str, events: list) -> None:
        head = _CALL_HEAD.match(text)
        if head is None:
            return
        try:
            name = json.loads(f'"{head.group(1)}"')
        except json.JSONDecodeError:
            return  # not a name we can read: the call arrives whole (or as text)
        self._open_call, self._arguments_at, self._arguments_sent = ToolCall.new(name, ""), head.end(), 0
        events.append((CALL_BEGIN, self._open_call))

    def _stream_call(self, events: list) -> None:
        if self._open_call is None:
            self._begin_call(self._buffer, events)
            if self._open_call is None:
                return
        body = self._buffer[self._arguments_at:]
        self._send_arguments(events, body[: len(body) - _partial_marker(body, [self._tools[1]])])

    def _send_arguments(self, events: list, body: str) -> None:
        # the object's closing brace (the last one, before whitespace) may end the arguments: it waits
        ready = _arguments_text(body)
        if len(ready) > self._arguments_sent:
            events.append((CALL_DELTA, ready[self._arguments_sent:]))
            self._arguments_sent = len(ready)

    def _end_call(self, arguments: str, events: list, parsed: Any = None) -> None:
        """Close the streamed call: its arguments are the streamed text when that is the parsed value."""
        call, self._open_call = self._open_call, None
        if parsed is not None:
            try:
                same = json.loads(arguments) == parsed
            except json.JSONDecodeError:
                same = False
            if not same:
                log.warning("a streamed tool call's arguments %r differ from its parsed ones; the parsed ones win", arguments)
                arguments = json.dumps(parsed, ensure_ascii=False) if not isinstance(parsed, str) else parsed
        events.append((CALL, ToolCall(name=call.name, arguments=arguments, id=call.id)))
        self._calls += 1

    def _parse_call(self, text: str, events: list) -> None:
        if self._stream_arguments and self._open_call is None:
            self._begin_call(text, events)  # the whole call came in one piece: it streams all the same
        if self._open_call is not None:
            self._send_arguments(events, text[self._arguments_at:])
            arguments = _arguments_text(text[self._arguments_at:])
            try:
                parsed = self._tools[2](text)
            except (ValueError, KeyError, TypeError, json.JSONDecodeError):
                parsed = None  # the model's text, as far as it is, is the call's arguments
            if isinstance(parsed, list) and len(parsed) == 1:
                parsed = parsed[0]
            self._end_call(arguments, events, parsed.get("arguments", {}) if isinstance(parsed, dict) else None)
            return
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


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def parse_output(parser: OutputParser, text: str) -> ParsedOutput:
    """A whole output through `parser` (a fresh one)."""
    out = ParsedOutput()
    reasoning: list[str] = []
    for kind, value in parser.feed(text) + parser.finish():
        if kind == CALL:
            out.tool_calls.append(value)
        elif kind in (CALL_BEGIN, CALL_DELTA, CALL_CUT):
            continue
        elif kind == REASONING:
            reasoning.append(value)
        else:
            out.content += value
    out.reasoning = "".join(reasoning) if reasoning else None
    return out
