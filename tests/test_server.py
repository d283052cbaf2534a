"""The OpenAI-compatible server, driven over real HTTP on 127.0.0.1 with the tiny spark pair.

Each server runs in this process (socket thread + worker thread) on a free port; expected outputs
come from `mlx_dspark.api.generate` on the same loaded pair, so a greedy response must equal it.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from mlx_dspark.api import encode_prompt, generate
from mlx_dspark.loading.load import load
from mlx_dspark.serve.app import DSparkHTTPServer, make_server
from mlx_dspark.engine.options import GenerationOptions, SpeculationOptions

MODEL_ID = "tiny-spark"
MESSAGES = [{"role": "user", "content": "Say something."}]
MAX_BODY = 4096


@contextmanager
def running_server(loader: Callable[[], Any], *, wait: bool = True, **options: Any) -> Iterator[DSparkHTTPServer]:
    """A started server on a free 127.0.0.1 port; closed (port released) on exit."""
    server = make_server(loader, model_id=MODEL_ID, host="127.0.0.1", port=0, **options)
    server.start()
    try:
        if wait:
            assert server.worker.loaded.wait(60), "the tiny pair did not load in 60 s"
        yield server
    finally:
        server.close(wait_s=10)


def pair_loader(pair: tuple[Path, Path]) -> Callable[[], Any]:
    target, draft = pair
    return lambda: load(target, draft=draft)


def call(server: DSparkHTTPServer, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPResponse, Any]:
    """One request on a fresh connection; returns (status, response, parsed JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, response, json.loads(payload) if payload else None


def sse_events(response: http.client.HTTPResponse) -> list[Any]:
    """The `data:` payloads of an event stream, parsed, up to and including the "[DONE]" marker."""
    events = []
    for line in response:
        line = line.decode().rstrip("\r\n")
        if not line.startswith("data: "):
            assert line == "", f"unexpected line in the event stream: {line!r}"
            continue
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
        if data == "[DONE]":
            break
    return events


def stream(server: DSparkHTTPServer, path: str, body: dict) -> list[Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    assert response.getheader("Content-Type") == "text/event-stream"
    events = sse_events(response)
    conn.close()
    return events


def wait_for(predicate: Callable[[], bool], *, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def server(tiny_spark_pair) -> Iterator[DSparkHTTPServer]:
    with running_server(pair_loader(tiny_spark_pair), defaults=GenerationOptions(max_tokens=8), max_body_bytes=MAX_BODY) as srv:
        yield srv


def expected(server: DSparkHTTPServer, prompt: Any, **options: Any):
    """The engine's own answer on the served pair (the worker is idle between requests)."""
    return generate(server.worker.model, prompt, **options)


# -- health, models ----------------------------------------------------------------------------------


def test_health_is_ok_with_the_model_id_once_loaded(server):
    status, _, body = call(server, "GET", "/health")
    assert status == 200
    assert body["status"] == "ok" and body["model"] == MODEL_ID and body["speculative"] is True


def test_models_lists_the_served_model_and_looks_it_up(server):
    status, _, body = call(server, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL_ID]
    status, _, card = call(server, "GET", f"/v1/models/{MODEL_ID}")
    assert status == 200 and card["id"] == MODEL_ID and card["object"] == "model"


# -- generation ---------------------------------------------------------------------------------------


def test_chat_completion_equals_the_engine_greedy_output_with_usage_and_stats(server):
    status, _, body = call(server, "POST", "/v1/chat/completions", {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 12})
    assert status == 200
    want = expected(server, MESSAGES, max_tokens=12)
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["model"] == MODEL_ID and body["id"].startswith("chatcmpl-")
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["finish_reason"] == want.finish_reason == "length"
    prompt_tokens = len(encode_prompt(server.worker.model.tokenizer, MESSAGES))
    usage = body["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]  # earlier requests of this module warmed the pool
    assert 0 <= cached < prompt_tokens
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": 12, "total_tokens": prompt_tokens + 12,
                     "prompt_tokens_details": {"cached_tokens": cached}}
    stats = body["dspark"]
    assert stats["speculative"] is True
    assert stats["rounds"] == want.rounds > 0
    assert stats["mean_acceptance_length"] == pytest.approx(want.mean_acceptance_length)
    assert stats["generation_tps"] > 0


def test_request_without_max_tokens_uses_the_server_default(server):
    status, _, body = call(server, "POST", "/v1/chat/completions", {"messages": MESSAGES})
    assert status == 200 and body["usage"]["completion_tokens"] == 8  # GenerationOptions(max_tokens=8)


def test_max_completion_tokens_takes_precedence_over_max_tokens(server):
    body = {"messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 3}
    status, _, reply = call(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and reply["usage"]["completion_tokens"] == 3


def test_streaming_chat_deltas_join_to_the_non_streaming_text_and_end_with_done(server):
    body = {"messages": MESSAGES, "max_tokens": 10, "stream_options": {"include_usage": True}}
    events = stream(server, "/v1/chat/completions", body)
    _, _, whole = call(server, "POST", "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks + [usage_chunk])
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    # the second request may reuse the first one's prompt cache: only cached_tokens may differ
    uncached = lambda usage: {k: v for k, v in usage.items() if k != "prompt_tokens_details"}  # noqa: E731
    assert usage_chunk["choices"] == [] and uncached(usage_chunk["usage"]) == uncached(whole["usage"])
    assert chunks[-1]["dspark"]["rounds"] == whole["dspark"]["rounds"]


def test_streaming_without_include_usage_sends_no_usage_chunk(server):
    events = stream(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
    assert events[-1] == "[DONE]"
    assert all(e["choices"] and "usage" not in e for e in events[:-1])


def test_completion_of_a_string_and_of_token_ids_equal_the_engine(server):
    want = expected(server, "Once upon", max_tokens=6)
    status, _, body = call(server, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 6})
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == want.text and body["choices"][0]["finish_reason"] == "length"
    ids = encode_prompt(server.worker.model.tokenizer, "Once upon")
    status, _, by_ids = call(server, "POST", "/v1/completions", {"prompt": [ids], "max_tokens": 6})
    assert status == 200 and by_ids["choices"][0]["text"] == want.text
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


def test_streaming_completion_joins_to_the_engine_text(server):
    want = expected(server, "Once upon", max_tokens=6)
    events = stream(server, "/v1/completions", {"prompt": "Once upon", "max_tokens": 6})
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want.text
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_the_text_and_finishes_with_stop(server):
    full = expected(server, "Once upon", max_tokens=12).text
    stop = full[3:5]
    assert stop, "the tiny model's output is too short for this test"
    status, _, body = call(server, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 12, "stop": [stop]})
    assert status == 200
    assert body["choices"][0]["text"] == full[: full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_sampling_with_a_seed_repeats_and_honours_the_knobs(server):
    body = {"prompt": "Once upon", "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "min_p": 0.01,
            "seed": 7}
    replies = [call(server, "POST", "/v1/completions", body)[2]["choices"][0]["text"] for _ in range(2)]
    want = expected(server, "Once upon", max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=7)
    assert replies == [want.text, want.text]


# -- errors -------------------------------------------------------------------------------------------

ERROR_CASES = [
    ("POST", "/v1/chat/completions", b"{not json", 400, None),
    ("POST", "/v1/chat/completions", b"", 400, None),
    ("POST", "/v1/chat/completions", json.dumps([1, 2]).encode(), 400, None),
    ("POST", "/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, "messages"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), 400, "messages[0].role"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "temperature": -1}).encode(), 400, "temperature"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "top_p": 0}).encode(), 400, "top_p"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 0}).encode(), 400, "max_tokens"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": "8"}).encode(), 400, "max_tokens"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_completion_tokens": 0}).encode(), 400, "max_completion_tokens"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "seed": -1}).encode(), 400, "seed"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "seed": 2**64}).encode(), 400, "seed"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "top_k": -3}).encode(), 400, "top_k"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "min_p": 1}).encode(), 400, "min_p"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "n": 2}).encode(), 400, "n"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "stop": 5}).encode(), 400, "stop"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "stream": "yes"}).encode(), 400, "stream"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}).encode(), 400, "top_logprobs"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "tool_choice": "required"}).encode(), 400, "tool_choice"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "a b"}}]}).encode(), 400, "tools[0].function.name"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "reasoning_effort": "max"}).encode(), 400, "reasoning_effort"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "response_format": {"type": "xml"}}).encode(), 400, "response_format"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "logit_bias": {"x": 1}}).encode(), 400, "logit_bias.x"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "presence_penalty": "high"}).encode(), 400, "presence_penalty"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}}).encode(), 400, "chat_template_kwargs.tokenize"),
    ("POST", "/v1/completions", json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    ("POST", "/v1/completions", json.dumps({"prompt": [10**6]}).encode(), 400, None),  # raised by the engine
    ("POST", "/v1/chat/completions", json.dumps({"model": "gpt-4", "messages": MESSAGES}).encode(), 404, "model"),
    ("GET", "/v1/models/gpt-4", None, 404, "model"),
    ("GET", "/v1/nothing-here", None, 404, None),
    ("POST", "/v2/chat/completions", b"{}", 404, None),
    ("GET", "/v1/chat/completions", None, 405, None),
    ("DELETE", "/v1/models", None, 405, None),
    ("POST", "/v1/completions", json.dumps({"prompt": "x" * (MAX_BODY + 1)}).encode(), 413, None),
]


@pytest.mark.parametrize("method,path,raw,status,param", ERROR_CASES,
                         ids=[f"{c[3]}-{c[0]}-{c[1]}-{i}" for i, c in enumerate(ERROR_CASES)])
def test_bad_requests_get_openai_errors_with_the_right_status(server, method, path, raw, status, param):
    got, response, body = call(server, method, path, raw=raw)
    assert got == status, body
    assert response.getheader("Content-Type") == "application/json"
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and body["error"]["param"] == param
    if status == 405:
        assert response.getheader("Allow") in ("POST", "GET")
    assert call(server, "GET", "/health")[0] == 200  # the server survives every bad request


def test_one_connection_keeps_working_across_errors_streams_and_replies(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    sequence = [
        ("POST", "/v1/nope", json.dumps({"x": 1}), 404),  # an unread body must not leak into the next request
        ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 3, "stream": True}), 200),
        ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "n": 3}), 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 3}), 200),
        ("GET", "/health", None, 200),
    ]
    for method, path, body, status in sequence:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.getheader("Content-Type") == "text/event-stream":
            assert sse_events(response)[-1] == "[DONE]"
            assert response.read() == b"\n"  # the blank line that ends the last event, then the stream ends
        else:
            response.read()
        assert response.status == status, (method, path)
    conn.close()


def test_a_chunked_request_body_gets_411(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    conn.request("POST", "/v1/completions", body=iter([b'{"prompt": "x"}']), encode_chunked=True,
                 headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    response = conn.getresponse()
    assert response.status == 411 and json.loads(response.read())["error"]["code"] == "length_required"
    conn.close()


def test_an_error_with_an_unread_body_closes_the_connection(server):
    status, response, _ = call(server, "PUT", "/v1/chat/completions", raw=b'{"a": 1}')
    assert status == 405 and response.getheader("Connection") == "close"


# -- queueing and disconnects ----------------------------------------------------------------------------


def test_concurrent_requests_equal_the_same_requests_one_at_a_time(server):
    bodies = [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Another one."}], "max_tokens": 16, "stream": True}),
    ]

    def run(path: str, body: dict) -> str:
        if body.get("stream"):
            events = stream(server, path, body)[:-1]
            return "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        status, _, reply = call(server, "POST", path, body)
        assert status == 200
        choice = reply["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]

    alone = [run(path, body) for path, body in bodies]
    together: list[str | None] = [None] * len(bodies)

    def worker(i: int) -> None:
        together[i] = run(*bodies[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert together == alone
    assert len(set(alone)) > 1  # the prompts really differ, so a mix-up would show


def long_answer(server: DSparkHTTPServer) -> dict:
    """Request fields for an answer that runs to its 4000 tokens (the tiny pair's own answer ends in 75, well
    under a second: a loaded machine noticed a disconnect after it)."""
    return {"max_tokens": 4000, "logit_bias": {str(i): -100 for i in server.worker.model.tokenizer.eos_token_ids}}


def test_a_client_that_disconnects_mid_stream_stops_its_generation(server):
    before = {id(job) for job in server.worker.recent}
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    body = {"messages": MESSAGES, "stream": True, **long_answer(server)}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # generation has started
    response.close()
    conn.close()
    # this request's job (a job of an earlier test may end in the meantime)
    mine = lambda: [job for job in list(server.worker.recent) if id(job) not in before and job.request.prompt == MESSAGES]  # noqa: E731
    assert wait_for(lambda: mine()), "the abandoned generation never stopped"
    job = mine()[-1]
    assert job.cancelled.is_set() and job.finish_reason is None
    assert job.generated_tokens < 400
    # The next request is served normally and gets exactly the engine's answer.
    status, _, reply = call(server, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 12})
    assert status == 200
    assert reply["choices"][0]["message"]["content"] == expected(server, MESSAGES, max_tokens=12).text


def test_a_client_that_disconnects_while_waiting_for_a_whole_reply_stops_it(server):
    before = len(server.worker.recent)
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Once", "max_tokens": 4000}),
                 headers={"Content-Type": "application/json"})
    assert wait_for(lambda: server.worker.busy)
    conn.close()
    assert wait_for(lambda: len(server.worker.recent) > before), "the abandoned generation never stopped"
    job = server.worker.recent[-1]
    assert job.cancelled.is_set() and job.generated_tokens < 400
    assert call(server, "POST", "/v1/completions", {"prompt": "Once", "max_tokens": 2})[0] == 200


# -- authentication, loading ---------------------------------------------------------------------------


def test_a_wrong_or_missing_key_gets_401_and_the_right_key_works(tiny_spark_pair):
    with running_server(pair_loader(tiny_spark_pair), api_key="sk-right") as srv:
        body = {"messages": MESSAGES, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-right"}):
            status, response, reply = call(srv, "POST", "/v1/chat/completions", body, headers=headers)
            assert status == 401 and reply["error"]["code"] == "invalid_api_key"
            assert response.getheader("WWW-Authenticate") == "Bearer"
        assert call(srv, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})[0] == 401
        assert call(srv, "GET", "/health")[0] == 200  # health stays open for monitors
        status, _, reply = call(srv, "POST", "/v1/chat/completions", body, headers={"Authorization": "Bearer sk-right"})
        assert status == 200 and reply["usage"]["completion_tokens"] == 2


def test_requests_get_503_while_the_model_loads_then_are_served(tiny_spark_pair):
    release = threading.Event()
    real = pair_loader(tiny_spark_pair)

    def slow_loader():
        assert release.wait(30)
        return real()

    with running_server(slow_loader, wait=False) as srv:
        status, _, body = call(srv, "GET", "/health")
        assert status == 503 and body["status"] == "loading"
        status, response, body = call(srv, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "model_loading"
        assert response.getheader("Retry-After")
        assert call(srv, "GET", "/v1/models")[0] == 200  # the id is known before the weights are
        release.set()
        assert srv.worker.loaded.wait(60)
        assert call(srv, "GET", "/health")[0] == 200
        assert call(srv, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})[0] == 200


def test_the_operator_s_max_draft_tokens_caps_every_round(tiny_spark_pair):
    defaults = GenerationOptions(max_tokens=8, speculation=SpeculationOptions(max_draft_tokens=2))
    with running_server(pair_loader(tiny_spark_pair), defaults=defaults) as srv:
        status, _, body = call(srv, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20})
    assert status == 200
    stats = body["dspark"]
    assert stats["rounds"] > 0 and stats["proposed_tokens"] <= 2 * stats["rounds"]
    want = generate(srv.worker.model, MESSAGES, max_tokens=20, max_draft_tokens=2)
    assert body["choices"][0]["message"]["content"] == want.text
    assert stats["proposed_tokens"] == sum(want.proposal_lengths)


def test_a_failed_load_is_reported_on_health_and_to_requests(tmp_path):
    with running_server(lambda: load(tmp_path / "missing"), wait=True) as srv:
        status, _, body = call(srv, "GET", "/health")
        assert status == 503 and body["status"] == "error" and "missing" in body["error"]
        status, _, body = call(srv, "POST", "/v1/completions", {"prompt": "x"})
        assert status == 503 and body["error"]["code"] == "model_load_failed"


# -- command line -------------------------------------------------------------------------------------------


def test_the_command_line_binds_loopback_loads_and_serves(tiny_spark_pair, tmp_path):
    target, draft = tiny_spark_pair
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "mlx_dspark.server", "--model", str(target), "--draft", str(draft), "--port", "0",
               "--served-model-name", MODEL_ID, "--max-tokens-default", "3", "--log-level", "warning"]
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_file)
    try:
        assert wait_for(lambda: "[mlx_dspark] ready (" in log_path.read_text() or process.poll() is not None, timeout=90), log_path.read_text()
        match = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", log_path.read_text())
        assert match and process.poll() is None, log_path.read_text()
        conn = http.client.HTTPConnection("127.0.0.1", int(match.group(1)), timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({"model": MODEL_ID, "messages": MESSAGES}),
                     headers={"Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read())
        conn.close()
        assert reply["usage"]["completion_tokens"] == 3
    finally:
        process.terminate()
        process.wait(30)


def test_the_command_line_rejects_bad_flags_and_unloadable_models_with_one_line(tmp_path):
    from typer.testing import CliRunner

    from mlx_dspark.cli.server import app

    runner = CliRunner()
    result = runner.invoke(app, ["--port", "0", "--temp", "-1"])
    assert result.exit_code == 2 and "temperature" in result.output
    result = runner.invoke(app, ["--port", "0", "--draft-sampling", "fast"])
    assert result.exit_code == 2 and "--draft-sampling" in result.output
    result = runner.invoke(app, ["--port", "0", "--model", str(tmp_path / "missing"), "--log-level", "error"])
    assert result.exit_code == 2 and "could not load the model" in result.output
    result = runner.invoke(app, ["--port", "0", "--spec-draft-p-min", "2"])
    assert result.exit_code == 2 and "--confidence-threshold: confidence_threshold must be a number in [0, 1]" in result.output
    result = runner.invoke(app, ["--port", "0", "--max-tokens-default", "0"])
    assert result.exit_code == 2 and "--max-tokens-default: max_tokens must be an integer >= 1" in result.output


def test_the_command_line_refuses_more_draft_tokens_than_the_loaded_block_holds(tiny_spark_pair):
    from typer.testing import CliRunner

    from mlx_dspark.cli.server import app

    target, draft = tiny_spark_pair
    args = ["--port", "0", "--model", str(target), "--draft", str(draft), "--spec-draft-n-max", "8", "--log-level", "error"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "--max-draft-tokens: max_draft_tokens must be at most the draft's block size 7, got 8" in result.output
