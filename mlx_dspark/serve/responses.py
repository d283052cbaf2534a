"""OpenAI's Responses API (`POST /v1/responses`): `input` (a string or items), `instructions`, function
tools, `function_call` / `function_call_output` items, `previous_response_id`; the answer as output
items (reasoning, message, function calls), whole or as its typed event stream.

`previous_response_id` resumes a conversation this server answered: the store keeps the messages of
as many recent responses as the prompt-cache pool keeps conversations, so the resumed prompt finds its
prefix in the pool; an id the store no longer holds (or a server without a prompt cache) is a 400
naming it, and the client sends the whole input instead.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any

from mlx_dspark.api import StepResponse
from mlx_dspark.serve import fields
from mlx_dspark.serve.errors import APIError, bad_value
from mlx_dspark.serve.protocol import CLIENT_TEMPLATE_KWARGS, GenerationRequest, Tally, note_cut_call, request_options

KEEPALIVE_EVENT_S = 60.0  # a stream with no token yet after this long gets events, not only comments
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponseStore:
    """The conversations of recent responses (messages, this answer included), least recent first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()  # handler threads share it

    def get(self, response_id: str) -> list[dict] | None:
        with self._lock:
            messages = self._items.get(response_id)
            if messages is not None:
                self._items.move_to_end(response_id)
            return None if messages is None else list(messages)

    def put(self, response_id: str, messages: list[dict]) -> None:
        if self.capacity < 1:
            return
        with self._lock:
            self._items[response_id] = messages
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"{where}[{i}]: only text parts are supported, got {kind!r}",
                               param=f"{where}[{i}]", code="unsupported_value")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_value(where, "a string or a list of text parts", content)


def _items(value: Any) -> list[dict]:
    """`input` items as chat messages: consecutive function calls join one assistant turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_value("input", "a string or a non-empty list of items", value)
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in _ROLES:
            messages.append({"role": _ROLES[item["role"]], "content": _content_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_value(where, "a function_call with call_id, name and arguments (strings)", item)
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_value(f"{where}.call_id", "the call_id of the function_call it answers", item.get("call_id"))
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _content_text(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier reasoning is not rendered again
        else:
            raise APIError(400, f"{where}: an item of type {kind!r} is not supported", param=where, code="unsupported_value")
    return messages


def _function(tool: dict) -> dict:
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def _tools(body: dict, warnings: list[str]) -> tuple[list[dict] | None, dict[str, str]]:
    """Function tools (a `namespace` gives its functions); hosted tools this server cannot run (`web_search`,
    `local_shell`, `custom`, ...) are dropped with a warning in the response rather than a 400 that stops
    an agent. Also the namespace of each namespaced function, for its calls."""
    tools = body.get("tools")
    if tools is None:
        return None, {}
    if not isinstance(tools, list):
        raise bad_value("tools", "a list of tools", tools)
    out, namespaces = [], {}
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append(_function(tool))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            for j, inner in enumerate(tool["tools"]):
                if not isinstance(inner, dict) or inner.get("type", "function") != "function":
                    warnings.append(f"tools[{i}].tools[{j}] is not a function tool: it was dropped")
                    continue
                out.append(_function(inner))
                if isinstance(inner.get("name"), str):
                    namespaces[inner["name"]] = tool.get("name")
        elif isinstance(kind, str):
            warnings.append(f"tools[{i}] ({kind!r}) is a tool type this server does not run: it was dropped")
        else:
            raise bad_value(f"tools[{i}]", "a tool object with a 'type'", tool)
    return out, namespaces


def _text_format(body: dict) -> dict:
    """`text.format` as chat's response_format (json_schema's schema sits beside its type here)."""
    text = body.get("text")
    if text is None:
        return {}
    form = text.get("format") if isinstance(text, dict) else None
    if not isinstance(form, dict):
        raise bad_value("text", "{'format': {'type': ...}}", text)
    if form.get("type") == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": form.get("schema")}}}
    return {"response_format": form}


def parse_request(body: Any, *, defaults: Any, template_kwargs: frozenset[str] = CLIENT_TEMPLATE_KWARGS,
                  store: ResponseStore) -> GenerationRequest:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    if body.get("input") is None:
        raise bad_value("input", "a string or a list of items", None)
    messages = _items(body["input"])
    previous = body.get("previous_response_id")
    history: list[dict] = []
    if previous is not None:
        history = store.get(previous) if isinstance(previous, str) else None
        if history is None:
            raise APIError(400, f"previous_response_id {previous!r} is not held by this server (it keeps the last "
                           f"{store.capacity} conversations, as its prompt cache does); send the whole input instead",
                           param="previous_response_id", code="previous_response_not_found")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_value("instructions", "a string", instructions)
    # As OpenAI's: a previous response's instructions are not carried over, only its conversation.
    history = [m for m in history if m["role"] != "system"]
    system = [{"role": "system", "content": instructions}] if instructions else []
    messages = system + history + messages
    knobs = {k: body.get(k) for k in ("temperature", "top_p", "top_k", "seed", "chat_template_kwargs")}
    knobs["max_tokens"] = body.get("max_output_tokens")
    try:
        options = request_options(knobs, defaults, template_kwargs)
    except APIError as err:
        if err.param == "max_tokens":
            err.param = "max_output_tokens"
        raise
    constraint, constraint_field = fields.openai_constraint(_text_format(body))
    if constraint is not None:
        options = dataclasses.replace(options, constraint=constraint)
        constraint_field = "text.format"
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_value("stream", "true or false", stream)
    warnings: list[str] = []
    tools, namespaces = _tools(body, warnings)
    request = GenerationRequest(kind="responses", prompt=messages, options=options, stream=stream,
                                constraint_field=constraint_field, warnings=warnings,
                                tools=fields.tool_setup(tools, body.get("tool_choice"), body.get("parallel_tool_calls")))
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad_value("reasoning", "{'effort': ...}", reasoning)
        request.reasoning_effort = fields.reasoning_effort(reasoning, "effort")
        request.reasoning_field = "reasoning.effort"
    request.extra = {"previous_response_id": previous, "instructions": instructions, "namespaces": namespaces}
    return request


class ResponsesWriter:
    """One response: output items whole, or the typed events (`response.created` ... `response.completed`)."""

    def __init__(self, request: GenerationRequest, job: Any, *, model_id: str, speculative: bool, tokenizer: Any,
                 store: ResponseStore) -> None:
        self.request, self.job, self.model_id, self.store = request, job, model_id, store
        self.id = f"resp_{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.tally = Tally(speculative=speculative, warnings=request.warnings)
        self.output: list[dict] = []
        self._open = False  # the last output item is still streaming
        self._sequence = 0
        self.finish_reason: str | None = None
        self.finished = False  # the answer is complete (the handler stops reading the job)
        self._started = False

    def start_events(self, prompt_tokens: int = 0) -> list[tuple[str, dict]]:
        """`response.created` and `response.in_progress`, sent before the prefill."""
        self._started = True
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def keepalive_events(self, waited_s: float) -> list:
        """An SSE comment; once the wait passes a minute, `response.in_progress` again: Codex's stream idle
        timeout (300 s) counts events, not comments."""
        if waited_s < KEEPALIVE_EVENT_S or self.tally.last is not None:
            return []
        return [self._event("response.in_progress", response=self.response("in_progress"))]

    def _event(self, kind: str, **payload: Any) -> tuple[str, dict]:
        self._sequence += 1
        return kind, {"type": kind, "sequence_number": self._sequence - 1, **payload}

    def response(self, status: str) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        usage = {"input_tokens": self.tally.prompt_tokens, "input_tokens_details": {"cached_tokens": self.tally.cached_tokens},
                 "output_tokens": self.tally.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": self.tally.prompt_tokens + self.tally.completion_tokens}
        setup = self.request.tools
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model_id,
                "output": self.output, "error": None, "incomplete_details": incomplete,
                "instructions": self.request.extra.get("instructions"), "metadata": {},
                "parallel_tool_calls": setup.parallel, "tool_choice": setup.choice.mode if setup.choice.mode != "named"
                else {"type": "function", "name": setup.choice.name},
                "tools": [{"type": "function", **t["function"]} for t in setup.tools],
                "temperature": self.request.options.sampling.temperature, "top_p": self.request.options.sampling.top_p,
                "previous_response_id": self.request.extra.get("previous_response_id"),
                "usage": usage if status != "in_progress" else None, "dspark": self.tally.stats()}

    def _close(self, status: str = "completed") -> list[tuple[str, dict]]:
        """Close the open item; `status` "incomplete" for the item the output ended inside (max_output_tokens)."""
        if not self._open:
            return []
        self._open = False
        index, item = len(self.output) - 1, self.output[-1]
        item["status"] = status
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                   text=part["text"]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                                   part=part)]
        elif item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      arguments=item["arguments"]))
        else:
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=item["content"][0]["text"]))
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _cut(self, value: Any) -> list[tuple[str, dict]]:
        """A call the output ended inside: its item is `incomplete`, its arguments left empty (never a
        call a client could run)."""
        last = self.output[-1] if self.output else None
        if value is None or not self._open or last["type"] != "function_call" or last["call_id"] != value.id:
            return []
        self._open = False
        last.update(status="incomplete", arguments="")
        return [self._event("response.output_item.done", output_index=len(self.output) - 1, item=last)]

    def _events_for(self, kind: str, value: Any) -> list[tuple[str, dict]]:
        if kind == "tool_call_cut":
            return self._cut(value)
        item_type = {"content": "message", "reasoning": "reasoning"}.get(kind)
        last = self.output[-1] if self.output else None
        if item_type and self._open and last["type"] == item_type:
            last["content"][0]["text"] += value
            delta = "response.output_text.delta" if item_type == "message" else "response.reasoning_text.delta"
            return [self._event(delta, item_id=last["id"], output_index=len(self.output) - 1, content_index=0, delta=value)]
        if kind == "tool_call_delta":
            last["arguments"] += value
            return [self._event("response.function_call_arguments.delta", item_id=last["id"],
                                output_index=len(self.output) - 1, delta=value)]
        if kind == "tool_call" and self._open and last["type"] == "function_call" and last["call_id"] == value.id:
            last["arguments"] = value.arguments  # its arguments streamed: the parsed call closes it
            return self._close()
        events = self._close()
        index = len(self.output)
        if kind in ("tool_call", "tool_call_begin"):
            item = {"type": "function_call", "id": f"fc_{value.id[5:]}", "call_id": value.id, "name": value.name,
                    "arguments": "", "status": "in_progress"}
            namespace = self.request.extra.get("namespaces", {}).get(value.name)
            if namespace:
                item["namespace"] = namespace
            self.output.append(item)
            self._open = True
            events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
            if kind == "tool_call_begin":
                return events
            return events + self._events_for("tool_call_delta", value.arguments) + self._close()
        if item_type == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            item = {"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": "in_progress", "role": "assistant",
                    "content": [part]}
        else:
            part = {"type": "reasoning_text", "text": ""}
            item = {"type": "reasoning", "id": f"rs_{secrets.token_hex(12)}", "summary": [], "content": [part]}
        self.output.append(item)
        self._open = True
        events.append(self._event("response.output_item.added", output_index=index, item={**item, "content": []}))
        if item_type == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        return events + self._events_for(kind, value)

    def add(self, step: StepResponse) -> list[tuple[str, dict]]:
        self.tally.add(step)
        done = step.finish_reason is not None
        events: list[tuple[str, dict]] = [] if self._started else self.start_events()
        reader = self.job.reader
        for kind, value in reader.add(step.text, final=done):
            if value or kind == "tool_call_cut":
                events += self._events_for(kind, value)
        if reader.ended:  # the one call allowed is complete: the answer ends here
            done = True
        if done:
            self.finish_reason = "stop" if reader.ended else step.finish_reason
            self.finished = True
            note_cut_call(self.request, reader, self.finish_reason)
            events += self._close(self._status())  # an answer cut by max_output_tokens: its last item is cut too
            self._remember()
            status = self._status()
            events.append(self._event(f"response.{status}", response=self.response(status)))
        return events

    def _status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def _remember(self) -> None:
        """This conversation, the answer included, for a later previous_response_id."""
        out = self.job.reader.output
        answer: dict = {"role": "assistant", "content": out.content}
        if out.tool_calls:
            answer["tool_calls"] = [call.to_openai() for call in out.tool_calls]
        self.store.put(self.id, list(self.request.prompt) + [answer])

    def error_events(self, err: APIError) -> list[tuple[str, dict]]:
        return [self._event("error", code=err.code, message=err.message, param=err.param)]

    def body(self) -> dict:
        return self.response(self._status())
