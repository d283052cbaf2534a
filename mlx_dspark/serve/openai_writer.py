"""OpenAI answers written step by step: chat completions (content, `reasoning_content`, `tool_calls`,
logprobs) and text completions, whole or as server-sent chunks.

A writer is fed every step of its job (`add`, which returns the chunks to stream) and then gives the
whole body (`body`). The chat writer reads the text through the job's `OutputCollector`
(chat_format/turn.py): reasoning goes to `reasoning_content`, calls to `tool_calls` (a streamed call is
one delta with its id and name, then its arguments), and a turn that called a tool finishes with
`finish_reason: "tool_calls"`.
"""

from __future__ import annotations

from typing import Any

from mlx_dspark.api import StepResponse
from mlx_dspark.chat_format.turn import OutputCollector
from mlx_dspark.serve.errors import APIError
from mlx_dspark.serve.protocol import Envelope, GenerationRequest, Tally, note_cut_call

Event = tuple[str | None, Any]  # (SSE event name or None, payload: a dict or "[DONE]")


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def _entry(tokenizer: Any, token: int, logprob: float) -> dict:
    text = _token_text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, logprobs: list | None) -> dict | None:
    """Chat's `logprobs.content`: each committed token with its logprob and top alternatives."""
    if logprobs is None:
        return None
    return {"content": [{**_entry(tokenizer, lp.token, lp.logprob),
                         "top_logprobs": [_entry(tokenizer, t, v) for t, v in lp.top]} for lp in logprobs]}


def text_logprobs(tokenizer: Any, logprobs: list | None, offset: int) -> dict | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset."""
    if logprobs is None:
        return None
    tokens = [_token_text(tokenizer, lp.token) for lp in logprobs]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{_token_text(tokenizer, t): v for t, v in lp.top} for lp in logprobs], "text_offset": offsets}


def step_marks(step: StepResponse) -> dict:
    """Who wrote the step's raw text (its reasoning and tool-call text included) and what the round did."""
    return {"marks": step.marks or [], "text": step.text, "verified": step.verified, "proposed": step.proposed,
            "accepted": step.accepted, "source": step.source, "tokens": len(step.tokens)}


class OpenAIWriter:
    """One chat or text completion; `reader` is None for text completions (their text is the answer)."""

    def __init__(self, request: GenerationRequest, job: Any, *, model_id: str, speculative: bool, tokenizer: Any) -> None:
        self.request = request
        self.job = job  # its `reader` (an OutputCollector) is set by the worker before the first step
        self.envelope = Envelope.new(request.kind, model_id)
        self.tally = Tally(speculative=speculative, warnings=request.warnings)
        self.tokenizer = tokenizer
        self.text: list[str] = []
        self.logprobs: list | None = None
        self.calls = 0
        self.finish_reason: str | None = None
        self.finished = False  # the answer is complete (the handler stops reading the job)
        self.ended_early = False  # ...before the generation ended: the one call allowed was complete
        self._first = True
        self._offset = 0
        # the page's view of speculation (a request with the X-DSpark-Marks header): each step's chunk
        # carries `dspark_step`, which other clients ignore
        self.marks = bool(request.extra.get("marks"))

    def start_events(self, prompt_tokens: int = 0) -> list[Event]:
        """The first chunk (the role, for chat), sent before the prefill."""
        if self.request.kind != "chat":
            return []
        self._first = False
        return [(None, self._chunk({"role": "assistant", "content": ""}))]

    def keepalive_events(self, waited_s: float) -> list:
        return []  # an SSE comment: the OpenAI streams have no keep-alive event of their own

    @property
    def reader(self) -> OutputCollector | None:
        return getattr(self.job, "reader", None) if self.request.kind == "chat" else None

    # -- streaming ---------------------------------------------------------------------------------

    def add(self, step: StepResponse) -> list[Event]:
        """Take one step; the chunks it streams (the first step always sends one: the role)."""
        self.tally.add(step)
        self.text.append(step.text)
        step_logprobs = getattr(step, "logprobs", None)
        if step_logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(step_logprobs)
        done = step.finish_reason is not None
        if self.request.kind != "chat":
            if done:
                self.finish_reason = step.finish_reason
            return self._text_chunks(step, step_logprobs, done)
        parts = self.reader.add(step.text, final=done)
        if self.reader.ended and not done:  # the one call allowed is complete: the answer ends here
            done, self.ended_early = True, True
        if done:
            self.finish_reason = "stop" if self.ended_early else step.finish_reason
            self.finished = True
            note_cut_call(self.request, self.reader, self.finish_reason)
        deltas: list[dict] = []
        for kind, value in parts:
            # A call goes out once it is whole (id and name, then its arguments): a call cut by max_tokens is
            # left out instead of streaming arguments that never become JSON.
            if kind == "tool_call":
                header = {"index": self.calls, "id": value.id, "type": "function",
                          "function": {"name": value.name, "arguments": ""}}
                deltas += [{"tool_calls": [header]}, {"tool_calls": [{"index": self.calls, "function": {"arguments": value.arguments}}]}]
                self.calls += 1
            elif kind in ("content", "reasoning") and value:
                deltas.append({"reasoning_content": value} if kind == "reasoning" else {"content": value})
        if self._first:
            deltas.insert(0, {"role": "assistant", "content": ""})
            self._first = False
        events: list[Event] = []
        logprobs = chat_logprobs(self.tokenizer, step_logprobs)
        for i, delta in enumerate(deltas):
            events.append((None, self._chunk(delta, logprobs=logprobs if i == len(deltas) - 1 else None)))
        if done:
            events.append((None, self._chunk({}, finish_reason=self._finish(), logprobs=logprobs if not deltas else None,
                                              stats=True)))
        elif (logprobs is not None or self.marks) and not deltas:
            events.append((None, self._chunk({}, logprobs=logprobs)))
        if self.marks and events:
            events[-1][1]["dspark_step"] = step_marks(step)
        return events + (self._tail() if done else [])

    def _text_chunks(self, step: StepResponse, step_logprobs: list | None, done: bool) -> list[Event]:
        self.finished = done
        first, self._first = self._first, False
        if not (step.text or first or done):
            return []
        logprobs = text_logprobs(self.tokenizer, step_logprobs, self._offset)
        self._offset += len(step.text)
        body = self.envelope.chunk(text=step.text, finish_reason=step.finish_reason, first=first,
                                   tally=self.tally if done else None)
        body["choices"][0]["logprobs"] = logprobs
        if self.marks:
            body["dspark_step"] = step_marks(step)
        return [(None, body)] + (self._tail() if done else [])

    def _chunk(self, delta: dict, *, finish_reason: str | None = None, logprobs: dict | None = None,
               stats: bool = False) -> dict:
        body = self.envelope.chunk(text="", finish_reason=finish_reason, tally=self.tally if stats else None)
        body["choices"][0]["delta"] = delta
        body["choices"][0]["logprobs"] = logprobs
        return body

    def _tail(self) -> list[Event]:
        tail: list[Event] = []
        if self.request.include_usage:
            tail.append((None, self.envelope.usage_chunk(self.tally)))
        return tail + [(None, "[DONE]")]

    def _finish(self) -> str:
        called = self.reader is not None and self.reader.output.tool_calls
        return "tool_calls" if called and self.finish_reason == "stop" else self.finish_reason

    def error_events(self, err: APIError) -> list[Event]:
        return [(None, err.body()), (None, "[DONE]")]

    # -- whole -------------------------------------------------------------------------------------

    def body(self) -> dict:
        text = "".join(self.text)
        body = self.envelope.full(text=text, finish_reason=self._finish(), tally=self.tally)
        choice = body["choices"][0]
        if self.request.kind == "chat":
            out = self.reader.output if self.reader is not None else None
            message = choice["message"]
            if out is not None:
                message["content"] = out.content if out.content or not out.tool_calls else None
                if out.reasoning is not None:
                    message["reasoning_content"] = out.reasoning
                if out.tool_calls:
                    message["tool_calls"] = [call.to_openai() for call in out.tool_calls]
            choice["logprobs"] = chat_logprobs(self.tokenizer, self.logprobs)
        else:
            choice["logprobs"] = text_logprobs(self.tokenizer, self.logprobs, 0)
        return body
