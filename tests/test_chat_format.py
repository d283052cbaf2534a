"""chat_format/: the output read as reasoning / content / tool calls (whole and split at every point),
tools and tool choices checked, the reasoning switch per template family, tools and tool history
rendered by a real chat template (the tiny tools pair's), and api.generate(tools=...)."""

from __future__ import annotations

import json

import pytest

import mlx_dspark
from mlx_dspark.api import generate
from mlx_dspark.chat_format.output import OutputParser, parse_output
from mlx_dspark.chat_format.prompt import encode_prompt, starts_in_reasoning
from mlx_dspark.chat_format.reasoning import ReasoningError, reasoning_switch
from mlx_dspark.chat_format.tools import ToolChoice, ToolError, check_tools, openai_choice
from mlx_dspark.chat_format.turn import ToolSetup

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
THINK = ("<think>", "</think>")
CALLS = ("<tool_call>", "</tool_call>", lambda text: json.loads(text))


def _parser(**kw) -> OutputParser:
    return OutputParser(think=THINK, tools=CALLS, **kw)


OUTPUT = ('<think>\nplan: look it up\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
          '\n</tool_call>\n')


def test_a_whole_output_splits_into_reasoning_content_and_calls():
    out = parse_output(_parser(), OUTPUT)
    assert out.reasoning == "plan: look it up"
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                                           ("get_weather", {"city": "Oslo"})]
    assert len({c.id for c in out.tool_calls}) == 2 and all(c.id.startswith("call_") for c in out.tool_calls)


@pytest.mark.parametrize("cut", range(1, len(OUTPUT)))
def test_streamed_in_two_pieces_anywhere_the_output_reads_the_same(cut):
    parser, kinds = _parser(), {"content": "", "reasoning": "", "calls": []}
    for kind, value in parser.feed(OUTPUT[:cut]) + parser.feed(OUTPUT[cut:]) + parser.finish():
        if kind == "tool_call":
            kinds["calls"].append((value.name, value.arguments))
        else:
            kinds[kind] += value
    whole = parse_output(_parser(), OUTPUT)
    assert kinds["content"] == whole.content and kinds["reasoning"] == whole.reasoning
    assert kinds["calls"] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_plain_text_passes_unchanged_character_by_character():
    text = "def add(a, b):\n    return a + b  \n<thin"  # trailing spaces and a marker-like tail stay text
    parser = _parser()
    pieces = [v for ch in text for _, v in parser.feed(ch)] + [v for _, v in parser.finish()]
    assert "".join(pieces) == text


def test_a_prompt_that_opened_thinking_starts_as_reasoning_and_an_unclosed_call_is_left_out():
    out = parse_output(_parser(in_reasoning=True), "step one</think>Answer: <tool_call>{\"name\": ")
    assert out.reasoning == "step one"
    assert out.content == "Answer:"  # a call the output ended inside is neither a call nor text
    assert out.tool_calls == []


def test_a_call_the_parser_cannot_read_is_kept_as_content():
    out = parse_output(_parser(), "<tool_call>not json</tool_call>")
    assert out.content == "<tool_call>not json</tool_call>" and out.tool_calls == []


def test_tools_and_choices_are_checked_with_the_field_named():
    assert check_tools([WEATHER])[0]["function"]["name"] == "get_weather"
    cases = [
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function", "function": {"name": "no spaces"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools[0].function.parameters"),
        ([WEATHER, WEATHER], "tools[1].function.name"),
    ]
    for tools, field in cases:
        with pytest.raises(ToolError) as err:
            check_tools(tools)
        assert err.value.field == field
    assert openai_choice({"type": "function", "function": {"name": "get_weather"}}) == ToolChoice("named", "get_weather")
    assert openai_choice({"type": "function", "name": "f"}) == ToolChoice("named", "f")  # the Responses API's shape
    for bad in ("always", {"type": "function"}, 3):
        with pytest.raises(ToolError, match="tool_choice"):
            openai_choice(bad)
    with pytest.raises(ToolError, match="not among the tools"):
        ToolSetup.of([WEATHER], {"type": "function", "function": {"name": "other"}})
    with pytest.raises(ToolError, match="needs 'tools'"):
        ToolSetup.of(None, "required")


class _Template:
    def __init__(self, template):
        self.chat_template = template


def test_reasoning_effort_maps_onto_each_family_s_switch_and_an_unknown_template_refuses():
    spark, qwen = _Template("{% if thinking_effort %}<think>{% endif %}"), _Template("{{ enable_thinking }}")
    assert reasoning_switch(spark, "low") == {"thinking_effort": "low"}
    assert reasoning_switch(spark, "medium") == {"thinking_effort": "high"}
    assert reasoning_switch(spark, "none") == {"thinking_effort": None}
    assert reasoning_switch(qwen, "minimal") == {"enable_thinking": False}
    assert reasoning_switch(qwen, "high") == {"enable_thinking": True}
    with pytest.raises(ReasoningError, match="no thinking switch"):
        reasoning_switch(_Template("{{ messages }}"), "high")
    with pytest.raises(ReasoningError, match="must be one of"):
        reasoning_switch(qwen, "max")


@pytest.fixture(scope="module")
def tools_pair(tiny_tools_pair):
    target, draft = tiny_tools_pair
    return mlx_dspark.load(str(target), draft=str(draft))


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_the_template_renders_tools_calls_and_results(tools_pair):
    tokenizer = tools_pair.tokenizer
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    text = tokenizer.decode(encode_prompt(tokenizer, HISTORY, tools=[WEATHER]))
    assert json.dumps(WEATHER["function"]["parameters"]) in text  # the tool's schema is in the system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    without = tokenizer.decode(encode_prompt(tokenizer, HISTORY))
    assert "<tools>" not in without
    # arguments that are not JSON (a call a client recorded cut short) are written as they are, not refused
    cut = tokenizer.decode(encode_prompt(tokenizer, [{**HISTORY[1], "tool_calls": [{"function": {"name": "f", "arguments": '{"a": "b'}}]}]))
    assert '{"name": "f", "arguments": {"a": "b}' in cut


def test_generate_with_tools_reads_its_own_text(tools_pair):
    result = generate(tools_pair, HISTORY, tools=[WEATHER], max_tokens=12)
    again = parse_output(ToolSetup.of([WEATHER]).parser(tools_pair.tokenizer, encode_prompt(tools_pair.tokenizer, HISTORY, tools=[WEATHER])),
                         result.text)
    assert result.content == again.content and result.reasoning == again.reasoning
    assert [c.name for c in result.tool_calls] == [c.name for c in again.tool_calls]
    plain = generate(tools_pair, encode_prompt(tools_pair.tokenizer, HISTORY, tools=[WEATHER]), max_tokens=12)
    assert plain.text == result.text and plain.tool_calls is None  # token ids: the text is not read as chat


def test_tool_choice_none_renders_no_tools(tools_pair):
    tokenizer = tools_pair.tokenizer
    setup = ToolSetup.of([WEATHER], "none")
    assert setup.offered is None and setup.constraint(tokenizer) is None
    assert encode_prompt(tokenizer, HISTORY, tools=setup.offered) == encode_prompt(tokenizer, HISTORY)


def test_a_prompt_ending_in_an_open_think_block_starts_in_reasoning(tiny_spark_pair):
    pair = mlx_dspark.load(str(tiny_spark_pair[0]), draft=str(tiny_spark_pair[1]))
    messages = [{"role": "user", "content": "2 + 2?"}]
    thinking = encode_prompt(pair.tokenizer, messages, chat_template_kwargs={"thinking_effort": "high"})
    assert starts_in_reasoning(pair.tokenizer, thinking)
    assert not starts_in_reasoning(pair.tokenizer, encode_prompt(pair.tokenizer, messages))
    result = generate(pair, messages, chat_template_kwargs={"thinking_effort": "high"}, max_tokens=10)
    assert result.reasoning is not None and result.text.startswith(result.reasoning.lstrip()[:1])


JSON_OUTPUT = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": {"from": 1}}}\n</tool_call>'
               '<tool_call>{"name":"get_weather","arguments":{}}</tool_call>')


@pytest.mark.parametrize("cut", range(1, len(JSON_OUTPUT), 3))
def test_json_call_arguments_stream_and_join_to_the_parsed_call(cut):
    parser = OutputParser(think=THINK, tools=CALLS, stream_arguments=True)
    pieces = [JSON_OUTPUT[:cut], JSON_OUTPUT[cut:]]
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    begins = [v for k, v in events if k == "tool_call_begin"]
    calls = [v for k, v in events if k == "tool_call"]
    assert [(b.id, b.name) for b in begins] == [(c.id, c.name) for c in calls] and len(calls) == 2
    streamed: list[str] = []
    for kind, value in events:
        if kind == "tool_call_begin":
            streamed.append("")
        elif kind == "tool_call_delta":
            streamed[-1] += value
    assert streamed == [c.arguments for c in calls] == ['{"city": "Paris", "days": {"from": 1}}', "{}"]
    assert "".join(v for k, v in events if k == "content") == "Sure."


SPACED_CALL = '<tool_call>\n{"name" : "f" , "arguments" :  {"a" : 1} }\n</tool_call>'  # the demo pair's spacing


@pytest.mark.parametrize("pieces", [[SPACED_CALL]] + [[SPACED_CALL[:i], SPACED_CALL[i:]] for i in range(1, len(SPACED_CALL))]
                         + [list(SPACED_CALL)])
def test_a_json_call_s_arguments_string_is_the_same_however_the_text_was_cut(pieces):
    """Whitespace before the arguments is not part of them: a cut right after `"arguments" :` (as a
    round boundary falls) gives the same string as the text in one piece (issue 39)."""
    parser = OutputParser(tools=CALLS, stream_arguments=True)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    (call,) = [v for k, v in events if k == "tool_call"]
    assert call.arguments == '{"a" : 1}' == "".join(v for k, v in events if k == "tool_call_delta")


def test_a_streamed_call_cut_short_is_a_cut_call_with_its_arguments_so_far():
    parser = OutputParser(tools=CALLS, stream_arguments=True)
    events = parser.feed('<tool_call>{"name": "f", "arguments": {"path": "a.py", "text": "def f(') + parser.finish()
    assert not [v for k, v in events if k == "tool_call"]  # never a finished call
    (call,) = [v for k, v in events if k == "tool_call_cut"]
    assert call.name == "f" and call.arguments == '{"path": "a.py", "text": "def f('
    assert "".join(v for k, v in events if k == "tool_call_delta") == call.arguments


def test_an_answer_of_blank_lines_streams_as_it_comes_when_tools_are_offered():
    from mlx_dspark.chat_format.output import HELD_WHITESPACE

    parser, shown = _parser(), ""
    for _ in range(100):  # a weak model writing newlines while a call could still follow
        shown += "".join(value for kind, value in parser.feed("\n") if kind == "content")
    assert len(shown) >= 100 - HELD_WHITESPACE  # only a bounded tail waits, not the whole answer
    # a call after a short separator still drops the separator
    out = parse_output(_parser(), 'Sure.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert out.content == "Sure." and [c.name for c in out.tool_calls] == ["get_weather"]
