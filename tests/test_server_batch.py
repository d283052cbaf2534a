"""The server with `max_batch` > 1 (serve/batch_worker.py), over real HTTP on 127.0.0.1 with the tiny spark pair.

Concurrent requests share rounds; each greedy answer must equal the engine's solo `generate`, a seeded
sampled request its own answer when sent alone, a JSON-schema request the solo constrained run, and a
client that leaves mid-stream must stop only its own generation. A churn of 40 clients loses nothing
and the server returns to idle.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections import deque
from types import SimpleNamespace

import pytest

from mlx_dspark.api import generate
from mlx_dspark.engine.logits.constraints import Constraint
from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.serve.batch_worker import BatchWorker
from tests.test_server import call, pair_loader, running_server, sse_events, stream, wait_for

FIXED_CAP = 3  # one draft length at every width: a seeded sampled request then repeats whatever its neighbours


@pytest.fixture(scope="module")
def server(tiny_spark_pair):
    # 8-token prefill chunks: a newcomer's prompt spans rounds of the running streams
    with running_server(pair_loader(tiny_spark_pair), defaults=GenerationOptions(max_tokens=8), max_batch=4,
                        batch_draft_cap=lambda width: FIXED_CAP, batch_prefill_chunk=8) as srv:  # fmt: skip
        yield srv


def completion(server, prompt, **body):
    status, _, reply = call(server, "POST", "/v1/completions", {"prompt": prompt, "temperature": 0, **body})
    assert status == 200, reply
    return reply


def idle(server) -> bool:
    work = call(server, "GET", "/health")[2]["work"]
    return work["active"] == 0 and server.worker.queued == 0


def test_max_batch_one_keeps_the_one_at_a_time_worker(tiny_spark_pair):
    with running_server(pair_loader(tiny_spark_pair), wait=False) as srv:
        assert not isinstance(srv.worker, BatchWorker)


def test_concurrent_requests_each_equal_their_solo_runs(server):
    model = server.worker.model
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    sampled = {"prompt": "Once upon", "max_tokens": 14, "temperature": 0.9, "seed": 11}
    alone = completion(server, **sampled)["choices"][0]["text"]
    greedy = [("Once upon", 20), ("The quick brown fox jumps over the lazy dog. " * 2, 9), ("def f(x):", 16)]
    results: dict[str, object] = {}
    gate = threading.Barrier(6)

    def run(name, fn):
        gate.wait()
        results[name] = fn()

    def leave_mid_stream():
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
        body = {"prompt": "A long story:", "max_tokens": 400, "temperature": 0, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        seen = 0
        for line in response:
            seen += line.startswith(b"data: ")
            if seen == 3:
                break
        conn.close()  # the client leaves: its generation must stop, the others go on
        return seen

    chat = {"messages": [{"role": "user", "content": "A number?"}], "max_tokens": 24, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    jobs = {f"greedy{i}": (lambda p=p, n=n: completion(server, p, max_tokens=n)) for i, (p, n) in enumerate(greedy)}
    jobs["sampled"] = lambda: completion(server, **sampled)
    jobs["cancelled"] = leave_mid_stream
    jobs["schema"] = lambda: call(server, "POST", "/v1/chat/completions", chat)[2]
    threads = [threading.Thread(target=run, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (prompt, n) in enumerate(greedy):
        want = generate(model, prompt, max_tokens=n)
        reply = results[f"greedy{i}"]
        assert reply["choices"][0]["text"] == want.text and reply["usage"]["completion_tokens"] == len(want.tokens)
    assert results["sampled"]["choices"][0]["text"] == alone
    assert results["cancelled"] == 3
    want = generate(model, chat["messages"], max_tokens=24, constraint=Constraint.json_schema(schema))
    assert results["schema"]["choices"][0]["message"]["content"] == want.text
    assert server.worker.peak_active >= 3, "the requests did share rounds"
    assert wait_for(lambda: idle(server))
    (cancelled,) = [job for job in server.worker.recent if job.request.options.max_tokens == 400]
    assert cancelled.cancelled.is_set() and cancelled.generated_tokens < 400


def test_health_reports_the_batch_and_its_rates(server):
    completion(server, "Once upon", max_tokens=6)
    work = call(server, "GET", "/health")[2]["work"]
    assert work["max_batch"] == 4 and work["active"] == 0 and work["rounds"] > 0 and work["generated_tokens"] >= 6
    assert work["requests"] == [] and work["tokens_per_second"] >= 0


def test_streaming_in_a_batch_joins_to_the_engine_text(server):
    want = generate(server.worker.model, "Once upon", max_tokens=7)
    events = stream(server, "/v1/completions", {"prompt": "Once upon", "max_tokens": 7, "temperature": 0})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want.text


def test_churn_of_40_clients_loses_nothing_and_returns_to_idle(tiny_spark_pair):
    with running_server(pair_loader(tiny_spark_pair), max_batch=8) as srv:
        srv.worker.recent = deque(maxlen=64)  # every job of the churn stays visible
        prompts = ["Once upon", "def f(x):", "1 2 3", "Hello there"]
        outcomes: list[tuple] = []
        lock = threading.Lock()

        def client(i):
            prompt, n = prompts[i % 4], 1 + i % 5
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
            if i % 7 == 0:  # leaves as soon as its stream starts
                conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
                conn.request("POST", "/v1/completions", body=json.dumps({**body, "max_tokens": 300, "stream": True}),
                             headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                response.readline()
                conn.close()
                return
            if i % 3 == 0:
                conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
                conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                             headers={"Content-Type": "application/json"})
                events = sse_events(conn.getresponse())
                conn.close()
                text = "".join(e["choices"][0]["text"] for e in events[:-1])
            else:
                status, _, reply = call(srv, "POST", "/v1/completions", body)
                assert status == 200, reply
                text = reply["choices"][0]["text"]
            with lock:
                outcomes.append((prompt, n, text))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(outcomes) == 40 - len(range(0, 40, 7))
        model = srv.worker.model
        wants = {(p, n): generate(model, p, max_tokens=n).text for p, n, _ in outcomes}
        assert all(text == wants[(p, n)] for p, n, text in outcomes)
        assert wait_for(lambda: idle(srv))
        assert srv.worker.peak_active > 1 and len(srv.worker.prompt_caches) <= srv.worker.cache_budget.conversations
        left = [job for job in srv.worker.recent if job.request.options.max_tokens == 300]
        assert len(left) == 6 and all(job.cancelled.is_set() and job.generated_tokens < 300 for job in left)


def test_a_repeated_prompt_reuses_its_prompt_cache_in_a_batch(server):
    prompt = "Tell me about the quick brown fox and the lazy dog, twice over."
    first = completion(server, prompt, max_tokens=5)
    again = completion(server, prompt, max_tokens=5)
    assert again["choices"][0]["text"] == first["choices"][0]["text"] == generate(server.worker.model, prompt, max_tokens=5).text
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_command_line_rejects_batch_flags_below_one():
    from typer.testing import CliRunner

    from mlx_dspark.cli.server import app

    result = CliRunner().invoke(app, ["--port", "0", "--max-batch", "0"])
    assert result.exit_code == 2 and "--max-batch must be >= 1, got 0" in result.output
    result = CliRunner().invoke(app, ["--port", "0", "--max-batch", "2", "--batch-prefill-chunk", "0"])
    assert result.exit_code == 2 and "--batch-prefill-chunk must be >= 1, got 0" in result.output
    result = CliRunner().invoke(app, ["--port", "0", "--batch-max-tokens", "0"])
    assert result.exit_code == 2 and "--batch-max-tokens must be >= 1, got 0" in result.output


def test_the_batch_plans_over_this_machine_s_costs_and_serves_without_them(tiny_spark_pair, monkeypatch, tmp_path):
    from mlx_dspark.engine.batch import length as batch_length
    from mlx_dspark.engine.costs import probe as cost_probe

    with running_server(pair_loader(tiny_spark_pair), defaults=GenerationOptions(max_tokens=6), max_batch=2) as srv:
        assert srv.worker.cost is not None and srv.worker.cost.source == "flat (tests)"  # measured at load (conftest's)
        planned = completion(srv, "Once upon")["choices"][0]["text"]

    def broken(target, draft, *, max_batch):
        raise RuntimeError("the probe failed")

    monkeypatch.setenv(cost_probe.COST_DIR_ENV, str(tmp_path))  # nothing cached: it must measure, and fails
    monkeypatch.setattr(batch_length, "measure_batch_cost", broken)
    with running_server(pair_loader(tiny_spark_pair), defaults=GenerationOptions(max_tokens=6), max_batch=2) as srv:
        assert srv.worker.cost is None  # each request keeps its own draft length policy
        assert completion(srv, "Once upon")["choices"][0]["text"] == planned


def test_the_default_width_serves_a_pair_it_cannot_batch_one_at_a_time(tiny_spark_pair, monkeypatch):
    from mlx_dspark.serve import batch_worker

    monkeypatch.setattr(batch_worker, "packing_problem", lambda model: "its layers are not packed (this test)")
    options = dict(defaults=GenerationOptions(max_tokens=6), max_batch=4)
    with running_server(pair_loader(tiny_spark_pair), batch_required=False, **options) as srv:
        assert srv.worker.one_at_a_time and srv.worker.state == "ok"
        text = completion(srv, "Once upon")["choices"][0]["text"]
        assert call(srv, "GET", "/health")[2]["work"]["max_batch"] == 1
    model = srv.worker.model
    assert text == generate(model, "Once upon", options=GenerationOptions(max_tokens=6)).text
    with running_server(pair_loader(tiny_spark_pair), **options) as srv:  # asked for: refused, in one line
        assert srv.worker.load_error == "--max-batch 4: its layers are not packed (this test); serve it with --max-batch 1"


def test_the_command_line_batches_by_default_and_a_width_given_is_required(monkeypatch):
    from typer.testing import CliRunner

    from mlx_dspark.cli.server import app
    from mlx_dspark.serve import app as serve_app
    from mlx_dspark.serve.protocol import DEFAULT_MAX_BATCH

    asked = []

    def make_server(loader, **options):
        asked.append((options["max_batch"], options["batch_required"]))
        raise ValueError("stop here")

    monkeypatch.setattr(serve_app, "make_server", make_server)
    assert CliRunner().invoke(app, ["--port", "0"]).exit_code != 0
    assert CliRunner().invoke(app, ["--port", "0", "--max-batch", "2"]).exit_code != 0
    assert asked == [(DEFAULT_MAX_BATCH, False), (2, True)]


def test_a_long_prompt_s_prefill_progress_is_logged(tiny_spark_pair, monkeypatch, caplog):
    from mlx_dspark.serve import batch_worker

    monkeypatch.setattr(batch_worker, "LOG_EVERY_S", 0.0)  # every round (the server: every 10 s)
    with caplog.at_level("INFO", logger="mlx_dspark.server"):
        with running_server(pair_loader(tiny_spark_pair), defaults=GenerationOptions(max_tokens=2), max_batch=2,
                            batch_prefill_chunk=8) as srv:  # fmt: skip
            completion(srv, "The quick brown fox jumps over the lazy dog. " * 3)
    lines = [r.getMessage() for r in caplog.records if "prefill" in r.getMessage() and "prompt tokens done" in r.getMessage()]
    done = [int(line.split("prefill ")[1].split(" of ")[0]) for line in lines]
    assert len(done) >= 2 and done == sorted(done) and all("(1 in the batch)" in line for line in lines), lines


def test_requests_past_the_token_budget_wait_their_turn(tiny_spark_pair):
    """--batch-max-tokens bounds what the active requests hold together (prompt + max_tokens each): two
    that do not fit together run one after the other, in order, each equal to its solo run; two that fit
    share rounds."""
    prompts = ["The quick brown fox jumps over the lazy dog. " * 2, "def f(x):"]
    model = pair_loader(tiny_spark_pair)()
    sizes = [len(model.tokenizer.encode(p)) + 24 for p in prompts]
    budget = max(sizes)  # each fits alone, not both
    with running_server(pair_loader(tiny_spark_pair), defaults=GenerationOptions(max_tokens=24), max_batch=4,
                        batch_max_tokens=budget) as srv:  # fmt: skip
        texts: dict[int, str] = {}
        gate = threading.Barrier(2)

        def run(i):
            gate.wait()
            texts[i] = completion(srv, prompts[i])["choices"][0]["text"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert srv.worker.peak_active == 1 and call(srv, "GET", "/health")[2]["work"]["token_budget"] == budget
        for i, prompt in enumerate(prompts):
            assert texts[i] == generate(model, prompt, options=GenerationOptions(max_tokens=24)).text
    worker = BatchWorker(lambda: model, max_batch=4, max_tokens=100)
    prepared = lambda n, max_tokens: (list(range(n)), SimpleNamespace(max_tokens=max_tokens), None)  # noqa: E731
    assert worker._fits(prepared(500, 500))  # alone, a request always runs
    worker.active = [SimpleNamespace(tokens=60)]
    assert worker._fits(prepared(10, 30)) and not worker._fits(prepared(11, 30))


def test_the_default_token_budget_follows_the_memory(tiny_spark_pair):
    from mlx.utils import tree_flatten

    from mlx_dspark.engine.batch.length import BatchCost
    from mlx_dspark.serve.batch_worker import MEMORY_SHARE, memory_token_budget

    model = pair_loader(tiny_spark_pair)()
    cost = BatchCost(rows_ms={1: 1.0}, sequences_ms={}, draft_ms={}, bytes_per_token=1000.0)
    weights = sum(v.nbytes for m in (model.target, model.draft) for _, v in tree_flatten(m.parameters()))
    assert memory_token_budget(model, cost, 10**6, memory=10**9) == int((MEMORY_SHARE * 10**9 - weights - 10**6) / 1000.0)
    assert memory_token_budget(model, cost, 10**6, memory=10**6) == 1  # no room: one request at a time
    assert memory_token_budget(model, BatchCost(rows_ms={1: 1.0}, sequences_ms={}, draft_ms={}), 0) is None  # unknown


def test_a_bug_in_the_cost_measurement_fails_the_load_on_health_instead_of_hanging(tiny_spark_pair, monkeypatch, tmp_path):
    from mlx_dspark.engine.batch import length as batch_length
    from mlx_dspark.engine.costs import probe as cost_probe

    def buggy(target, draft, *, max_batch):
        raise TypeError("unsupported operand")

    monkeypatch.setenv(cost_probe.COST_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(batch_length, "measure_batch_cost", buggy)
    with running_server(pair_loader(tiny_spark_pair), max_batch=2) as srv:
        assert srv.worker.state == "error" and srv.worker.load_error == "TypeError: unsupported operand"
        assert call(srv, "GET", "/health")[2]["status"] == "error"
