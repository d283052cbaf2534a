"""The OpenAI wire format: request bodies -> generation requests, steps -> response bodies and chunks.

Pure functions of dicts and `StepResponse`s: no sockets, no threads, no model. Fields that clients
send and that do not change the output (`user`, `metadata`, `store`, ...) are ignored, as other
OpenAI-compatible servers do; a field whose value we cannot honour (`n` > 1, `logprobs`, `tools`,
`echo`, ...) is a 400 that names it rather than a silently different answer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any

from mlx_dspark.api import ResultCollector, length_histogram
from mlx_dspark.chat_format.prompt import encode_prompt, fold_system_messages, is_template_error
from mlx_dspark.chat_format.reasoning import REASONING_EFFORTS, has_thinking_switch, reasoning_switch
from mlx_dspark.chat_format.turn import ToolSetup
from mlx_dspark.engine.options import GenerationOptions, OptionError
from mlx_dspark.serve import fields
from mlx_dspark.serve.errors import APIError, bad_value  # noqa: F401  (APIError re-exported)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# apply_chat_template arguments the server sets itself, or that change what it returns
RESERVED_TEMPLATE_KWARGS = ("conversation", "add_generation_prompt", "tokenize", "return_dict", "return_tensors")
# The chat template switches a client may set (`chat_template_kwargs`): the thinking switches of the
# targets' templates (Qwen3's enable_thinking, Spark's thinking_effort) and OpenAI's reasoning_effort.
# Anything else, `chat_template` above all (it replaces the operator's template: `{{ 'x' * 2000000 }}`
# renders a 2M-token prompt), is a 400; `--allow-template-kwarg NAME` extends the list.
CLIENT_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking_effort", "reasoning_effort"})
# Names an operator cannot open to clients: the reserved ones, and the template itself.
NEVER_CLIENT_TEMPLATE_KWARGS = frozenset(RESERVED_TEMPLATE_KWARGS) | {"chat_template", "tools", "documents"}
MAX_TEMPLATE_VALUE_CHARS = 64
MAX_STOP_SEQUENCES = 16
# What a request gets for the fields it leaves out, unless the command line says otherwise.
SERVER_DEFAULTS = GenerationOptions(max_tokens=512)
# Requests the command-line server serves at once unless told (benchmarks/RESULTS.md section 14: with 4
# clients batched speculation serves 3.1x the tokens of the one-at-a-time queue and each client gets
# more tokens/s than queued; 8 at once reach 3.8x, but each request slows to 2/3 of its speed at 4 and
# twice the caches are held; one client alone runs as fast as in the queue).
DEFAULT_MAX_BATCH = 4


@dataclass
class GenerationRequest:
    kind: str  # the surface that parsed it and writes the answer: "chat", "text", "anthropic" or "responses"
    prompt: str | list[int] | list[dict]  # what api.stream_generate takes
    options: GenerationOptions  # the server's defaults (the CLI flags) with the request's fields over them
    stream: bool = False
    include_usage: bool = False
    tools: ToolSetup = ToolSetup()
    reasoning_effort: str | None = None  # set on the template's switch by `prepare` (it needs the tokenizer)
    reasoning_field: str = "reasoning_effort"
    constraint_field: str | None = None  # the request field `options.constraint` came from (for its 400s)
    extra: dict = dataclasses.field(default_factory=dict)  # what one surface keeps for its answer
    # what the answer should tell the client it did differently (a field or header of the response)
    warnings: list[str] = dataclasses.field(default_factory=list)
    _prepared: tuple[list[int], GenerationOptions] | None = dataclasses.field(default=None, init=False, repr=False)

    def prepare(self, tokenizer: Any) -> tuple[list[int], GenerationOptions]:
        """The prompt's token ids and the final options: what needs the tokenizer (the reasoning switch,
        the tools rendered by the template, the constraint forcing a call). ValueErrors with a `field`.

        Done once: the handler prepares a request before it answers (so a bad prompt is a plain 400 and
        the headers can carry the warnings), the worker then reads the same result."""
        if self._prepared is None:
            self._prepared = self._prepare(tokenizer)
        return self._prepared

    def _switch(self, tokenizer: Any) -> dict:
        effort = self.reasoning_effort
        if effort in REASONING_EFFORTS and not has_thinking_switch(tokenizer):
            # As the hosted APIs do for models that cannot think: the answer comes without thinking,
            # and says so, instead of a 400 that stops an agent whose settings ask for thinking.
            if effort not in ("none", "minimal"):
                self.warnings.append(f"'{self.reasoning_field}' asks for thinking, but this model's chat template has "
                                     "no thinking switch: answered without thinking")
            return {}
        return reasoning_switch(tokenizer, effort, field=self.reasoning_field)

    def _prepare(self, tokenizer: Any) -> tuple[list[int], GenerationOptions]:
        options = self.options
        if self.reasoning_effort is not None:
            switch = self._switch(tokenizer)
            if switch:
                options = dataclasses.replace(options, chat_template_kwargs={**(options.chat_template_kwargs or {}), **switch})
        ids = self._encode(tokenizer, options)
        choice_field = "tool_choice"
        constraint = self.tools.constraint(tokenizer, field=choice_field)
        if constraint is not None:
            if self.constraint_field is not None:  # the forced call is the answer: the format has nothing to shape
                self.warnings.append(f"'{choice_field}' forces a tool call: '{self.constraint_field}' does not apply to "
                                     "this answer")
            options = dataclasses.replace(options, constraint=constraint)
            self.constraint_field = choice_field
        return ids, options

    def _encode(self, tokenizer: Any, options: GenerationOptions) -> list[int]:
        """The template's rendering; a system message after the first turn (Claude Code sends them) is
        rendered at its place, or, when the template refuses that, joined to the leading system prompt."""
        encode = functools.partial(encode_prompt, tokenizer, chat_template_kwargs=options.chat_template_kwargs,
                                   tools=self.tools.offered)
        try:
            return encode(self.prompt)
        except Exception as err:  # noqa: BLE001  (only a template's own error is retried, without mid-conversation system turns)
            folded = fold_system_messages(self.prompt) if is_template_error(err) else None
            if folded is None:
                raise
            self.warnings.append("the chat template refuses system messages after the first turn: they were joined "
                                 "to the system prompt")
            return encode(folded)


# -- reading fields --------------------------------------------------------------------------------


_bad = bad_value


def _number(body: dict, name: str, default: float) -> float:
    """A JSON number (its range is the options' to check)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, "a number", value)
    return float(value)


def _integer(body: dict, name: str, default: int | None) -> int | None:
    """A JSON integer (its range is the options' to check)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JavaScript clients send 64.0
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, "an integer", value)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "a string or a list of strings", value)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _bad("stop", f"at most {MAX_STOP_SEQUENCES} sequences", f"{len(stops)} sequences")
    return stops


def _reject_unsupported(body: dict) -> None:
    """Options whose value would change the answer in a way we cannot give: a 400 naming them."""
    n = _integer(body, "n", 1)
    if n != 1:
        raise APIError(400, f"only n=1 is supported, got n={n}", param="n", code="unsupported_value")
    best_of = _integer(body, "best_of", 1)
    if best_of != 1:
        raise APIError(400, f"only best_of=1 is supported, got {best_of}", param="best_of", code="unsupported_value")
    for name in ("echo", "suffix", "functions"):
        if body.get(name) not in (None, False, 0, "", []):
            raise APIError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")


def check_template_kwarg_names(names: Any) -> frozenset[str]:
    """The operator's extra client template switches (`--allow-template-kwarg`), checked at startup."""
    for name in names:
        if not (isinstance(name, str) and name.isidentifier()):
            raise ValueError(f"--allow-template-kwarg must be a template variable name, got {name!r}")
        if name in NEVER_CLIENT_TEMPLATE_KWARGS:
            raise ValueError(f"--allow-template-kwarg {name}: this argument cannot come from clients "
                             f"(never: {', '.join(sorted(NEVER_CLIENT_TEMPLATE_KWARGS))})")
    return CLIENT_TEMPLATE_KWARGS | frozenset(names)


def _template_kwargs(body: dict, allowed: frozenset[str]) -> dict:
    """`chat_template_kwargs`: only the allowed switches, each true/false or a short string."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad("chat_template_kwargs", "an object", value)
    for name, item in value.items():
        param = f"chat_template_kwargs.{name}"
        if name not in allowed:
            raise APIError(
                400, f"'{param}' is not a template switch clients may set (allowed: {', '.join(sorted(allowed))}; "
                "the server's operator can allow more with --allow-template-kwarg)",
                param=param, code="template_kwarg_not_allowed",
            )  # fmt: skip
        if not (isinstance(item, bool) or (isinstance(item, str) and len(item) <= MAX_TEMPLATE_VALUE_CHARS)):
            raise _bad(param, f"true, false or a string of at most {MAX_TEMPLATE_VALUE_CHARS} characters",
                       item if not isinstance(item, str) else f"a string of {len(item)} characters")
    return value


def request_options(body: dict, defaults: GenerationOptions, allowed_template_kwargs: frozenset[str]) -> GenerationOptions:
    """The request's knobs over the server defaults, validated by the options object (a 400 naming the field)."""
    max_tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    template_kwargs = _template_kwargs(body, allowed_template_kwargs)
    sampling = defaults.sampling
    try:
        return defaults.replace(
            max_tokens=_integer(body, max_tokens_field, defaults.max_tokens),
            # without max_tokens the server's default is shortened to the context a long prompt leaves (as OpenAI does)
            clamp_max_tokens=body.get(max_tokens_field) is None,
            stop=_stop(body) or list(defaults.stop),  # the operator's --stop when the request has none
            chat_template_kwargs={**(defaults.chat_template_kwargs or {}), **(template_kwargs or {})} or None,
            temperature=_number(body, "temperature", sampling.temperature),
            top_p=_number(body, "top_p", sampling.top_p),
            top_k=_integer(body, "top_k", sampling.top_k),
            min_p=_number(body, "min_p", sampling.min_p),
            seed=_integer(body, "seed", sampling.seed),
        )
    except OptionError as err:
        param = max_tokens_field if err.field == "max_tokens" else err.field
        message = str(err) if param == err.field else f"'{param}': {err}"
        raise APIError(400, message, param=param, code="invalid_value") from None


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _flag(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise _bad("stream_options", "an object", stream_options)
    include_usage = stream and _flag(stream_options or {}, "include_usage")
    return stream, include_usage


def _message_text(content: Any, index: int) -> str:
    """A message's content as text: a string, null (assistant tool turns) or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"messages[{index}].content: only text parts are supported, got {kind!r}",
                               param=f"messages[{index}].content", code="unsupported_value")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(f"messages[{index}].content", "a string or a list of text parts", content)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of messages", messages)
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}]", "an object with 'role' and 'content'", message)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"messages[{i}].role", f"one of {list(CHAT_ROLES)}", role)
        # Chat templates know "system"; "developer" is OpenAI's newer name for it.
        item = {"role": "system" if role == "developer" else role, "content": _message_text(message.get("content"), i)}
        if role == "assistant" and message.get("tool_calls") is not None:
            _check_history_calls(message["tool_calls"], i)
        for key in ("name", "tool_call_id", "tool_calls"):
            if key in message:
                item[key] = message[key]
        rendered.append(item)
    return rendered


def _check_history_calls(calls: Any, index: int) -> None:
    """An assistant turn's `tool_calls`: function calls whose arguments are JSON text (OpenAI's shape)."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(where, "a list of tool calls", calls)
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{where}[{j}].function", "an object with a 'name' and 'arguments'", function)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, (str, dict)):
            raise _bad(f"{where}[{j}].function.arguments", "a JSON string", arguments)
        # Text that is not JSON (a client's record of a call cut short) is taken back as it is: the template
        # renders it as written rather than the conversation failing on it.


def _completion_prompt(body: dict) -> str | list[int]:
    """A string, token ids, or a one-element list of either (what the openai client sends)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise _bad("prompt", "a non-empty string or list of token ids (one prompt per request)", prompt)


def parse_request(
    kind: str, body: Any, *, defaults: GenerationOptions, template_kwargs: frozenset[str] = CLIENT_TEMPLATE_KWARGS
) -> GenerationRequest:
    """Validate a /v1/chat/completions (kind "chat") or /v1/completions ("text") body; `template_kwargs` are
    the chat template switches a client may set."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    _reject_unsupported(body)
    prompt = _messages(body) if kind == "chat" else _completion_prompt(body)
    stream, include_usage = _stream_flags(body)
    options = fields.draft_tokens(body, fields.sampling_extras(body, request_options(body, defaults, template_kwargs)))
    options = fields.tree_nodes(body, options)
    options = fields.with_logprobs(options, fields.openai_logprobs(body, kind), field="logprobs")
    constraint, constraint_field = fields.openai_constraint(body)
    if constraint is not None:
        options = dataclasses.replace(options, constraint=constraint)
    request = GenerationRequest(kind=kind, prompt=prompt, options=options, stream=stream, include_usage=include_usage,
                                constraint_field=constraint_field)
    if kind == "chat":
        request.tools = fields.tool_setup(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
        request.reasoning_effort = fields.reasoning_effort(body)
    elif body.get("tools") not in (None, []):
        raise APIError(400, "'tools' belong to /v1/chat/completions", param="tools", code="unsupported_parameter")
    return request


# -- writing responses -----------------------------------------------------------------------------


def note_cut_call(request: GenerationRequest, reader: Any, finish_reason: str | None) -> None:
    """The warnings of an answer that ended inside a call, or without the call its tool_choice forces."""
    if reader is None:
        return
    if reader.cut:
        request.warnings.append("the output ended inside a tool call (max_tokens): the incomplete call is not a call")
    if request.tools.choice.forced and not reader.output.tool_calls and finish_reason == "length":
        request.warnings.append(f"tool_choice forces a call, but max_tokens ({request.options.max_tokens}) ran out "
                                "before the call was complete: raise max_tokens")


class Tally(ResultCollector):
    """Usage and speculative statistics of one request, read off the steps the collector joined."""

    def __init__(self, *, speculative: bool, warnings: list[str] | None = None) -> None:
        super().__init__()
        self.speculative = speculative
        self.warnings = warnings if warnings is not None else []  # the request's (shared: later ones show too)

    @property
    def prompt_tokens(self) -> int:
        return self.last.prompt_tokens if self.last else 0

    @property
    def completion_tokens(self) -> int:
        return self.last.generation_tokens if self.last else 0

    @property
    def cached_tokens(self) -> int:
        return self.last.cached_tokens if self.last else 0

    def usage(self) -> dict:
        """OpenAI's usage; `cached_tokens`: prompt tokens reused from a prompt cache instead of prefilled."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def stats(self) -> dict:
        """The extra `dspark` field: acceptance length counts the bonus token (accepted + 1 per round)."""
        last = self.last
        return {
            "speculative": self.speculative,
            "rounds": self.rounds,
            "mean_acceptance_length": round(sum(self.acceptance_lengths) / self.rounds, 3) if self.rounds else 0.0,
            "accepted_tokens": self.accepted_tokens,
            "proposed_tokens": self.proposed_tokens,
            # what the draft length policy did: drafts verified per round -> rounds (0: parked, the target alone)
            "draft_lengths": {str(n): count for n, count in length_histogram(self.proposal_lengths).items()},
            "rounds_parked": self.proposal_lengths.count(0),
            "generation_tps": round(last.generation_tps if last else 0.0, 3),
            "prompt_tps": round(last.prompt_tps if last else 0.0, 3),
            "time_to_first_token_s": round(self.first_time or 0.0, 4),
            **({"warnings": list(self.warnings)} if self.warnings else {}),
        }


@dataclass(frozen=True)
class Envelope:
    """What every body and chunk of one response shares: its id, object type, model and time."""

    kind: str  # "chat" or "text"
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, kind: str, model: str) -> Envelope:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind=kind, model=model, id=f"{prefix}-{secrets.token_hex(12)}", created=int(time.time()))

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}

    def full(self, *, text: str, finish_reason: str, tally: Tally) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": tally.usage(), "dspark": tally.stats()}

    def chunk(self, *, text: str, finish_reason: str | None = None, first: bool = False,
              tally: Tally | None = None) -> dict:
        """One streamed chunk; the chunk that finishes carries the `dspark` statistics."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        if tally is not None:
            body["dspark"] = tally.stats()
        return body

    def usage_chunk(self, tally: Tally) -> dict:
        """OpenAI's last chunk under `stream_options.include_usage`: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": tally.usage(), "dspark": tally.stats()}
