"""The server's limits: the context budget, cancelling a prefill nobody waits for, client template switches.

In-process servers on free 127.0.0.1 ports with the tiny spark pair (context 4096); the target is
wrapped to count its forwards, so "no model work" and "within one prefill chunk" are counts.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import time
from typing import Any, Callable

import pytest

from mlx_dspark.loading.load import load
from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.serve.app import make_server
from tests.test_context_and_cancel import CountingTarget
from tests.test_server import MESSAGES, call, running_server, wait_for

LONG_TEXT = "Once upon a time, there was a story. " * 1200  # about 21,600 tokens: over the context of 4096


def counting_loader(pair, on_call: Callable[[int], None] | None = None) -> tuple[Callable[[], Any], dict]:
    """A loader whose target counts forwards; the counter is in `holder["target"]` once loaded."""
    holder: dict[str, Any] = {}

    def loader():
        model = load(pair[0], draft=pair[1])
        holder["target"] = CountingTarget(model.target, on_call)
        return dataclasses.replace(model, target=holder["target"])

    return loader, holder


# -- the context budget --------------------------------------------------------------------------------


def test_an_over_context_prompt_is_refused_at_once_and_the_next_request_is_served_at_once(tiny_spark_pair):
    loader, holder = counting_loader(tiny_spark_pair)
    with running_server(loader, defaults=GenerationOptions(max_tokens=4)) as srv:
        for path, body, param in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages"),
            ("/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 2}, "prompt"),
        ]:
            started = time.monotonic()
            status, _, reply = call(srv, "POST", path, body)
            refused_s = time.monotonic() - started
            assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
            assert reply["error"]["param"] == param and "4096" in reply["error"]["message"]
            assert refused_s < 1.0, refused_s
        assert holder["target"].calls == 0  # no model work at all
        started = time.monotonic()
        status, _, reply = call(srv, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        assert status == 200 and time.monotonic() - started < 5


def test_max_tokens_over_the_room_left_is_a_400_naming_the_numbers_and_an_absent_one_is_clamped(tiny_spark_pair):
    prompt = list(range(10, 50))  # 40 token ids
    with running_server(lambda: load(tiny_spark_pair[0], draft=tiny_spark_pair[1]),
                        defaults=GenerationOptions(max_tokens=500, max_context=48)) as srv:
        status, _, reply = call(srv, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 20})
        assert status == 400 and reply["error"]["param"] == "max_tokens"
        assert reply["error"]["code"] == "context_length_exceeded"
        message = reply["error"]["message"]
        assert "(40 tokens)" in message and "max_tokens (20)" in message and "60 tokens" in message and "at most 8" in message
        status, _, reply = call(srv, "POST", "/v1/completions", {"prompt": prompt, "max_completion_tokens": 8})
        assert status == 200 and reply["usage"]["completion_tokens"] <= 8
        status, _, reply = call(srv, "POST", "/v1/completions", {"prompt": prompt})  # the default 500: clamped to 8
        assert status == 200 and reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"] <= 48
        assert reply["usage"]["completion_tokens"] == 8 or reply["choices"][0]["finish_reason"] == "stop"


# -- a client that leaves during the prefill ----------------------------------------------------------------


def test_a_client_leaving_mid_prefill_frees_the_worker_within_one_prefill_chunk(tiny_spark_pair):
    forwards: list[bool] = []  # per target forward: was the running job already cancelled when it started?
    server: dict[str, Any] = {}

    def on_call(_: int) -> None:
        job = server["srv"].worker.current
        forwards.append(job is not None and job.cancelled.is_set())
        time.sleep(0.004)  # a slower model: 600 chunks take seconds, so the client surely leaves mid-prefill

    loader, holder = counting_loader(tiny_spark_pair, on_call)
    prompt = [(7 * i + 3) % 300 + 10 for i in range(2400)]
    with running_server(loader, defaults=GenerationOptions(max_tokens=4, prefill_step_size=4)) as srv:
        server["srv"] = srv
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt}),
                     headers={"Content-Type": "application/json"})
        assert wait_for(lambda: holder["target"].calls >= 20)  # the prefill is under way
        conn.close()  # the client leaves
        assert wait_for(lambda: not srv.worker.busy, timeout=10)
        job = srv.worker.recent[-1]
        assert job.cancelled.is_set() and job.steps == 0
        assert len(forwards) < 600 // 2  # the prefill did not run to its end
        assert sum(forwards) <= 1  # at most the chunk that started as the cancel came
        status, _, _ = call(srv, "POST", "/v1/completions", {"prompt": "next", "max_tokens": 2})
        assert status == 200


# -- chat template switches from clients ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_spark_pair):
    with running_server(lambda: load(tiny_spark_pair[0], draft=tiny_spark_pair[1]),
                        defaults=GenerationOptions(max_tokens=2)) as srv:
        yield srv


@pytest.mark.parametrize("kwargs,param", [
    ({"chat_template": "{{ 'x' * 2000000 }}"}, "chat_template_kwargs.chat_template"),
    ({"enable_thinking": False, "custom_flag": True}, "chat_template_kwargs.custom_flag"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
])
def test_template_switches_outside_the_allow_list_are_a_400_naming_them(server, kwargs, param):
    status, _, reply = call(server, "POST", "/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": kwargs})
    assert status == 400 and reply["error"]["param"] == param and reply["error"]["code"] == "template_kwarg_not_allowed"
    assert "enable_thinking" in reply["error"]["message"] and "--allow-template-kwarg" in reply["error"]["message"]


@pytest.mark.parametrize("value", [["a"], {"x": 1}, 3, None, "x" * 65])
def test_an_allowed_switch_takes_only_a_bool_or_a_short_string(server, value):
    status, _, reply = call(server, "POST", "/v1/chat/completions",
                            {"messages": MESSAGES, "chat_template_kwargs": {"thinking_effort": value}})
    assert status == 400 and reply["error"]["param"] == "chat_template_kwargs.thinking_effort", reply


def test_allowed_switches_reach_the_template(server):
    plain = call(server, "POST", "/v1/chat/completions", {"messages": MESSAGES})
    thinking = call(server, "POST", "/v1/chat/completions",
                    {"messages": MESSAGES, "chat_template_kwargs": {"thinking_effort": "high", "enable_thinking": True,
                                                                     "reasoning_effort": "low"}})
    assert plain[0] == thinking[0] == 200
    # Spark's template opens a <think> block for thinking_effort: one more prompt token
    assert thinking[2]["usage"]["prompt_tokens"] == plain[2]["usage"]["prompt_tokens"] + 1


def test_the_operator_can_allow_more_switches_but_never_the_template_itself(tiny_spark_pair):
    with running_server(lambda: load(tiny_spark_pair[0], draft=tiny_spark_pair[1]),
                        defaults=GenerationOptions(max_tokens=2), allow_template_kwargs=["custom_flag"]) as srv:
        status, _, _ = call(srv, "POST", "/v1/chat/completions",
                            {"messages": MESSAGES, "chat_template_kwargs": {"custom_flag": True}})
        assert status == 200
    for name, message in [("chat_template", "cannot come from clients"), ("tokenize", "cannot come from clients"),
                          ("not a name", "template variable name")]:
        with pytest.raises(ValueError, match=message):
            make_server(lambda: None, model_id="m", port=0, allow_template_kwargs=[name])
