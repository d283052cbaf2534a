"""Agent protocols against the server, each through its official client, unchanged: OpenAI chat with
tools and tool history (whole and streamed), OpenAI Responses (whole, streamed, resumed), Anthropic
Messages (create, stream, tool-use round trip, count_tokens, errors), reasoning text.

The tiny pairs' output is random, so every expectation comes from `mlx_dspark.api.generate` on the
same loaded pair and the same conversation (greedy): the server must render, generate and read it
exactly as the Python API does. Forcing a call needs the engine's constraints (a 400 until present).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install -e '.[test]')")
anthropic = pytest.importorskip("anthropic", reason="the anthropic package is not installed (pip install -e '.[test]')")

from mlx_dspark.api import encode_prompt, generate  # noqa: E402
from tests.test_server import MODEL_ID, call, pair_loader, running_server  # noqa: E402

API_KEY = "sk-agents"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
QUESTION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Paris?"}]
HISTORY = QUESTION + [
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
HAS_CONSTRAINTS = importlib.util.find_spec("mlx_dspark.engine.logits.constraints") is not None
# A forced call of the random tiny model ends only when the schema bounds it (an enum, no extra keys).
CITY = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                                         "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tiny_tools_pair):
    with running_server(pair_loader(tiny_tools_pair), api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def model(server):
    return server.worker.model


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name if hasattr(c, "function") else c.name, json.loads(c.function.arguments if hasattr(c, "function")
             else c.arguments)) for c in calls or []]


# -- OpenAI chat completions -------------------------------------------------------------------------


def test_chat_with_tools_and_tool_history_is_the_api_s_answer(oai, model):
    reply = oai.chat.completions.create(model=MODEL_ID, messages=HISTORY, tools=[WEATHER], max_tokens=12)
    want = generate(model, HISTORY, tools=[WEATHER], max_tokens=12)
    assert reply.usage.prompt_tokens == len(encode_prompt(model.tokenizer, HISTORY, tools=[WEATHER]))
    assert reply.usage.prompt_tokens > len(encode_prompt(model.tokenizer, HISTORY))  # the tools were rendered
    message = reply.choices[0].message
    assert (message.content or "") == want.content
    assert _calls(message.tool_calls) == [(c.name, json.loads(c.arguments)) for c in want.tool_calls]
    assert reply.choices[0].finish_reason == ("tool_calls" if want.tool_calls else want.finish_reason)


def test_streamed_chat_with_tools_reassembles_to_the_whole_reply(oai):
    options = dict(model=MODEL_ID, messages=HISTORY, tools=[WEATHER], max_tokens=12)
    whole = oai.chat.completions.create(**options)
    chunks = list(oai.chat.completions.create(**options, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (whole.choices[0].message.content or "")
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call_ = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call_["name"] += (delta.function.name or "") if delta.function else ""
            call_["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == _calls(whole.choices[0].message.tool_calls)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_tool_choice_none_offers_no_tools(oai, model):
    reply = oai.chat.completions.create(model=MODEL_ID, messages=QUESTION, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert reply.usage.prompt_tokens == len(encode_prompt(model.tokenizer, QUESTION))


@pytest.mark.skipif(HAS_CONSTRAINTS, reason="this build has constrained decoding")
def test_forcing_a_call_without_constrained_decoding_is_a_400_naming_tool_choice(oai):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=MODEL_ID, messages=QUESTION, tools=[WEATHER], tool_choice=choice, max_tokens=4)
        assert err.value.body["param"] == "tool_choice" and "constrained decoding" in err.value.body["message"]


@pytest.mark.skipif(not HAS_CONSTRAINTS, reason="forcing a call needs the engine's constrained decoding")
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_parses_and_matches_the_tool_s_parameters(oai, choice):
    jsonschema = pytest.importorskip("jsonschema")
    tools = [CITY] if choice == "required" else [CITY, {"type": "function", "function": {"name": "noop"}}]
    options = dict(model=MODEL_ID, messages=QUESTION, tools=tools, tool_choice=choice, max_tokens=200,
                   parallel_tool_calls=False)
    reply = oai.chat.completions.create(**options)
    assert reply.choices[0].finish_reason == "tool_calls", reply
    (name, arguments), = _calls(reply.choices[0].message.tool_calls)
    assert name == "get_weather"
    jsonschema.validate(arguments, CITY["function"]["parameters"])
    chunks = list(oai.chat.completions.create(**options, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"  # id and name first
    assert json.loads("".join(d.function.arguments or "" for d in deltas if d.function)) == arguments
    # chat sends a call once it is whole (a call cut by max_tokens is left out, never half-JSON arguments)
    assert len([d for d in deltas if d.function and d.function.arguments]) == 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.skipif(not HAS_CONSTRAINTS, reason="forcing a call needs the engine's constrained decoding")
def test_forced_calls_through_anthropic_and_responses_round_trip(claude, oai, model):
    tools = [{"name": "get_weather", "input_schema": CITY["function"]["parameters"]}]
    message = claude.messages.create(model="claude", max_tokens=200, tools=tools, tool_choice={"type": "any",
                                     "disable_parallel_tool_use": True}, messages=[{"role": "user", "content": "Weather?"}])
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Oslo")
    follow_up = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": message.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    reply = claude.messages.create(model="claude", max_tokens=6, tools=tools, messages=follow_up)
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
               {"role": "tool", "tool_call_id": use.id, "content": "sunny"}]
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == \
        len(encode_prompt(model.tokenizer, history, tools=[{"type": "function", "function": {"name": "get_weather",
                                                            "parameters": CITY["function"]["parameters"]}}]))
    response = oai.responses.create(model=MODEL_ID, input="Weather?", tools=[{"type": "function", **CITY["function"]}],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=200)
    (call_,) = [item for item in response.output if item.type == "function_call"]
    assert call_.name == "get_weather" and json.loads(call_.arguments)["city"] in ("Paris", "Oslo")


@pytest.mark.skipif(not HAS_CONSTRAINTS, reason="needs the engine's constrained decoding")
def test_response_format_and_regex_constrain_chat_and_completions(oai, server):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    reply = oai.chat.completions.create(model=MODEL_ID, messages=QUESTION, max_tokens=60,
                                        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                                                "strict": True}})
    assert json.loads(reply.choices[0].message.content)["answer"] in ("yes", "no")
    text = oai.completions.create(model=MODEL_ID, prompt="Is it?", max_tokens=10, extra_body={"regex": "(yes|no)"})
    assert text.choices[0].text in ("yes", "no")
    for body, param in [({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
                        ({"regex": "("}, "regex"), ({"regex": "a", "grammar": "start: 'a'"}, "grammar")]:
        status, _, answer = call(server, "POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4, **body},
                                 headers={"Authorization": f"Bearer {API_KEY}"})
        assert status == 400 and answer["error"]["param"] == param, answer


def test_logprobs_and_penalties_are_the_api_s(oai, model):
    reply = oai.chat.completions.create(model=MODEL_ID, messages=QUESTION, max_tokens=6, logprobs=True, top_logprobs=3,
                                        presence_penalty=1.5, frequency_penalty=0.5)
    want = generate(model, QUESTION, max_tokens=6, logprobs=3, presence_penalty=1.5, frequency_penalty=0.5)
    assert reply.choices[0].message.content == want.content
    entries = reply.choices[0].logprobs.content
    assert [e.logprob for e in entries] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-6)
    assert all(len(e.top_logprobs) == 3 for e in entries)
    text = oai.completions.create(model=MODEL_ID, prompt="Once upon", max_tokens=4, logprobs=2)
    assert len(text.choices[0].logprobs.token_logprobs) == 4 and all(len(t) <= 2 for t in text.choices[0].logprobs.top_logprobs)


# -- OpenAI Responses --------------------------------------------------------------------------------


def test_responses_create_is_the_api_s_answer_and_streams_the_same(oai, model):
    want = generate(model, HISTORY, tools=[WEATHER], max_tokens=10)
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    tools = [{"type": "function", **WEATHER["function"]}]
    response = oai.responses.create(model=MODEL_ID, instructions="Answer briefly.", input=items, tools=tools,
                                    max_output_tokens=10)
    assert response.usage.input_tokens == len(encode_prompt(model.tokenizer, HISTORY, tools=[WEATHER]))
    assert response.output_text == want.content
    assert [(c.name, json.loads(c.arguments)) for c in response.output if c.type == "function_call"] == \
        [(c.name, json.loads(c.arguments)) for c in want.tool_calls]
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].status == "incomplete"  # the item the output ended inside says so too
    assert all(item.status == "completed" for item in response.output[:-1] if getattr(item, "status", None))
    events = list(oai.responses.create(model=MODEL_ID, instructions="Answer briefly.", input=items, tools=tools,
                                       max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.content
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_previous_response_id_resumes_the_conversation(oai, model):
    first = oai.responses.create(model=MODEL_ID, input="Weather in Paris?", max_output_tokens=6)
    second = oai.responses.create(model=MODEL_ID, previous_response_id=first.id, input="And in Oslo?", max_output_tokens=6)
    conversation = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And in Oslo?"}]
    assert second.usage.input_tokens == len(encode_prompt(model.tokenizer, conversation))
    assert second.output_text == generate(model, conversation, max_tokens=6).content
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL_ID, previous_response_id="resp_unknown", input="hi", max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"


@pytest.mark.skipif(not HAS_CONSTRAINTS, reason="forcing a call needs the engine's constrained decoding")
def test_forced_calls_stream_their_arguments_in_responses_and_anthropic_events(oai, claude):
    events = list(oai.responses.create(model=MODEL_ID, input="Weather?", tools=[{"type": "function", **CITY["function"]}],
                                       tool_choice="required", parallel_tool_calls=False, max_output_tokens=200, stream=True))
    (item,) = [i for i in events[-1].response.output if i.type == "function_call"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == item.id]
    assert len(deltas) > 1 and "".join(deltas) == item.arguments and json.loads(item.arguments)["city"] in ("Paris", "Oslo")
    assert events[-1].type == "response.completed"
    tools = [{"name": "get_weather", "input_schema": CITY["function"]["parameters"]}]
    with claude.messages.stream(model="claude", max_tokens=200, tools=tools, messages=[{"role": "user", "content": "Weather?"}],
                                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Oslo") and final.stop_reason == "tool_use"
    assert kinds.count("input_json") > 1  # the SDK's event for each input_json_delta


# -- Anthropic Messages ------------------------------------------------------------------------------


def test_messages_create_is_the_api_s_answer(claude, model):
    message = claude.messages.create(model="claude-sonnet-4-5", system="Answer briefly.", max_tokens=10,
                                     messages=[{"role": "user", "content": "Weather in Paris?"}])
    want = generate(model, QUESTION, max_tokens=10)
    assert "".join(b.text for b in message.content if b.type == "text") == want.content
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 10
    # Anthropic's input_tokens leave out the prompt tokens read from the prompt cache
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(encode_prompt(model.tokenizer, QUESTION))
    assert message.role == "assistant" and message.id.startswith("msg_")


def test_messages_stream_joins_to_the_created_message(claude):
    options = dict(model="claude-sonnet-4-5", system="Answer briefly.", max_tokens=10,
                   messages=[{"role": "user", "content": "Weather in Paris?"}])
    whole = claude.messages.create(**options)
    with claude.messages.stream(**options) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_a_tool_use_round_trip_renders_as_the_openai_history(claude, model):
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER["function"]["parameters"]}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny, 21 C"}]}]
    count = claude.messages.count_tokens(model="claude-sonnet-4-5", system="Answer briefly.", tools=tools, messages=messages)
    assert count.input_tokens == len(encode_prompt(model.tokenizer, HISTORY, tools=[WEATHER]))
    message = claude.messages.create(model="claude-sonnet-4-5", system="Answer briefly.", tools=tools, messages=messages,
                                     max_tokens=12)
    want = generate(model, HISTORY, tools=[WEATHER], max_tokens=12)
    assert "".join(b.text for b in message.content if b.type == "text") == want.content
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == \
        [(c.name, json.loads(c.arguments)) for c in want.tool_calls]
    assert message.stop_reason == ("tool_use" if want.tool_calls else "max_tokens")


def test_anthropic_errors_come_in_anthropic_s_shape(claude, server):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="claude", max_tokens=5, messages=[{"role": "robot", "content": "x"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].role" in err.value.body["error"]["message"]
    with anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.create(model="claude", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    status, _, body = call(server, "POST", "/v1/messages", {"messages": [{"role": "user", "content": "x"}]},
                           headers={"x-api-key": API_KEY})
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "max_tokens" in body["error"]["message"]


# -- reasoning ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spark_server(tiny_spark_pair):
    with running_server(pair_loader(tiny_spark_pair)) as srv:
        yield srv


def test_reasoning_effort_sets_spark_s_switch_and_the_thinking_text_is_reasoning_content(spark_server):
    model = spark_server.worker.model
    want = generate(model, QUESTION, chat_template_kwargs={"thinking_effort": "high"}, max_tokens=10)
    assert want.reasoning  # the prompt opened <think>: the output begins as reasoning
    with openai.OpenAI(base_url=f"{spark_server.url}/v1", api_key="none", max_retries=0) as client:
        reply = client.chat.completions.create(model=MODEL_ID, messages=QUESTION, max_tokens=10, reasoning_effort="high")
        chunks = list(client.chat.completions.create(model=MODEL_ID, messages=QUESTION, max_tokens=10,
                                                     reasoning_effort="high", stream=True))
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == want.reasoning and (message.content or "") == want.content
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == want.reasoning
    with anthropic.Anthropic(base_url=spark_server.url, api_key="none", max_retries=0) as claude:
        message = claude.messages.create(model="claude", max_tokens=10, system="Answer briefly.",
                                         thinking={"type": "enabled", "budget_tokens": 1024},
                                         messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert [b.thinking for b in message.content if b.type == "thinking"] == [want.reasoning]


def test_reasoning_effort_on_a_template_without_a_switch_is_a_400(server, spark_server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
        client.chat.completions.create(model=MODEL_ID, messages=QUESTION, max_tokens=2, reasoning_effort="low")  # qwen3: on
    status, _, body = call(spark_server, "POST", "/v1/chat/completions",
                           {"messages": QUESTION, "max_tokens": 2, "reasoning_effort": "extreme"})
    assert status == 400 and body["error"]["param"] == "reasoning_effort"


# -- the demo pair and the tool parser override ----------------------------------------------------


def test_the_demo_pair_chats_out_of_the_box():
    from mlx_dspark.cli.common import demo_pair
    from mlx_dspark.loading.load import load

    demo = demo_pair()
    with running_server(lambda: load(demo.target, draft=demo.draft, dtype=demo.dtype)) as srv:
        status, _, body = call(srv, "POST", "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 8, "tools": [WEATHER]})
        assert status == 200, body
        want = generate(srv.worker.model, [{"role": "user", "content": "def add(a, b):"}], tools=[WEATHER], max_tokens=8)
        assert (body["choices"][0]["message"]["content"] or "") == want.content
        assert srv.worker.model.tokenizer.has_tool_calling


def test_a_named_tool_parser_replaces_the_inferred_one(tiny_tools_pair):
    from mlx_dspark.loading.load import load

    target, _ = tiny_tools_pair
    assert load(target).tokenizer.tool_parser.__module__.endswith("json_tools")
    assert load(target, tool_parser="qwen3_coder").tokenizer.tool_parser.__module__.endswith("qwen3_coder")
    with pytest.raises(ValueError, match="unknown tool parser 'nope'; mlx-lm has .*json_tools"):
        load(target, tool_parser="nope")


# -- message threads (the SDK's tool runner) ----------------------------------------------------------


def _weather_runner(claude, iterations: int, *, stream: bool = False):
    """The SDK's default tool runner (threaded: message-threads beta), forced to call a bounded tool each turn."""
    calls = []

    def get_weather(city: str) -> str:
        calls.append(city)
        return f"sunny in {city}"

    tool = anthropic.beta_tool(get_weather, name="get_weather", description="The weather in a city",
                               input_schema=CITY["function"]["parameters"])
    runner = claude.beta.messages.tool_runner(
        model="claude", max_tokens=200, system="Answer briefly.", tools=[tool], max_iterations=iterations,
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=[{"role": "user", "content": "Weather?"}],
        stream=stream)
    return runner, calls


def _threads_seen(server, monkeypatch) -> list:
    seen = []
    begin = server.threads.begin

    def spy(body):
        seen.append((body["thread"]["type"], len(body["messages"]), "tools" in body))
        return begin(body)

    monkeypatch.setattr(server.threads, "begin", spy)
    return seen


@pytest.mark.skipif(not HAS_CONSTRAINTS, reason="forcing a call needs the engine's constrained decoding")
@pytest.mark.parametrize("stream", [False, True])
def test_the_sdk_s_tool_runner_runs_over_a_server_held_thread(claude, server, model, monkeypatch, stream):
    seen = _threads_seen(server, monkeypatch)
    runner, calls = _weather_runner(claude, 3, stream=stream)
    replies = [turn.get_final_message() for turn in runner] if stream else list(runner)
    assert len(replies) == 3 and len(calls) == 3 and all(r.stop_reason == "tool_use" for r in replies)
    # a create with the whole conversation, then continues with only the new turn (the tool result), no tools
    assert seen == [("create", 1, True), ("continue", 1, False), ("continue", 1, False)]
    # the server answered the last turn from the whole conversation it held
    history = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather?"}]
    for reply in replies[:-1]:
        (use,) = [b for b in reply.content if b.type == "tool_use"]
        history += [{"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function",
                     "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                    {"role": "tool", "tool_call_id": use.id, "content": f"sunny in {use.input['city']}"}]
    usage = replies[-1].usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(encode_prompt(model.tokenizer, history, tools=[CITY]))


@pytest.mark.skipif(not HAS_CONSTRAINTS, reason="forcing a call needs the engine's constrained decoding")
@pytest.mark.parametrize("store, want", [
    # one thread held and a second runner's create between turns evicts it: its continue is a 404
    # thread_not_found, and the SDK replays the whole conversation under a new thread
    (dict(capacity=1), [("create", 1, True), ("create", 1, True), ("continue", 1, False), ("continue", 1, False),
                        ("create", 3, True)]),
    # too large to hold: each runner's create is a 400 thread_unsupported_request, and the runner goes on
    # without a thread (the whole conversation each turn, no `thread`)
    (dict(max_bytes=64), [("create", 1, True), ("create", 1, True)]),
])
def test_the_tool_runner_recovers_from_an_evicted_or_oversize_thread(claude, server, monkeypatch, store, want):
    from mlx_dspark.serve.threads import ThreadStore

    monkeypatch.setattr(server, "threads", ThreadStore(**store))
    seen = _threads_seen(server, monkeypatch)
    first, first_calls = _weather_runner(claude, 2)
    second, second_calls = _weather_runner(claude, 2)
    turns = [next(iter(first)), next(iter(second)), next(iter(second)), next(iter(first))]
    assert all(t.stop_reason == "tool_use" for t in turns) and len(first_calls) == len(second_calls) == 1
    assert seen == want
