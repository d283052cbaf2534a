"""logprobs: taken from the verify pass, equal to plain decoding's and to the target's own log-softmax."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.engine.logits.constraints import Constraint


@pytest.fixture(scope="module")
def pair(tiny_qwen3_pair):
    target, draft = tiny_qwen3_pair
    return mlx_dspark.load(str(target), draft=str(draft))


def _same(a, b, tol=1e-5):
    assert [x.token for x in a] == [x.token for x in b]
    for x, y in zip(a, b):
        assert abs(x.logprob - y.logprob) <= tol
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert all(abs(u - v) <= tol for (_, u), (_, v) in zip(x.top, y.top))


@pytest.mark.parametrize("prompt", ["Hello", "for i in range(10):"])
def test_logprobs_equal_plain_and_the_targets_own_log_softmax(pair, prompt):
    spec = mlx_dspark.generate(pair, prompt, max_tokens=24, logprobs=5)
    plain = mlx_dspark.generate(pair, prompt, max_tokens=24, logprobs=5, speculative=False)
    assert spec.rounds > 0 and spec.tokens == plain.tokens
    assert len(spec.logprobs) == len(spec.tokens)
    _same(spec.logprobs, plain.logprobs)
    # the target's own forward over the whole sequence, one log-softmax per position
    prompt_ids = pair.tokenizer.encode(prompt)
    sequence = mx.array([prompt_ids + spec.tokens], dtype=mx.int32)
    logits, _ = pair.target(sequence)
    own = np.array(logits[0].astype(mx.float32))
    own = own - np.log(np.exp(own - own.max(-1, keepdims=True)).sum(-1, keepdims=True)) - own.max(-1, keepdims=True)
    for i, entry in enumerate(spec.logprobs):
        row = own[len(prompt_ids) - 1 + i]
        assert abs(entry.logprob - row[entry.token]) < 1e-4
        assert [t for t, _ in entry.top] == list(np.argsort(-row, kind="stable")[:5])
        assert entry.top[0][1] >= entry.logprob - 1e-6  # greedy: the chosen token is the top one


def test_logprobs_zero_gives_the_chosen_token_only_and_off_gives_none(pair):
    result = mlx_dspark.generate(pair, "Hello", max_tokens=8, logprobs=0)
    assert all(entry.top == [] for entry in result.logprobs)
    assert mlx_dspark.generate(pair, "Hello", max_tokens=8).logprobs is None
    with pytest.raises(mlx_dspark.OptionError, match="logprobs"):
        mlx_dspark.GenerationOptions(logprobs=21)


def test_logprobs_under_penalties_and_a_constraint_equal_plain(pair):
    knobs = dict(logprobs=3, presence_penalty=1.0, repetition_penalty=1.3, constraint=Constraint.regex("[a-z ]{5,40}"))
    spec = mlx_dspark.generate(pair, "Hello", max_tokens=30, **knobs)
    plain = mlx_dspark.generate(pair, "Hello", max_tokens=30, speculative=False, **knobs)
    assert spec.tokens == plain.tokens
    _same(spec.logprobs, plain.logprobs)
    # masked-out tokens never show up as alternatives, and every logprob is finite
    for entry in spec.logprobs:
        assert math.isfinite(entry.logprob)
        for token, _ in entry.top:
            text = pair.tokenizer.decode([token])
            assert token in pair.tokenizer.eos_token_ids or all(c in "abcdefghijklmnopqrstuvwxyz " for c in text)


def test_stream_steps_carry_one_logprob_per_token(pair):
    steps = list(mlx_dspark.stream_generate(pair, "Hello", max_tokens=12, logprobs=1))
    for step in steps:
        assert len(step.logprobs) == len(step.tokens)
        assert [e.token for e in step.logprobs] == step.tokens
