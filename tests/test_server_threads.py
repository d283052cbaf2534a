"""The thread store behind Anthropic's `thread` field (serve/threads.py), without a model: a continue
gets the held conversation, each reply continues once and not twice at a time, the create's system and
tools stay, idle threads expire, and each refusal carries the SDK's `error.details.error_code`."""

from __future__ import annotations

import pytest

from mlx_dspark.serve.errors import APIError
from mlx_dspark.serve.threads import ThreadStore

USER = {"role": "user", "content": "Weather?"}
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]
REPLY = [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]
RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}


def _create(store: ThreadStore, reply_id: str = "msg_1") -> None:
    _, turn = store.begin({"thread": {"type": "create"}, "system": "Be brief.", "tools": TOOLS, "messages": [USER],
                           "max_tokens": 9})
    store.finish(turn, reply_id, REPLY)


def _continue(store: ThreadStore, previous: str = "msg_1", **extra):
    return store.begin({"thread": {"type": "continue", "previous_message_id": previous}, "messages": [RESULT],
                        "max_tokens": 9, **extra})


def _code(err: pytest.ExceptionInfo) -> tuple[int, str]:
    body = err.value.anthropic_body()["error"]
    return err.value.status, body["details"]["error_code"]


def test_a_continue_is_answered_from_the_held_conversation_with_the_create_s_system_and_tools():
    store = ThreadStore()
    _create(store)
    body, turn = _continue(store)
    assert "thread" not in body and body["system"] == "Be brief." and body["tools"] == TOOLS and body["max_tokens"] == 9
    assert body["messages"] == [USER, {"role": "assistant", "content": REPLY}, RESULT]
    store.finish(turn, "msg_2", [{"type": "text", "text": "Sunny."}])
    assert _continue(store, "msg_2")[0]["messages"][-2] == {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]}


def test_each_reply_continues_once_and_not_twice_at_a_time():
    store = ThreadStore()
    _create(store)
    _, turn = _continue(store)
    with pytest.raises(APIError) as err:
        _continue(store)
    assert _code(err) == (400, "thread_continue_in_flight")
    store.abandon(turn)  # no complete reply: it may be continued again
    _, turn = _continue(store)
    store.finish(turn, "msg_2", REPLY)
    with pytest.raises(APIError) as err:
        _continue(store)
    assert _code(err) == (400, "thread_already_continued")


def test_changed_tools_on_a_continue_are_refused_and_the_same_ones_taken():
    store = ThreadStore()
    _create(store)
    with pytest.raises(APIError) as err:
        _continue(store, tools=[])
    assert _code(err) == (400, "thread_fingerprint_mismatch") and "'tools'" in err.value.message
    assert _continue(store, tools=TOOLS)[0]["tools"] == TOOLS


def test_threads_expire_when_idle_and_the_oldest_goes_past_capacity():
    now = [0.0]
    store = ThreadStore(capacity=2, ttl_s=60, clock=lambda: now[0])
    for reply_id in ("msg_a", "msg_b", "msg_c"):
        _create(store, reply_id)
    assert len(store) == 2
    with pytest.raises(APIError) as err:
        _continue(store, "msg_a")
    assert _code(err) == (404, "thread_not_found") and "thread" in err.value.message
    now[0] = 61.0
    with pytest.raises(APIError) as err:
        _continue(store, "msg_c")
    assert _code(err) == (404, "thread_not_found") and len(store) == 0


def test_a_conversation_past_the_size_bound_is_unsupported_with_the_bound_in_the_message():
    store = ThreadStore(max_bytes=400)
    with pytest.raises(APIError) as err:
        store.begin({"thread": {"type": "create"}, "messages": [{"role": "user", "content": "x" * 500}]})
    assert _code(err) == (400, "thread_unsupported_request") and "at most 400" in err.value.message
    _create(store)  # fits; the reply with the next turn does not, and the continue says why
    _, turn = _continue(store)
    store.finish(turn, "msg_2", [{"type": "text", "text": "y" * 300}])
    with pytest.raises(APIError) as err:
        _continue(store, "msg_2")
    assert _code(err) == (400, "thread_unsupported_request")


def test_a_bad_thread_field_is_a_400_naming_it():
    with pytest.raises(APIError) as err:
        ThreadStore().begin({"thread": {"type": "continue"}, "messages": [USER]})
    assert err.value.status == 400 and err.value.param == "thread.previous_message_id"
