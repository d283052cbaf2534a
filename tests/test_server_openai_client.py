"""The official `openai` Python client, unchanged, against the server on 127.0.0.1 with the tiny pair."""

from __future__ import annotations

from typing import Iterator

import pytest

openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install -e '.[test]')")

from mlx_dspark.api import generate  # noqa: E402
from tests.test_server import MESSAGES, MODEL_ID, pair_loader, running_server  # noqa: E402

API_KEY = "sk-local-test"


@pytest.fixture(scope="module")
def server(tiny_spark_pair):
    with running_server(pair_loader(tiny_spark_pair), api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> Iterator["openai.OpenAI"]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def test_models_list_shows_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID


def test_chat_completion_gives_the_engine_text_usage_and_dspark_stats(client, server):
    reply = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=10, temperature=0)
    want = generate(server.worker.model, MESSAGES, max_tokens=10)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 10 and reply.usage.total_tokens == reply.usage.prompt_tokens + 10
    stats = reply.model_extra["dspark"]
    assert stats["rounds"] == want.rounds and stats["mean_acceptance_length"] == pytest.approx(want.mean_acceptance_length)


def test_streaming_chat_with_usage_joins_to_the_non_streaming_text(client):
    whole = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=10)
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_completions_streaming_and_not_agree(client):
    whole = client.completions.create(model=MODEL_ID, prompt="Once upon", max_tokens=8)
    pieces = client.completions.create(model=MODEL_ID, prompt="Once upon", max_tokens=8, stream=True)
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert whole.usage.completion_tokens == 8


def test_seeded_sampling_through_the_client_repeats(client):
    options = dict(model=MODEL_ID, messages=MESSAGES, max_tokens=8, temperature=0.8, top_p=0.95, seed=11,
                   extra_body={"top_k": 40, "min_p": 0.02})
    first, second = (client.chat.completions.create(**options).choices[0].message.content for _ in range(2))
    assert first == second


def test_client_exceptions_match_the_status_codes(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=2, n=2)
    assert err.value.body["param"] == "n"
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
