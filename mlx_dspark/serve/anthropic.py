"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): request bodies into
generation requests, steps into a message or its event stream.

`system`, text / `tool_use` / `tool_result` blocks become the chat messages the template renders (tool
uses as assistant `tool_calls`, results as `tool` messages); `tools` (`input_schema`) become function
tools; `tool_choice` auto / any / tool / none map onto the OpenAI choices (any = required, tool = a
named function); `thinking` {"type": "enabled" | "disabled"} sets the template's thinking switch.
Thinking text comes back as `thinking` blocks, calls as `tool_use` blocks (`stop_reason: "tool_use"`).
Errors are written in Anthropic's shape by the handler.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any

from mlx_dspark.api import StepResponse
from mlx_dspark.chat_format.tools import ToolChoice
from mlx_dspark.serve import fields
from mlx_dspark.serve.errors import APIError, bad_value
from mlx_dspark.serve.protocol import CLIENT_TEMPLATE_KWARGS, GenerationRequest, Tally, note_cut_call, request_options

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_STOP_REASONS = {"length": "max_tokens"}
TEXT_KEEPALIVE_S = 60.0  # a stream with no token yet after this long gets empty text deltas beside its pings
# output_config.effort -> reasoning effort (the template's switch)
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}


def _text(content: Any, where: str) -> str:
    """A string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise APIError(400, f"{where}[{i}]: only text blocks are supported here, got {kind!r}",
                               param=f"{where}[{i}]", code="unsupported_value")
            texts.append(block["text"])
        return "\n".join(texts)
    raise bad_value(where, "a string or a list of text blocks", content)


def _turn(role: str, content: Any, where: str) -> list[dict]:
    """One Anthropic message as chat messages (a user turn with tool results gives `tool` messages first)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_value(f"{where}.content", "a string or a list of content blocks", content)
    texts, calls, results = [], [], []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                raise bad_value(at, "a tool_use block with 'id', 'name' and 'input'", block)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_value(f"{at}.tool_use_id", "the id of the tool_use it answers", block.get("tool_use_id"))
            output = _text(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                output = f"Error: {output}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": output})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier thinking is not rendered again (templates drop it)
        else:
            raise APIError(400, f"{at}: a {kind!r} block is not supported in a {role} message", param=at,
                           code="unsupported_value")
    turn = results[:]
    if texts or calls or not results:
        message: dict = {"role": role, "content": "\n".join(texts)}
        if calls:
            message["tool_calls"] = calls
        turn.append(message)
    return turn


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_value("messages", "a non-empty list of messages", messages)
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise bad_value(f"messages[{i}].role", "'user', 'assistant' or 'system'",
                            message.get("role") if isinstance(message, dict) else message)
        if message["role"] == "system":
            # A system turn inside the conversation (Anthropic's mid-conversation-system beta, which Claude
            # Code uses): rendered at its place; `prepare` joins it to the system prompt if the template refuses.
            out.append({"role": "system", "content": _text(message.get("content"), f"messages[{i}].content")})
            continue
        out += _turn(message["role"], message.get("content"), f"messages[{i}]")
    return out


def _tools(body: dict, warnings: list[str]) -> tuple[list[dict] | None, ToolChoice | None, bool]:
    tools = body.get("tools")
    converted = None
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_value("tools", "a list of tools", tools)
        converted = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise bad_value(f"tools[{i}]", "a tool object", tool)
            if tool.get("type") not in (None, "custom"):  # Anthropic's server tools (web_search_..., code_execution_...)
                warnings.append(f"tools[{i}] ({tool.get('type')!r}) is a server tool this server does not run: it was dropped")
                continue
            function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            converted.append({"type": "function", "function": function})
    choice, parallel = body.get("tool_choice"), True
    if choice is None:
        return converted, None, parallel
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_value("tool_choice", "{'type': 'auto' | 'any' | 'tool' | 'none'}", choice)
    parallel = not choice.get("disable_parallel_tool_use", False)
    if choice["type"] == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_value("tool_choice.name", "the name of a tool", choice.get("name"))
        return converted, ToolChoice("named", choice["name"]), parallel
    return converted, ToolChoice(_CHOICES[choice["type"]]), parallel


def parse_request(body: Any, *, defaults: Any, template_kwargs: frozenset[str] = CLIENT_TEMPLATE_KWARGS,
                  count_only: bool = False) -> GenerationRequest:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    if not count_only and body.get("max_tokens") is None:
        raise bad_value("max_tokens", "an integer >= 1 (Anthropic's API requires it)", None)
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise bad_value("stop_sequences", "a list of strings", stops)
    knobs = {k: body.get(k) for k in ("max_tokens", "temperature", "top_p", "top_k", "chat_template_kwargs")}
    knobs["stop"] = stops
    try:
        options = request_options(knobs, defaults, template_kwargs)
    except APIError as err:
        if err.param == "stop":
            err.param = "stop_sequences"
        raise
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_value("stream", "true or false", stream)
    warnings: list[str] = []
    tools, choice, parallel = _tools(body, warnings)
    request = GenerationRequest(kind="anthropic", prompt=_messages(body), options=options, stream=stream and not count_only,
                                tools=fields.tool_setup(tools, choice, parallel), warnings=warnings)
    _thinking(body, request)
    constraint, field = _output_format(body)
    if constraint is not None:
        request.options = dataclasses.replace(request.options, constraint=constraint)
        request.constraint_field = field
    if body.get("thread") not in (None, False):  # the handler resolves threads (serve/threads.py) before this
        raise APIError(400, "'thread' is not taken here: send the whole conversation in 'messages'", param="thread",
                       code="unsupported_parameter")
    return request


def _thinking(body: dict, request: GenerationRequest) -> None:
    """`thinking` and `output_config.effort` onto the template's switch (`prepare` answers without thinking,
    with a warning, on a template that has none)."""
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise bad_value("thinking", "{'type': 'enabled' | 'disabled' | 'adaptive'}", thinking)
        request.reasoning_effort = "none" if thinking["type"] == "disabled" else "high"
        request.reasoning_field = "thinking"
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_value("output_config", "an object ({'effort': ..., 'format': ...})", config)
    effort = (config or {}).get("effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise bad_value("output_config.effort", f"one of {list(_EFFORTS)}", effort)
        if request.reasoning_effort != "none":  # thinking disabled wins: the effort then only sizes the answer
            request.reasoning_effort, request.reasoning_field = _EFFORTS[effort], "output_config.effort"


def _output_format(body: dict) -> tuple[Any, str | None]:
    """`output_config.format` (structured outputs, {"type": "json_schema", "schema": ...}) as a constraint."""
    form = (body.get("output_config") or {}).get("format")
    if form is None:
        return None, None
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        raise bad_value("output_config.format", "{'type': 'json_schema', 'schema': {...}}", form)
    try:
        constraint, _ = fields.openai_constraint({"response_format": {"type": "json_schema", "json_schema": {"schema": form.get("schema")}}})
    except APIError as err:
        err.param = "output_config.format"
        err.message = err.message.replace("response_format.json_schema", "output_config.format").replace("response_format", "output_config.format")
        raise
    return constraint, "output_config.format"


class AnthropicWriter:
    """One message: content blocks (thinking, text, tool_use) whole, or Anthropic's event stream."""

    def __init__(self, request: GenerationRequest, job: Any, *, model_id: str, speculative: bool, tokenizer: Any) -> None:
        self.request, self.job, self.model_id, self.tokenizer = request, job, model_id, tokenizer
        self.id = f"msg_{secrets.token_hex(12)}"
        self.tally = Tally(speculative=speculative, warnings=request.warnings)
        self.blocks: list[dict] = []  # the message's content, as it grows
        self._open: int | None = None  # index of the block being streamed
        self._streaming_call: str | None = None  # id of the tool_use whose input is streaming
        self.finish_reason: str | None = None
        self.finished = False  # the answer is complete (the handler stops reading the job)
        self._started = False

    def start_events(self, prompt_tokens: int = 0) -> list[tuple[str, dict]]:
        """`message_start`, sent before the prefill (the first token can be minutes away on a long prompt)."""
        self._started = True
        message = self._message(content=[], stop_reason=None, stop_sequence=None)
        message["usage"]["input_tokens"] = prompt_tokens
        return [("message_start", {"type": "message_start", "message": message})]

    def keepalive_events(self, waited_s: float) -> list[tuple[str, dict]]:
        """A `ping`; once the wait passes `TEXT_KEEPALIVE_S`, an empty `text_delta` too (in a text block
        opened for it, which the answer's text continues): Claude Code's stream watchdog (300 s) counts
        every event but pings."""
        events = [("ping", {"type": "ping"})]
        if waited_s < TEXT_KEEPALIVE_S or self.tally.last is not None:
            return events
        if self._open is None:
            self.blocks.append({"type": "text", "text": ""})
            self._open = len(self.blocks) - 1
            events.append(("content_block_start", {"type": "content_block_start", "index": self._open,
                                                   "content_block": {"type": "text", "text": ""}}))
        return events + [("content_block_delta", {"type": "content_block_delta", "index": self._open,
                                                  "delta": {"type": "text_delta", "text": ""}})]

    def _events_for(self, kind: str, value: Any) -> list[tuple[str, dict]]:
        events = []
        block_type = {"content": "text", "reasoning": "thinking"}.get(kind, "tool_use")
        last = self.blocks[-1] if self.blocks else None
        if kind in ("content", "reasoning") and last is not None and last["type"] == block_type and self._open is not None:
            key = "text" if block_type == "text" else "thinking"
            last[key] += value
            delta = {"type": "text_delta", "text": value} if block_type == "text" else {"type": "thinking_delta", "thinking": value}
            return [("content_block_delta", {"type": "content_block_delta", "index": self._open, "delta": delta})]
        if kind == "tool_call_delta":
            return [("content_block_delta", {"type": "content_block_delta", "index": self._open,
                                             "delta": {"type": "input_json_delta", "partial_json": value}})]
        if kind == "tool_call_cut":  # as Anthropic's API: the stream has its start; the message leaves it out
            if value is not None and self._streaming_call == value.id:
                self._streaming_call = None
                self.blocks.pop()
                return self._close()
            return []
        if kind == "tool_call" and self._streaming_call == value.id:  # its arguments streamed: close it
            self.blocks[-1]["input"] = value.parsed_arguments()
            self._streaming_call = None
            return self._close()
        events += self._close()
        index = len(self.blocks)
        if kind in ("tool_call", "tool_call_begin"):
            block = {"type": "tool_use", "id": f"toolu_{value.id[5:]}", "name": value.name, "input": {}}
            self.blocks.append(block)
            events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": {**block, "input": {}}}))
            self._open = index
            if kind == "tool_call_begin":
                self._streaming_call = value.id
                return events
            block["input"] = value.parsed_arguments()
            events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "input_json_delta", "partial_json": value.arguments}}))
            return events + self._close()
        block = {"type": "text", "text": ""} if block_type == "text" else {"type": "thinking", "thinking": "", "signature": ""}
        self.blocks.append(block)
        self._open = index
        events.append(("content_block_start", {"type": "content_block_start", "index": index, "content_block": dict(block)}))
        return events + self._events_for(kind, value)

    def _close(self) -> list[tuple[str, dict]]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _usage(self) -> dict:
        return {"input_tokens": self.tally.prompt_tokens - self.tally.cached_tokens, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": self.tally.cached_tokens, "output_tokens": self.tally.completion_tokens}

    def _message(self, *, content: list[dict], stop_reason: str | None, stop_sequence: str | None) -> dict:
        usage = self._usage()
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model_id, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage, "dspark": self.tally.stats()}

    def _stop(self) -> tuple[str, str | None]:
        if self.finish_reason == "length" and not self.job.reader.ended:
            return "max_tokens", None
        if any(block["type"] == "tool_use" for block in self.blocks):
            return "tool_use", None
        tokens = self.tally.tokens
        if tokens and tokens[-1] in set(self.tokenizer.eos_token_ids):
            return "end_turn", None
        whole, shown = self.tokenizer.decode(tokens), "".join(self.tally.text)
        found = [(whole.find(s, max(0, len(shown) - len(s))), s) for s in self.request.options.stop]
        found = [f for f in found if f[0] >= 0]
        return ("stop_sequence", min(found)[1]) if found else ("end_turn", None)

    def add(self, step: StepResponse) -> list[tuple[str, dict]]:
        self.tally.add(step)
        done = step.finish_reason is not None
        events: list[tuple[str, dict]] = [] if self._started else self.start_events(step.prompt_tokens)
        reader = self.job.reader
        for kind, value in reader.add(step.text, final=done):
            if value or kind == "tool_call_cut":
                events += self._events_for(kind, value)
        if reader.ended:  # the one call allowed is complete: the answer ends here
            done = True
        if done:
            self.finish_reason, self.finished = step.finish_reason or "stop", True
            note_cut_call(self.request, reader, self.finish_reason)
            events += self._close()
            stop_reason, stop_sequence = self._stop()
            events.append(("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                             "usage": self._usage()}))
            events.append(("message_stop", {"type": "message_stop"}))
        return events

    def error_events(self, err: APIError) -> list[tuple[str, dict]]:
        return [("error", err.anthropic_body())]

    def body(self) -> dict:
        stop_reason, stop_sequence = self._stop()
        return self._message(content=self.blocks, stop_reason=stop_reason, stop_sequence=stop_sequence)
