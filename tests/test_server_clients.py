"""What real agent clients send, replayed against the server: requests recorded from Claude Code 2.1.197
(`claude -p`) and Codex CLI 0.171 (`codex exec`) on loopback (tests/client_requests/, long texts trimmed),
plus the shapes the issue reports (mid-conversation system turns, thinking on a template without a
switch, hosted Responses tools, tool calls cut by max_tokens, forced single calls, prompts too long).

The pair is the tiny qwen3 pair with a tools template and no thinking switch (as the demo pair's); no
request leaves 127.0.0.1.
"""

from __future__ import annotations

import copy
import http.client
import json
import logging
import re
import shutil
import socket
import time
from pathlib import Path

import pytest

from mlx_dspark.api import encode_prompt
from mlx_dspark.chat_format.output import CALL, CALL_CUT, CONTENT, OutputParser
from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.loading.load import load
from mlx_dspark.testing.tiny_tokenizer import tools_chat_template, write_chat_template
from tests.test_server import MODEL_ID, call, running_server, wait_for

RECORDED = Path(__file__).parent / "client_requests"
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
FREE = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
LONG = "word " * 5000  # over the tiny pair's 4096-token context


def recorded(name: str, *, tools: int | None = None, chars: int = 160) -> dict:
    """A recorded request body, its texts cut to `chars` and its tools to the first `tools` (the tiny
    pair's context is 4096 tokens); the shapes (fields, blocks, roles, tool types) stay as recorded."""
    body = json.loads((RECORDED / name).read_text())["body"]

    def cut(value):
        if isinstance(value, str):
            return value[:chars]
        if isinstance(value, list):
            return [cut(v) for v in value]
        if isinstance(value, dict):
            return {k: (v if k in ("type", "role", "name") else cut(v)) for k, v in value.items()}
        return value

    if tools is not None:  # the first `tools` function tools, and every tool of another type
        functions = [t for t in body["tools"] if t.get("type", "function") in ("function", None)]
        body["tools"] = [t for t in body["tools"] if t not in functions or functions.index(t) < tools]
        for tool in body["tools"]:
            if tool.get("type") == "namespace":
                tool["tools"] = tool["tools"][:tools]
    return cut(body)


@pytest.fixture(scope="module")
def pair(tiny_qwen3_pair, tmp_path_factory):
    target, draft = tiny_qwen3_pair
    plain = shutil.copytree(target, tmp_path_factory.mktemp("no-switch") / "target")
    write_chat_template(plain, tools_chat_template(thinking=False))  # the demo's kind: tools, no thinking switch
    return plain, draft


@pytest.fixture(scope="module")
def server(pair):
    target, draft = pair
    with running_server(lambda: load(target, draft=draft)) as srv:
        yield srv


def open_stream(server, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def sse(response) -> list[tuple[str | None, object]]:
    """(event name, data) of a whole stream; comments as (":", text)."""
    events, name = [], None
    for raw in response:
        line = raw.decode().rstrip("\r\n")
        if line.startswith(":"):
            events.append((":", line))
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
            if data == "[DONE]" or (events[-1][1] or {}).get("type") in ("message_stop", "response.completed",
                                                                         "response.incomplete"):
                break
    return events


# -- recorded requests ------------------------------------------------------------------------------


def test_claude_code_s_title_request_is_held_to_its_json_schema(server):
    body = recorded("claude_code_2.1.197_title.json")
    assert body["thinking"] == {"type": "disabled"} and body["output_config"]["format"]["type"] == "json_schema"
    status, _, answer = call(server, "POST", "/v1/messages?beta=true", body)
    # max_tokens 64000 does not fit the tiny context: Anthropic's own wording, which Claude Code reads
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    assert re.match(r"input length and `max_tokens` exceed context limit: \d+ \+ 64000 > 4096", answer["error"]["message"])
    status, response, answer = call(server, "POST", "/v1/messages?beta=true", {**body, "max_tokens": 40, "stream": False})
    assert status == 200, answer
    assert response.getheader("X-DSpark-Warning") is None  # thinking disabled: nothing to say
    (text,) = [b["text"] for b in answer["content"] if b["type"] == "text"]
    assert re.match(r'\s*\{\s*"title"\s*:\s*"', text), text  # output_config.format went through the constraint


def test_claude_code_s_turn_streams_at_once_with_its_system_turn_and_adaptive_thinking(server):
    body = recorded("claude_code_2.1.197_turn.json", tools=3)
    assert [m["role"] for m in body["messages"]] == ["user", "system"] and body["thinking"] == {"type": "adaptive"}
    conn, response = open_stream(server, "/v1/messages?beta=true", {**body, "max_tokens": 8})
    assert response.status == 200, response.read()
    assert "no thinking switch" in response.getheader("X-DSpark-Warning")
    events = sse(response)
    conn.close()
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    tokenizer = server.worker.model.tokenizer
    system = "\n".join(block["text"] for block in body["system"])
    user = "\n".join(block["text"] for block in body["messages"][0]["content"])
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in body["tools"]]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user},
                {"role": "system", "content": body["messages"][1]["content"]}]  # rendered at its place
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] == len(encode_prompt(tokenizer, messages, tools=tools))
    (delta,) = [data for name, data in events if name == "message_delta"]
    assert {"input_tokens", "cache_read_input_tokens", "output_tokens"} <= set(delta["usage"])


def test_codex_s_exec_request_expands_namespaces_and_drops_hosted_tools_with_a_warning(server):
    body = recorded("codex_0.171_exec.json", tools=2, chars=60)
    kinds = [t["type"] for t in body["tools"]]
    assert "namespace" in kinds and "web_search" in kinds
    conn, response = open_stream(server, "/v1/responses", {**body, "model": MODEL_ID, "max_output_tokens": 8})
    assert response.status == 200, response.read()
    events = sse(response)
    conn.close()
    assert [e[0] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1][1]["response"]
    names = [t["name"] for t in final["tools"]]
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    assert {t["name"] for t in namespace["tools"]} <= set(names) and "exec_command" in names
    assert [m["role"] for m in body["input"]] == ["developer", "developer", "user", "user"]
    assert any("'web_search'" in w and "dropped" in w for w in final["dspark"]["warnings"])


def test_a_namespaced_function_s_call_names_its_namespace_and_one_forced_call_ends_the_answer(server):
    tools = [{"type": "namespace", "name": "weather_v1", "description": "Weather tools.",
              "tools": [{"type": "function", "name": "get_weather", "parameters": CITY}]}]
    status, _, answer = call(server, "POST", "/v1/responses", {"input": "Weather?", "tools": tools, "max_output_tokens": 300,
                                                               "tool_choice": {"type": "function", "name": "get_weather"}})
    assert status == 200, answer
    (item,) = [i for i in answer["output"] if i["type"] == "function_call"]
    assert item["namespace"] == "weather_v1" and item["status"] == "completed" and json.loads(item["arguments"])["city"]
    assert answer["status"] == "completed" and answer["usage"]["output_tokens"] < 300  # stopped after its one call
    status, _, again = call(server, "POST", "/v1/responses", {"input": [{"role": "user", "content": "Weather?"}, item,
                            {"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"}],
                            "tools": tools, "max_output_tokens": 4})
    assert status == 200, again  # its own item (with namespace and status) is accepted back


# -- thinking, system turns, thread -----------------------------------------------------------------


@pytest.mark.parametrize("path,extra", [
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}),
    ("/v1/messages", {"output_config": {"effort": "max"}}),
    ("/v1/chat/completions", {"reasoning_effort": "high"}),
    ("/v1/responses", {"reasoning": {"effort": "medium"}}),
])
def test_thinking_asked_of_a_template_without_a_switch_answers_without_and_says_so(server, path, extra):
    body = {"max_tokens": 3, **extra}
    body.update({"input": "Hi"} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "Hi"}]})
    status, response, answer = call(server, "POST", path, body)
    assert status == 200, answer
    assert "no thinking switch" in response.getheader("X-DSpark-Warning")
    assert "no thinking switch" in answer["dspark"]["warnings"][0]
    if path != "/v1/responses":  # thinking turned off is always fine, and nothing to warn about
        off = {"thinking": {"type": "disabled"}} if path == "/v1/messages" else {"reasoning_effort": "none"}
        status, response, answer = call(server, "POST", path, {**body, **off})
        assert status == 200 and response.getheader("X-DSpark-Warning") is None and "warnings" not in answer["dspark"]


def test_a_template_that_refuses_later_system_turns_gets_them_joined_to_the_system_prompt():
    from mlx_dspark.serve.protocol import GenerationRequest

    class Tokenizer:
        chat_template, has_chat_template = "{{ messages }}", True

        def apply_chat_template(self, messages, **kwargs):
            if any(m["role"] == "system" for m in messages[1:]):
                raise ValueError("System message must be at the beginning.")
            return [len(m["content"]) for m in messages]

    request = GenerationRequest(kind="anthropic", prompt=[{"role": "system", "content": "ab"}, {"role": "user", "content": "u"},
                                                          {"role": "system", "content": "cde"}], options=GenerationOptions())
    ids, _ = request.prepare(Tokenizer())
    assert ids == [len("ab\n\ncde"), 1] and "joined" in request.warnings[0]


def test_a_bad_or_unknown_thread_is_an_error_that_names_it(server):
    status, _, answer = call(server, "POST", "/v1/messages", {"max_tokens": 3, "thread": {"type": "fork"},
                                                              "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 400 and "'thread'" in answer["error"]["message"]
    status, _, answer = call(server, "POST", "/v1/messages", {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}],
                                                              "thread": {"type": "continue", "previous_message_id": "msg_x"}})
    assert status == 404 and answer["error"]["details"] == {"error_code": "thread_not_found"}  # the SDK then replays


# -- cut and single tool calls ----------------------------------------------------------------------


def test_a_call_cut_by_max_tokens_is_never_a_call_nor_text_on_any_api(server):
    function = {"type": "function", "function": {"name": "run", "parameters": FREE}}
    body = {"messages": [{"role": "user", "content": "Run ls"}], "tools": [function], "tool_choice": "required",
            "max_tokens": 10}
    status, _, answer = call(server, "POST", "/v1/chat/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls")
    assert "<tool_call" not in (choice["message"]["content"] or "")
    assert any("max_tokens (10) ran out" in w for w in answer["dspark"]["warnings"])
    conn, response = open_stream(server, "/v1/chat/completions", body)
    chunks = [data for _, data in sse(response) if isinstance(data, dict)]
    conn.close()
    assert not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    anthropic_tools = [{"name": "run", "input_schema": FREE}]
    status, _, message = call(server, "POST", "/v1/messages", {"messages": body["messages"], "tools": anthropic_tools,
                                                               "tool_choice": {"type": "any"}, "max_tokens": 10})
    assert status == 200 and message["stop_reason"] == "max_tokens"
    assert [b["type"] for b in message["content"]] in ([], ["text"]) and "<tool_call" not in json.dumps(message["content"])
    conn, response = open_stream(server, "/v1/responses", {"input": "Run ls", "tools": [{"type": "function", "name": "run",
                                 "parameters": FREE}], "tool_choice": "required", "max_output_tokens": 10})
    events = sse(response)
    conn.close()
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.incomplete"
    items = [i for i in final["output"] if i["type"] == "function_call"]
    assert all(i["status"] == "incomplete" and i["arguments"] == "" for i in items)


def test_the_server_takes_back_tool_calls_whose_arguments_are_not_json(server):
    history = [{"role": "user", "content": "Run ls"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "run", "arguments": '{"command": "ls -'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "error"}]
    status, _, answer = call(server, "POST", "/v1/chat/completions", {"messages": history, "max_tokens": 2, "tools": [
        {"type": "function", "function": {"name": "run", "parameters": FREE}}]})
    assert status == 200, answer


def test_the_parser_flushes_text_at_once_without_tools_and_never_leaks_a_marker_start():
    plain = OutputParser()
    assert plain.feed("x = 1\n\n   ") == [(CONTENT, "x = 1\n\n   ")]  # nothing can follow that needs holding
    tools = OutputParser(tools=("<tool_call>", "</tool_call>", json.loads))
    assert tools.feed("ok\n<tool_") == [(CONTENT, "ok")] and tools.finish() == []
    cut = OutputParser(tools=("<tool_call>", "</tool_call>", json.loads))
    assert cut.feed('<tool_call>\n{"name" : "TaskList"') == [] and cut.finish() == [(CALL_CUT, None)]
    whole = OutputParser(tools=("<tool_call>", "</tool_call>", json.loads), stream_arguments=True)
    events = whole.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1}}') + whole.finish()  # ended before </tool_call>
    assert [k for k, _ in events if k in (CALL, CALL_CUT)] == [CALL] and json.loads(events[-1][1].arguments) == {"a": 1}


# -- progress before the first token ----------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_server(pair):
    """Prefill in chunks of 8 tokens: a long prompt takes a while, keep-alives every 50 ms."""
    target, draft = pair
    with running_server(lambda: load(target, draft=draft), keepalive_s=0.05,
                        defaults=GenerationOptions(max_tokens=4, prefill_step_size=8)) as srv:
        yield srv


def test_a_stream_starts_before_the_prefill_and_pings_while_it_runs(slow_server, caplog, monkeypatch):
    from mlx_dspark.serve import anthropic

    from mlx_dspark.serve import responses

    monkeypatch.setattr(anthropic, "TEXT_KEEPALIVE_S", 0.5)  # Claude Code's watchdog ignores pings: text deltas too
    monkeypatch.setattr(responses, "KEEPALIVE_EVENT_S", 0.5)  # Codex's ignores comments: in_progress events too
    prompts = [f"{i} " + "word " * 1500 for i in range(3)]  # each its own: a cached prompt has no prefill
    with caplog.at_level(logging.INFO, logger="mlx_dspark.server"):
        for path, body, first, ping in [
            ("/v1/messages", {"messages": [{"role": "user", "content": prompts[0]}], "max_tokens": 2}, "message_start", "ping"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompts[1]}], "max_tokens": 2}, None, ":"),
            ("/v1/responses", {"input": prompts[2], "max_output_tokens": 2}, "response.created", "response.in_progress"),
        ]:
            conn, response = open_stream(slow_server, path, body)
            events = sse(response)
            conn.close()
            assert events[0][0] == first and (first or events[0][1]["choices"][0]["delta"]["role"] == "assistant")
            names = [name for name, _ in events]
            assert ping in names[1:], names[:5]
            if path == "/v1/messages":
                empty = [d for n, d in events if n == "content_block_delta" and d["delta"] == {"type": "text_delta", "text": ""}]
                assert empty and names.index("content_block_start") < names.index("content_block_delta")
                assert names.count("content_block_start") == names.count("content_block_stop")
            if path == "/v1/responses":  # comments first, then (past KEEPALIVE_EVENT_S) in_progress events again
                assert names.count("response.in_progress") > 1
                assert [d["sequence_number"] for n, d in events if n != ":"] == list(range(len(names) - names.count(":")))
    started = [r.getMessage() for r in caplog.records if "started" in r.getMessage()]
    assert any('"POST /v1/messages" started' in m for m in started)


def test_a_client_that_leaves_during_the_prefill_cancels_it(slow_server):
    worker = slow_server.worker
    assert wait_for(lambda: not worker.busy and not worker.queued)
    conn, response = open_stream(slow_server, "/v1/messages", {"messages": [{"role": "user", "content": "gone " + "word " * 1500}],
                                                               "max_tokens": 2})
    assert response.status == 200
    assert response.readline().startswith(b"event: message_start")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    def gone_job():
        return next((j for j in worker.recent if j.request.prompt[0]["content"].startswith("gone ")), None)

    assert wait_for(lambda: gone_job() is not None, timeout=30)
    job = gone_job()
    assert job.cancelled.is_set() and job.steps == 0  # stopped inside the prefill, before any token


# -- errors agents read -------------------------------------------------------------------------------


def test_prompts_too_long_come_in_the_words_agents_look_for(server, caplog):
    status, _, answer = call(server, "POST", "/v1/messages", {"max_tokens": 3, "messages": [{"role": "user", "content": LONG}]})
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    assert re.match(r"prompt is too long: \d+ tokens > \d+ maximum", answer["error"]["message"])
    with caplog.at_level(logging.INFO, logger="mlx_dspark.server"):
        status, _, answer = call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in answer["error"]["message"]
    assert any("400 context_length_exceeded" in r.getMessage() for r in caplog.records)  # the log says why
    conn, response = open_stream(server, "/v1/responses", {"input": LONG})
    assert response.status == 400 and json.loads(response.read())["error"]["code"] == "context_length_exceeded"
    conn.close()


def test_head_and_get_of_the_base_url_answer_even_without_the_key(server, tiny_qwen3_pair):
    assert call(server, "HEAD", "/")[0] == 200
    status, _, body = call(server, "GET", "/")
    assert status == 200 and "/v1/messages" in body["endpoints"]
    target, draft = tiny_qwen3_pair
    with running_server(lambda: load(target, draft=draft), api_key="sk-key") as keyed:
        assert call(keyed, "HEAD", "/")[0] == 200  # Claude Code probes its base URL without the key
        assert call(keyed, "GET", "/v1/models")[0] == 401


def test_force_tool_call_names_the_tool_only_when_the_user_spoke_last():
    from mlx_dspark.chat_format.tools import ToolChoice
    from mlx_dspark.serve import fields
    from mlx_dspark.serve.admission import force_tool_call
    from mlx_dspark.serve.protocol import GenerationRequest

    setup = fields.tool_setup([{"type": "function", "function": {"name": "TaskList"}}], None, None)
    asked = [{"role": "user", "content": "x"}, {"role": "system", "content": "a note"}]
    request = GenerationRequest(kind="anthropic", prompt=asked, options=GenerationOptions(), tools=setup)
    assert force_tool_call(request, "TaskList") and request.tools.choice == ToolChoice("named", "TaskList")
    assert "--force-tool-call" in request.warnings[0]
    answered = asked + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                         "function": {"name": "TaskList", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c", "content": "[]"}]
    resumed = answered + [{"role": "user", "content": "go on"}]  # a later user turn: the model's own
    for prompt, name in ((answered, "TaskList"), (resumed, "TaskList"), (asked, "Other")):
        request = GenerationRequest(kind="anthropic", prompt=prompt, options=GenerationOptions(), tools=setup)
        assert not force_tool_call(request, name) and request.tools.choice.mode == "auto"


def test_a_forced_call_with_a_response_format_answers_with_the_call(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    status, _, answer = call(server, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Weather?"}], "tools": tools, "max_tokens": 300,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}})
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert any("'response_format' does not apply" in w for w in answer["dspark"]["warnings"])


def test_the_operator_s_stop_sequences_apply_to_requests_without_their_own():
    from mlx_dspark.serve.protocol import CLIENT_TEMPLATE_KWARGS, request_options

    defaults = GenerationOptions(stop=(".",))  # --stop .
    assert list(request_options({}, defaults, CLIENT_TEMPLATE_KWARGS).stop) == ["."]
    assert list(request_options({"stop": ["x"]}, defaults, CLIENT_TEMPLATE_KWARGS).stop) == ["x"]


@pytest.mark.parametrize("name", ["openai_agents_0.24_chat.json", "openai_agents_0.24_responses.json"])
def test_the_agents_sdk_s_forced_tool_turn_and_structured_answer(server, name):
    recording = json.loads((RECORDED / name).read_text())
    body = {**recording["body"], "model": MODEL_ID}
    status, _, answer = call(server, "POST", recording["path"], body)
    assert status == 200, answer
    assert any("does not apply" in w for w in answer["dspark"]["warnings"])  # the output_type waits for the next turn
    if recording["path"] == "/v1/chat/completions":
        (tool_call,) = answer["choices"][0]["message"]["tool_calls"]
        arguments = json.loads(tool_call["function"]["arguments"])
        history = body["messages"] + [answer["choices"][0]["message"],
                                      {"role": "tool", "tool_call_id": tool_call["id"], "content": "sunny"}]
        follow_up = {**body, "messages": history, "tool_choice": None}
    else:
        (item,) = [i for i in answer["output"] if i["type"] == "function_call"]
        arguments = json.loads(item["arguments"])
        follow_up = {**body, "input": body["input"] + [item, {"type": "function_call_output", "call_id": item["call_id"],
                                                               "output": "sunny"}], "tool_choice": None}
    assert arguments["city"] in ("Paris", "Oslo")
    status, _, answer = call(server, "POST", recording["path"], follow_up)  # the SDK's next turn: auto, the output_type
    assert status == 200, answer
    text = answer["choices"][0]["message"]["content"] if "choices" in answer else \
        next(i for i in answer["output"] if i["type"] == "message")["content"][0]["text"]
    assert json.loads(text)["weather"] in ("sunny", "rainy")
