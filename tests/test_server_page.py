"""The page at GET / and GET /metrics, over real HTTP on 127.0.0.1 with the tiny spark pair."""

from __future__ import annotations

import http.client
import json

import pytest

from mlx_dspark.engine.options import GenerationOptions
from tests.test_server import MESSAGES, call, pair_loader, running_server, sse_events

prometheus_parser = pytest.importorskip("prometheus_client.parser", reason="prometheus_client (the test extras) is not installed")


@pytest.fixture(scope="module")
def server(tiny_spark_pair):
    with running_server(pair_loader(tiny_spark_pair), defaults=GenerationOptions(max_tokens=8)) as srv:
        yield srv


def get(server, path: str, headers: dict | None = None) -> tuple[int, http.client.HTTPResponse, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    conn.request("GET", path, headers=headers or {})
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, response, body


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in prometheus_parser.text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_move_after_a_request(server):
    status, response, body = get(server, "/metrics")
    assert status == 200 and response.getheader("Content-Type").startswith("text/plain; version=0.0.4")
    before = samples(body.decode())
    assert before[("mlx_dspark_up", (("model", "tiny-spark"), ("state", "ok")))] == 1
    status, _, reply = call(server, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6})
    assert status == 200
    after = samples(get(server, "/metrics")[2].decode())
    key = ("mlx_dspark_requests_total", (("api", "chat"), ("finish_reason", reply["choices"][0]["finish_reason"])))
    assert after[key] == before.get(key, 0) + 1
    generated = reply["usage"]["completion_tokens"]
    assert after[("mlx_dspark_generation_tokens_total", ())] == before[("mlx_dspark_generation_tokens_total", ())] + generated
    by_origin = sum(v for (name, _), v in after.items() if name == "mlx_dspark_generated_tokens_by_origin_total")
    assert by_origin == after[("mlx_dspark_generation_tokens_total", ())]
    rounds = reply["dspark"]["rounds"]
    assert after[("mlx_dspark_acceptance_length_count", ())] == before[("mlx_dspark_acceptance_length_count", ())] + rounds
    assert after[("mlx_dspark_rounds_total", ())] - before[("mlx_dspark_rounds_total", ())] == rounds
    assert after[("mlx_dspark_prompt_tokens_total", ())] > before[("mlx_dspark_prompt_tokens_total", ())]


def test_a_browser_gets_the_page_and_api_clients_the_json(server):
    status, response, body = get(server, "/", {"Accept": "text/html,application/xhtml+xml"})
    assert status == 200 and response.getheader("Content-Type").startswith("text/html")
    csp = response.getheader("Content-Security-Policy")
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert b'<script src="/static/page.js"' in body and b"<script>" not in body  # no inline script
    for path, kind in [("/static/page.js", "text/javascript"), ("/static/page.css", "text/css")]:
        status, response, _ = get(server, path)
        assert status == 200 and response.getheader("Content-Type").startswith(kind)
    status, _, body = get(server, "/", {"Accept": "application/json"})
    assert status == 200 and json.loads(body)["object"] == "server"


def test_marks_ride_on_the_stream_only_when_asked(server):
    body = {"messages": MESSAGES, "max_tokens": 8, "stream": True}
    for marks in (False, True):
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", **({"X-DSpark-Marks": "1"} if marks else {})})
        events = [e for e in sse_events(conn.getresponse()) if e != "[DONE]"]
        conn.close()
        steps = [e["dspark_step"] for e in events if "dspark_step" in e]
        if not marks:
            assert steps == []
            continue
        assert sum(step["tokens"] for step in steps) == 8
        for step in steps:
            assert sum(n for n, _ in step["marks"]) == len(step["text"])
            assert {origin for _, origin in step["marks"]} <= {"draft", "lookup", "forced", "target"}
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
        assert content == "".join(step["text"] for step in steps)  # no template markup on this pair


def test_metrics_sit_behind_the_key_and_can_be_turned_off(tiny_spark_pair):
    with running_server(pair_loader(tiny_spark_pair), api_key="sekrit") as srv:
        assert get(srv, "/metrics")[0] == 401
        assert get(srv, "/metrics", {"Authorization": "Bearer sekrit"})[0] == 200
        assert get(srv, "/", {"Accept": "text/html"})[0] == 200  # the page holds no data; its API calls need the key
    with running_server(pair_loader(tiny_spark_pair), metrics=False) as srv:
        assert get(srv, "/metrics")[0] == 404
