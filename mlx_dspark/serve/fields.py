"""Request fields beyond the sampling knobs, shared by the OpenAI, Anthropic and Responses surfaces:
tools and the tool choice, reasoning effort, penalties and logit bias, logprobs, and the constraint
fields (`response_format`, the `regex` / `grammar` extensions).

The penalties, logprobs and constraints are the engine's (`SamplingOptions` / `GenerationOptions`
fields, `engine/logits/constraints.py`); a build without one of them answers a request that sets it with a
400 naming the field, never a silently different answer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mlx_dspark.chat_format.reasoning import REASONING_EFFORTS
from mlx_dspark.chat_format.tools import ToolError
from mlx_dspark.chat_format.turn import ToolSetup
from mlx_dspark.engine.options import MAX_TREE_NODES, GenerationOptions, OptionError
from mlx_dspark.serve.errors import APIError, bad_value

MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_TOP_LOGPROBS = 20
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def has_field(obj: Any, name: str) -> bool:
    return any(f.name == name for f in dataclasses.fields(obj))


def unsupported(name: str, why: str) -> APIError:
    return APIError(400, f"'{name}' is not supported by this build: {why}", param=name, code="unsupported_parameter")


def tool_setup(tools: Any, tool_choice: Any, parallel: Any, *, field: str = "tools",
               choice_field: str = "tool_choice") -> ToolSetup:
    """OpenAI-format tools (already converted by the Anthropic / Responses surfaces) and their choice."""
    try:
        return ToolSetup.of(tools, tool_choice, parallel=True if parallel is None else parallel,
                            field=field, choice_field=choice_field)
    except ToolError as err:
        raise APIError(400, str(err), param=err.field, code="invalid_value") from None


def reasoning_effort(body: dict, name: str = "reasoning_effort") -> str | None:
    value = body.get(name)
    if value is not None and value not in REASONING_EFFORTS:
        raise bad_value(name, f"one of {list(REASONING_EFFORTS)}", value)
    return value


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_value(name, "a number", value)
    return float(value)


def _logit_bias(value: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (ids as strings in JSON), bias in [-100, 100]."""
    if not isinstance(value, dict):
        raise bad_value("logit_bias", "an object of token id -> bias", value)
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_value("logit_bias", f"at most {MAX_LOGIT_BIAS} entries", f"{len(value)} entries")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_value(f"logit_bias.{key}", "keyed by a token id", key) from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise bad_value(f"logit_bias.{key}", f"a token id in [0, {vocab_size})", token)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_value(f"logit_bias.{key}", "a number in [-100, 100]", bias)
        out.append((token, float(bias)))
    return tuple(out)


def sampling_extras(body: dict, options: GenerationOptions, *, vocab_size: int | None = None) -> GenerationOptions:
    """presence / frequency / repetition penalties, `penalty_last_n` (an extension) and logit_bias."""
    sampling, changes = options.sampling, {}
    for name in PENALTIES:
        value = _number(body, name)
        if value is not None:
            changes[name] = value
    last_n = body.get("penalty_last_n")
    if last_n is not None:
        if isinstance(last_n, bool) or not isinstance(last_n, int):
            raise bad_value("penalty_last_n", "an integer", last_n)
        changes["penalty_last_n"] = last_n
    if body.get("logit_bias") is not None:
        bias = _logit_bias(body["logit_bias"], vocab_size)
        if bias:
            changes["logit_bias"] = bias
    for name, value in changes.items():
        if not has_field(sampling, name):
            neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}.get(name)
            if value == neutral:
                continue  # the neutral value changes nothing
            raise unsupported(name, "penalties and biases need the engine's penalised sampling")
    changes = {k: v for k, v in changes.items() if has_field(sampling, k)}
    if not changes:
        return options
    try:
        return options.replace(**changes)
    except OptionError as err:
        raise APIError(400, str(err), param=err.field, code="invalid_value") from None


def draft_tokens(body: dict, options: GenerationOptions) -> GenerationOptions:
    """`max_draft_tokens` (an extension): "auto" (the default) or the most drafts one round verifies."""
    value = body.get("max_draft_tokens")
    if value is None:
        return options
    if not (value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)):
        raise bad_value("max_draft_tokens", '"auto" or an integer >= 1', value)
    return options.replace(max_draft_tokens=value)


def tree_nodes(body: dict, options: GenerationOptions) -> GenerationOptions:
    """`tree_nodes` (an extension): draft nodes one tree round verifies, "auto", or 0 for chain rounds; where a
    tree cannot run (lookup on, logits processing, a batched row) the request runs chain rounds (tree_fallback.py)."""
    value = body.get("tree_nodes")
    if value is None:
        return options
    if not (value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TREE_NODES)):
        raise bad_value("tree_nodes", f'"auto" or an integer in [0, {MAX_TREE_NODES}] (0: chain rounds)', value)
    return options.replace(tree_nodes=value)


def with_logprobs(options: GenerationOptions, count: int | None, *, field: str) -> GenerationOptions:
    """`count` top alternatives (0..20) beside each chosen token's logprob; None: off."""
    if count is None:
        return options
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_TOP_LOGPROBS:
        raise bad_value(field, f"an integer in [0, {MAX_TOP_LOGPROBS}]", count)
    if not has_field(options, "logprobs"):
        raise unsupported(field, "logprobs need the engine's logprobs support")
    return dataclasses.replace(options, logprobs=count)


def openai_logprobs(body: dict, kind: str) -> int | None:
    """chat: `logprobs: true` + `top_logprobs: N`; completions: `logprobs: N`."""
    value = body.get("logprobs")
    if kind == "chat":
        if value is None or value is False:
            if body.get("top_logprobs") is not None:
                raise bad_value("top_logprobs", "used with logprobs: true", body["top_logprobs"])
            return None
        if value is not True:
            raise bad_value("logprobs", "true or false", value)
        top = body.get("top_logprobs", 0)
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_value("top_logprobs", f"an integer in [0, {MAX_TOP_LOGPROBS}]", top)
        return top
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_value("logprobs", f"an integer in [0, {MAX_TOP_LOGPROBS}]", value)
    return value


def openai_constraint(body: dict) -> tuple[Any, str | None]:
    """`response_format` (text / json_object / json_schema) or the `regex` / `grammar` extension fields:
    (an engine Constraint or None, the field it came from)."""
    sources = []
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object", "json_schema"):
            raise bad_value("response_format", "{'type': 'text' | 'json_object' | 'json_schema', ...}", response_format)
        if response_format["type"] != "text":
            sources.append("response_format")
    for name in ("regex", "grammar"):
        if body.get(name) is not None:
            if not isinstance(body[name], str) or not body[name]:
                raise bad_value(name, "a non-empty string", body[name])
            sources.append(name)
    if not sources:
        return None, None
    if len(sources) > 1:
        raise APIError(400, f"give one constraint, got {', '.join(sources)}", param=sources[1], code="invalid_value")
    field = sources[0]
    try:
        from mlx_dspark.engine.logits.constraints import Constraint, ConstraintError
    except ImportError:
        raise unsupported(field, "constrained decoding is not in this build") from None
    try:
        if field == "regex":
            return Constraint.regex(body["regex"]), field
        if field == "grammar":
            return Constraint.grammar(body["grammar"]), field
        if response_format["type"] == "json_object":
            return Constraint.json_object(), field
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise bad_value("response_format.json_schema", "an object with a 'schema'", spec)
        return Constraint.json_schema(spec["schema"]), field
    except ConstraintError as err:
        raise APIError(400, f"'{field}': {err}", param=field, code="invalid_value") from None
