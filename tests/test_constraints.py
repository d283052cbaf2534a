"""Constrained decoding: every kind of constraint gives valid output, and speculative == plain greedy.

The tiny random pair writes nonsense, which is what a grammar is for: whatever the target prefers, the
output must match. Greedy speculative decoding (draft masked or unmasked) must give exactly the tokens of
constrained plain greedy decoding.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import mlx_dspark
from mlx_dspark.engine.logits.constraints import Constraint, ConstraintError, ToolCallShape

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "count", "tags", "ok"],
    "additionalProperties": False,
}
TOOL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
PROMPTS = ["Hello", "def add(a, b):", "The quick brown fox"]
MODES = [  # (speculative, mask_draft)
    (True, True),
    (True, False),
]


@pytest.fixture(scope="module")
def model(tiny_spark_pair):
    target, draft = tiny_spark_pair
    return mlx_dspark.load(str(target), draft=str(draft))


def _run(model, prompt, constraint, *, speculative=True, mask_draft=True, max_tokens=80, **kw):
    return mlx_dspark.generate(
        model, prompt, constraint=constraint, max_tokens=max_tokens, speculative=speculative, mask_draft=mask_draft, **kw
    )


def _check_identical(model, prompt, constraint, **kw):
    plain = _run(model, prompt, constraint, speculative=False, **kw)
    for speculative, mask_draft in MODES:
        spec = _run(model, prompt, constraint, speculative=speculative, mask_draft=mask_draft, **kw)
        assert spec.tokens == plain.tokens, (prompt, constraint.kind, mask_draft)
        assert spec.rounds > 0
        if mask_draft and spec.rounds > 2:  # the masked draft keeps proposing after its first round
            assert sum(spec.proposal_lengths[1:]) > 0, spec.proposal_lengths
    return plain


@pytest.mark.parametrize("prompt", PROMPTS)
def test_json_schema_answers_validate_and_speculative_equals_plain(model, prompt):
    result = _check_identical(model, prompt, Constraint.json_schema(SCHEMA), max_tokens=120)
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), SCHEMA)


def test_json_schema_given_as_text_and_json_object(model):
    result = _check_identical(model, "Hello", Constraint.json_schema(json.dumps(SCHEMA)), max_tokens=120)
    jsonschema.validate(json.loads(result.text), SCHEMA)
    result = _check_identical(model, "Hello", Constraint.json_object(), max_tokens=60)
    if result.finish_reason == "stop":
        assert isinstance(json.loads(result.text), dict)
    else:  # ran out of tokens inside the object: 'length', never claimed complete
        assert result.text.startswith("{")


@pytest.mark.parametrize("pattern", [r"[a-z]{3,6}-[0-9]{2}", r"(yes|no|maybe)", r"\d{4}-\d{2}-\d{2}"])
def test_regex_output_matches_in_full(model, pattern):
    result = _check_identical(model, "The quick brown fox", Constraint.regex(pattern), max_tokens=30)
    assert result.finish_reason == "stop"
    assert re.fullmatch(pattern, result.text), result.text


def test_lark_and_gbnf_grammars(model):
    lark = 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/ | "x"'
    gbnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] [0-9]? | "x"'
    item = r"([0-9]{1,2}|x)"
    for text in (lark, gbnf):
        result = _check_identical(model, "Hello", Constraint.grammar(text), max_tokens=40)
        if result.finish_reason == "stop":
            assert re.fullmatch(rf"\({item}(,{item})*\)", result.text), result.text
        else:
            assert re.fullmatch(rf"\({item}(,{item})*,?", result.text) or result.text.startswith("("), result.text


def _tool_calls(text: str, begin: str, end: str) -> list[dict]:
    calls = re.findall(re.escape(begin) + r"(.*?)" + re.escape(end), text, flags=re.S)
    return [json.loads(c) for c in calls]


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_a_forced_tool_call_parses_and_validates(model, prompt):
    begin, end = "<tool_call>\n", "\n</tool_call>"
    constraint = Constraint.tool_calls([ToolCallShape(begin, TOOL_SCHEMA, end)], parallel=False)
    result = _check_identical(model, prompt, constraint, max_tokens=80)
    assert result.finish_reason == "stop", result.text
    calls = _tool_calls(result.text, begin, end)
    assert len(calls) == 1 and result.text.startswith(begin) and result.text.endswith(end)
    jsonschema.validate(calls[0], TOOL_SCHEMA)


def test_tool_call_alternatives_and_parallel_calls(model):
    other = {"type": "object", "properties": {"q": {"enum": ["x", "y"]}}, "required": ["q"], "additionalProperties": False}
    shapes = [ToolCallShape('{"name":"weather","arguments":', TOOL_SCHEMA, "}"), ToolCallShape('{"name":"search","arguments":', other, "}")]
    result = _check_identical(model, "Hello", Constraint.tool_calls(shapes, parallel=True), max_tokens=100)
    text = result.text
    assert text.startswith('{"name":"weather","arguments":') or text.startswith('{"name":"search","arguments":')
    # every complete call validates against its own tool's schema
    decoder = json.JSONDecoder()
    position = 0
    complete = 0
    while position < len(text):
        try:
            call, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break
        jsonschema.validate(call["arguments"], TOOL_SCHEMA if call["name"] == "weather" else other)
        complete += 1
        while position < len(text) and text[position] in " \t\r\n":
            position += 1
    assert complete >= 1


def test_sampled_constrained_output_is_valid_in_both_drafting_modes(model):
    constraint = Constraint.json_schema(SCHEMA)
    for draft_sampling in ("greedy", "sample"):
        for mask_draft in (True, False):
            for seed in range(3):
                result = _run(model, "Hello", constraint, temperature=1.0, seed=seed, draft_sampling=draft_sampling,
                              mask_draft=mask_draft, max_tokens=150)
                if result.finish_reason == "stop":
                    jsonschema.validate(json.loads(result.text), SCHEMA)
                else:
                    assert result.finish_reason == "length"


def test_a_constraint_that_cannot_finish_ends_with_length(model):
    result = _run(model, "Hello", Constraint.regex("a{50}"), max_tokens=5)
    assert result.finish_reason == "length" and set(result.text) <= {"a"}


@pytest.mark.parametrize(
    "build, field, words",
    [
        (lambda: Constraint.json_schema("{not json"), "json_schema", "not valid JSON"),
        (lambda: Constraint.json_schema([1, 2]), "json_schema", "JSON object"),
        (lambda: Constraint.json_schema({"type": "frobnicate"}), "json_schema", "frobnicate"),
        (lambda: Constraint.regex("[a-"), "regex", "regex"),
        (lambda: Constraint.regex(""), "regex", "non-empty"),
        (lambda: Constraint.grammar("start: undefined_rule"), "grammar", "undefined_rule"),
        (lambda: Constraint.grammar("root ::= ("), "grammar", ""),
        (lambda: Constraint.tool_calls([], parallel=False), "tool_calls", "non-empty"),
    ],
)
def test_bad_constraints_are_a_constraint_error_naming_the_problem(model, build, field, words):
    with pytest.raises(ConstraintError) as info:
        constraint = build()
        mlx_dspark.stream_generate(model, "Hello", constraint=constraint, max_tokens=4)  # compiled at the call
    assert info.value.field == field
    assert words in str(info.value)


def test_a_regex_that_matches_nothing_is_refused_before_model_work(model):
    with pytest.raises(ConstraintError, match="matches no text"):
        mlx_dspark.stream_generate(model, "Hello", constraint=Constraint.regex(r"[^\x00-\U0010FFFF]"), max_tokens=4)


def test_constraint_option_is_checked(model):
    with pytest.raises(mlx_dspark.OptionError, match="constraint"):
        mlx_dspark.GenerationOptions(constraint={"type": "json_object"})
