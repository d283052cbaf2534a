"""Function tools: their definitions checked, the tool choice, parsed calls, and the constraint that
forces a call (`tool_choice` "required" or a named function) in the template's tool-call syntax.

Tools travel in OpenAI's chat format (`{"type": "function", "function": {"name", "description",
"parameters"}}`), which is what chat templates render; the Anthropic and Responses surfaces convert
theirs to it. Forcing a call needs the engine's constrained decoding (`engine/logits/constraints.py`) and a
template whose call body is JSON (mlx-lm's `json_tools` parser: `<tool_call>{"name", "arguments"}</tool_call>`,
the Qwen3 format); anything else is a `ToolError` rather than an unforced answer.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Sequence

TOOL_CHOICES = ("auto", "none", "required")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
JSON_BODY_PARSERS = ("json_tools",)  # mlx-lm tool parsers whose call body is {"name": ..., "arguments": {...}}


class ToolError(ValueError):
    """A tool definition, tool choice or tool history we cannot use; `field` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"'{field}': {message}")
        self.field = field


@dataclass(frozen=True)
class ToolChoice:
    """"auto" (the model decides), "none" (no tools offered), "required" (at least one call) or
    "named" (a call of `name`)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is its JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = ""

    @classmethod
    def new(cls, name: str, arguments: Any) -> ToolCall:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(name=name, arguments=text, id=f"call_{secrets.token_hex(12)}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def parsed_arguments(self) -> Any:
        """The arguments as a value (Anthropic's `input`); text that is not JSON stays a string."""
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError:
            return self.arguments


def check_tools(tools: Any, *, field: str = "tools") -> list[dict]:
    """OpenAI function tools, checked and normalised (parameters default to an empty object schema)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError(field, f"must be a list of function tools, got {type(tools).__name__}")
    checked, names = [], set()
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ToolError(f"{where}.type", f"only function tools are supported, got {kind!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{where}.function", "must be an object with 'name' and 'parameters'")
        checked.append({"type": "function", "function": check_function(function, where=f"{where}.function")})
        name = checked[-1]["function"]["name"]
        if name in names:
            raise ToolError(f"{where}.function.name", f"the tool {name!r} is defined twice")
        names.add(name)
    return checked


def check_function(function: dict, *, where: str, parameters_key: str = "parameters") -> dict:
    """A function's name, description and parameter schema (`parameters_key`: Anthropic's `input_schema`)."""
    name = function.get("name")
    if not (isinstance(name, str) and _NAME.match(name)):
        raise ToolError(f"{where}.name", f"must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.description", f"must be a string, got {type(description).__name__}")
    parameters = function.get(parameters_key)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolError(f"{where}.{parameters_key}", f"must be a JSON Schema object, got {type(parameters).__name__}")
    # OpenAI's order (name, description, parameters): templates write the tool as JSON in this order
    out: dict[str, Any] = {"name": name}
    if description is not None:
        out["description"] = description
    out["parameters"] = parameters
    return out


def tool_names(tools: Sequence[dict]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


def check_choice(choice: ToolChoice, tools: Sequence[dict], *, field: str = "tool_choice") -> ToolChoice:
    """The choice against the tools: a forced choice needs tools, a named one a defined tool."""
    if choice.forced and not tools:
        raise ToolError(field, f"{choice.mode!r} needs 'tools'")
    if choice.mode == "named" and choice.name not in tool_names(tools):
        raise ToolError(field, f"names the function {choice.name!r}, which is not among the tools {tool_names(tools)}")
    return choice


def openai_choice(value: Any, *, field: str = "tool_choice") -> ToolChoice:
    """OpenAI's tool_choice: "auto" / "none" / "required" or {"type": "function", "function": {"name"}}
    (the Responses API's flat {"type": "function", "name"} too)."""
    if value is None:
        return ToolChoice()
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise ToolError(field, f"must be one of {list(TOOL_CHOICES)} or a named function, got {value!r}")
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function") if isinstance(value.get("function"), dict) else value
        if isinstance(function.get("name"), str):
            return ToolChoice("named", function["name"])
    raise ToolError(field, f"must be one of {list(TOOL_CHOICES)} or {{'type': 'function', 'function': {{'name': ...}}}}, "
                           f"got {value!r}")


def call_schema(tool: dict) -> dict:
    """The JSON a json_tools call body must be: this function's name and arguments of its parameters."""
    function = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": function["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_constraint(tokenizer: Any, tools: Sequence[dict], choice: ToolChoice, *, parallel: bool,
                           field: str = "tool_choice") -> Any:
    """The engine `Constraint` under which the output is one call (or, with `parallel`, several) of the
    chosen tools in the template's syntax; a ToolError when that cannot be built here."""
    try:
        from mlx_dspark.engine.logits.constraints import Constraint, ToolCallShape
    except ImportError:
        raise ToolError(field, f"{choice.mode!r} forces a tool call, which needs constrained decoding; this build "
                               "has none (use 'auto')") from None
    parser = getattr(tokenizer, "tool_parser", None)
    parser_name = getattr(parser, "__module__", "").rpartition(".")[2]
    if not getattr(tokenizer, "has_tool_calling", False) or parser_name not in JSON_BODY_PARSERS:
        raise ToolError(field, f"{choice.mode!r} forces a tool call, which needs a chat template whose calls are JSON "
                               f"({', '.join(JSON_BODY_PARSERS)}); this model's tool parser is {parser_name or 'none'!r}")
    chosen = [t for t in tools if choice.mode == "required" or t["function"]["name"] == choice.name]
    begin, end = f"{tokenizer.tool_call_start}\n", f"\n{tokenizer.tool_call_end}"
    shapes = [ToolCallShape(begin=begin, schema=call_schema(tool), end=end) for tool in chosen]
    return Constraint.tool_calls(shapes, parallel=parallel)
