"""The context budget (OpenAI's refuse / clamp rules) and cancellation between prefill chunks and rounds.

API level on the tiny spark pair (context: its max_position_embeddings, 4096). Forwards are counted
by a proxy around the target, so "before any model work" and "within one prefill chunk" are counts,
not timings.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import mlx.core as mx
import pytest

import mlx_dspark
from mlx_dspark.api import ContextLengthError, GenerationCancelled, stream_generate
from mlx_dspark.engine.options import GenerationOptions, OptionError


class CountingTarget:
    """The target model, counting its forwards; `on_call(count)` runs before each one."""

    def __init__(self, target: Any, on_call: Callable[[int], None] | None = None) -> None:
        self._inner = target
        self.calls = 0
        self.on_call = on_call

    def __call__(self, inputs: mx.array, cache: Any = None, *, tap_ids: tuple = (), last_only: bool = False):
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        return self._inner(inputs, cache, tap_ids=tap_ids, last_only=last_only)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def counted(model: Any, on_call: Callable[[int], None] | None = None) -> tuple[Any, CountingTarget]:
    target = CountingTarget(model.target, on_call)
    return dataclasses.replace(model, target=target), target


@pytest.fixture(scope="module")
def pair(tiny_spark_pair):
    return mlx_dspark.load(str(tiny_spark_pair[0]), draft=str(tiny_spark_pair[1]))


def prompt_ids(n: int) -> list[int]:
    return [(7 * i + 3) % 300 + 10 for i in range(n)]


# -- the context budget ------------------------------------------------------------------------------


def test_the_context_is_the_targets_max_position_embeddings(pair):
    assert pair.target_config["max_position_embeddings"] == 4096
    model, target = counted(pair)
    with pytest.raises(ContextLengthError) as info:
        mlx_dspark.generate(model, prompt_ids(4000), max_tokens=200)
    err = info.value
    assert (err.field, err.prompt_tokens, err.max_tokens, err.context, err.room) == ("max_tokens", 4000, 200, 4096, 96)
    assert "4200 tokens" in str(err) and "at most 96" in str(err) and "max_position_embeddings" in str(err)
    assert target.calls == 0  # refused before any model work
    # what fits runs, up to the last position of the context (a small one: a 4000-token prefill is slow here)
    result = mlx_dspark.generate(model, prompt_ids(50), max_tokens=14, max_context=64)
    assert result.prompt_tokens + len(result.tokens) <= 64 and target.calls > 0


def test_a_prompt_that_leaves_no_room_is_refused_whatever_max_tokens(pair):
    model, target = counted(pair)
    for clamp in (False, True):
        options = GenerationOptions(max_tokens=1, max_context=64, clamp_max_tokens=clamp)
        with pytest.raises(ContextLengthError, match="the prompt is 64 tokens, and the context is 64") as info:
            mlx_dspark.generate(model, prompt_ids(64), options=options)
        assert info.value.field == "prompt"
    assert target.calls == 0


def test_a_default_max_tokens_is_clamped_to_the_room_left_as_openai_does(pair):
    options = GenerationOptions(max_tokens=500, max_context=60, clamp_max_tokens=True)
    steps = list(stream_generate(pair, prompt_ids(50), options=options))
    generated = steps[-1].generation_tokens
    finish = steps[-1].finish_reason
    # the tiny model may stop early; it never writes past the context
    assert generated <= 10 and (finish == "stop" or generated == 10)
    with pytest.raises(ContextLengthError):  # the same numbers, chosen by the caller: refused
        list(stream_generate(pair, prompt_ids(50), options=dataclasses.replace(options, clamp_max_tokens=False)))


def test_max_context_overrides_the_models_and_is_validated():
    with pytest.raises(ContextLengthError, match=r"over the context of 32 tokens \(max_context"):
        mlx_dspark.api.fit_max_tokens(30, GenerationOptions(max_tokens=8, max_context=32), 32, "max_context")
    for bad in (0, 1, -5, 2.5, "4096", True):
        with pytest.raises(OptionError, match="max_context"):
            GenerationOptions(max_context=bad)
    assert GenerationOptions(max_context=8192).max_context == 8192


def test_without_a_known_context_nothing_is_checked():
    assert mlx_dspark.api.fit_max_tokens(10**6, GenerationOptions(max_tokens=10**6), None) == 10**6


# -- cancellation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plain"])
def test_a_cancel_set_during_the_prefill_stops_it_before_the_next_chunk(pair, speculative):
    cancel = threading.Event()
    model, target = counted(pair, lambda calls: cancel.set() if calls == 5 else None)
    prompt = prompt_ids(400)  # 50 chunks of 8
    with pytest.raises(GenerationCancelled, match="after 40 of 400 prompt tokens"):
        list(stream_generate(model, prompt, max_tokens=4, prefill_step_size=8, cancel=cancel, speculative=speculative))
    assert target.calls == 5  # the chunk in flight finished; no other started


def test_a_cancel_between_rounds_stops_before_the_next_forward(pair):
    cancel = threading.Event()
    model, target = counted(pair)
    steps = stream_generate(model, prompt_ids(20), max_tokens=50, cancel=cancel, stop_token_ids=())
    for _ in range(3):
        next(steps)
    calls = target.calls
    cancel.set()
    with pytest.raises(GenerationCancelled, match="between rounds"):
        next(steps)
    assert target.calls == calls


def test_a_cancelled_prefill_leaves_a_prompt_cache_that_serves_the_next_generation_exactly(pair):
    cancel = threading.Event()
    model, _ = counted(pair, lambda calls: cancel.set() if calls == 2 else None)
    cache = mlx_dspark.make_prompt_cache(model)
    with pytest.raises(GenerationCancelled):
        mlx_dspark.generate(model, prompt_ids(100), max_tokens=4, prefill_step_size=8, cancel=cancel, prompt_cache=cache)
    again = mlx_dspark.generate(model, prompt_ids(100), max_tokens=8, prompt_cache=cache)
    assert again.tokens == mlx_dspark.generate(pair, prompt_ids(100), max_tokens=8).tokens


def test_the_prefill_step_size_does_not_change_the_output(pair):
    ref = mlx_dspark.generate(pair, prompt_ids(100), max_tokens=8)
    assert mlx_dspark.generate(pair, prompt_ids(100), max_tokens=8, prefill_step_size=7).tokens == ref.tokens
    with pytest.raises(OptionError, match="prefill_step_size"):
        GenerationOptions(prefill_step_size=0)


# -- text that is not text ------------------------------------------------------------------------------


def test_a_lone_surrogate_in_the_prompt_is_a_clear_value_error(pair):
    with pytest.raises(ValueError, match="unpaired surrogate"):
        mlx_dspark.generate(pair, "hi \ud800 there", max_tokens=2)
    with pytest.raises(ValueError, match="chat message 0 holds an unpaired surrogate"):
        mlx_dspark.generate(pair, [{"role": "user", "content": "x\udfff"}], max_tokens=2)
