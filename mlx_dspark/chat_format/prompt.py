"""Prompts into token ids: a string as is, token ids as given, chat messages (and tools) through the chat
template, which renders assistant tool calls and tool results with its own tools support."""

from __future__ import annotations

import json
from typing import Any, Sequence


def check_text(text: str, what: str) -> None:
    """A lone surrogate (from JSON's "\\ud800", or undecodable bytes under surrogateescape) is not text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{what} holds an unpaired surrogate ({text[err.start]!r} at character {err.start}): it is not valid "
            "Unicode text (send valid UTF-8, or UTF-16 pairs in JSON escapes)"
        ) from None


def _template_tool_calls(calls: Any, index: int) -> list[dict]:
    """An assistant message's OpenAI `tool_calls` as templates read them: arguments as an object
    (Qwen3's template writes `arguments | tojson`; a JSON string would be written quoted)."""
    if not isinstance(calls, list):
        raise ValueError(f"chat message {index}: 'tool_calls' must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"chat message {index}: tool_calls[{j}] needs a 'function' with a 'name'")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass  # not JSON (a call cut short, as a client recorded it): the template writes the text as is
        out.append({**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Checked copies of chat messages, tool calls' arguments parsed for the template."""
    items = []
    for i, message in enumerate(messages):
        if "role" not in message or ("content" not in message and "tool_calls" not in message):
            raise ValueError(f"chat message {i} needs 'role' and 'content' keys, got {sorted(message)}")
        item = dict(message)
        content = item.get("content")
        if content is None:
            item["content"] = ""  # an assistant turn that only calls tools
        elif isinstance(content, str):
            check_text(content, f"chat message {i}")
        if item.get("tool_calls"):
            item["tool_calls"] = _template_tool_calls(item["tool_calls"], i)
        else:
            item.pop("tool_calls", None)
        items.append(item)
    return items


def encode_prompt(
    tokenizer: Any,
    prompt: str | Sequence[int] | Sequence[dict],
    *,
    chat_template_kwargs: dict | None = None,
    tools: Sequence[dict] | None = None,
) -> list[int]:
    """A string is used as is, token ids as given, chat messages through the chat template (with the
    function `tools`, checked by `tools.check_tools`, rendered by the template when given)."""
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    items = list(prompt)
    if not items:
        raise ValueError("the prompt is empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return items
    if all(isinstance(m, dict) for m in items):
        items = template_messages(items)
        if not getattr(tokenizer, "has_chat_template", True):
            raise ValueError("the tokenizer has no chat template: pass the prompt as a string")
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = list(tools)
        return list(tokenizer.apply_chat_template(items, add_generation_prompt=True, **kwargs))
    raise ValueError("prompt must be a string, a list of token ids, or a list of chat messages")


def is_template_error(err: BaseException) -> bool:
    """Whether rendering failed in the chat template itself (jinja's errors, its `raise_exception`, a
    ValueError of the tokenizer's): the request's fault, not ours."""
    return isinstance(err, ValueError) or type(err).__module__.startswith("jinja2")


def fold_system_messages(messages: Any) -> list[dict] | None:
    """Chat messages with every system message joined into one leading system message (None: nothing to fold)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    late = [i for i, m in enumerate(messages) if m.get("role") == "system" and i > 0]
    if not late:
        return None
    system = "\n\n".join(m.get("content") or "" for m in messages if m.get("role") == "system")
    return [{"role": "system", "content": system}] + [m for m in messages if m.get("role") != "system"]


def starts_in_reasoning(tokenizer: Any, prompt_ids: Sequence[int]) -> bool:
    """The generation prompt opened a thinking block (`<think>` after the last `</think>`): the
    output begins as reasoning, as mlx-lm's server reads it."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    ids = list(prompt_ids)
    return tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids)
