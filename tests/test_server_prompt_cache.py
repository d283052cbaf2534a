"""The server's prompt cache pool: multi-turn chats reuse their caches, the pool stays within its budget.

Over HTTP with the tiny spark pair (as tests/test_server.py), and the pool on its own for eviction.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from mlx_dspark.api import encode_prompt, generate
from mlx_dspark.loading.load import load
from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.engine.prompt_cache import common_prefix
from mlx_dspark.serve.cache_pool import PromptCacheBudget, PromptCachePool, parse_bytes
from tests.test_server import call, pair_loader, running_server, stream

TURN_1 = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me a story about a lighthouse keeper."},
]
QUESTION = {"role": "user", "content": "And then?"}
DEFAULTS = GenerationOptions(max_tokens=24)


def chat(server, messages, **fields):
    status, _, body = call(server, "POST", "/v1/chat/completions", {"messages": messages, **fields})
    assert status == 200, body
    return body


def two_turns(server, **fields) -> tuple[dict, dict]:
    first = chat(server, TURN_1, **fields)
    turn_2 = TURN_1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}, QUESTION]
    return first, chat(server, turn_2, **fields)


@pytest.fixture(scope="module")
def pair(tiny_spark_pair):
    target, draft = tiny_spark_pair
    return load(target, draft=draft)


def test_a_second_turn_reports_cached_tokens_over_the_shared_prefix_and_the_cold_server_s_text(tiny_spark_pair):
    with running_server(pair_loader(tiny_spark_pair), defaults=DEFAULTS) as warm:
        first, second = two_turns(warm)
        tokenizer, model = warm.worker.model.tokenizer, warm.worker.model
        prompt_1 = encode_prompt(tokenizer, TURN_1)
        turn_2 = TURN_1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}, QUESTION]
        prompt_2 = encode_prompt(tokenizer, turn_2)
        history = prompt_1 + generate(model, TURN_1, max_tokens=24).tokens
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        # At least turn 1's prompt (but its last token, which gave turn 1's first logits), at most the shared prefix.
        assert len(prompt_1) - 1 <= cached <= common_prefix(history, prompt_2)
        assert second["usage"]["prompt_tokens"] == len(prompt_2)
    with running_server(pair_loader(tiny_spark_pair), defaults=DEFAULTS, prompt_cache=PromptCacheBudget(0)) as cold:
        cold_first, cold_second = two_turns(cold)
    assert cold_second["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    for reply, cold_reply in ((first, cold_first), (second, cold_second)):
        assert reply["choices"][0]["message"] == cold_reply["choices"][0]["message"]
        # Speculative statistics do not depend on the cache: the draft context is restored exactly too.
        for key in ("speculative", "rounds", "mean_acceptance_length", "accepted_tokens", "proposed_tokens"):
            assert reply["dspark"][key] == cold_reply["dspark"][key], key


def test_streaming_usage_chunk_reports_cached_tokens(tiny_spark_pair):
    with running_server(pair_loader(tiny_spark_pair), defaults=DEFAULTS) as server:
        body = {"messages": TURN_1, "stream_options": {"include_usage": True}}
        events = stream(server, "/v1/chat/completions", body)
        assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        again = stream(server, "/v1/chat/completions", body)  # the same prompt again: all but its last token
        prompt_tokens = again[-2]["usage"]["prompt_tokens"]
        assert again[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": prompt_tokens - 1}
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in again[:-2])
        assert text == "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])


def conversation(i: int) -> list[int]:
    """Distinct token prompts (no shared first token), long enough for the sliding layers to wrap."""
    return [1 + i] + [(7 * i + 3 * k) % 300 + 5 for k in range(40)]


def serve(pool: PromptCachePool, model, prompt: list[int], *, speculative: bool = True):
    cache = pool.checkout(prompt, speculative=speculative)
    result = generate(model, prompt, max_tokens=6, prompt_cache=cache, speculative=speculative)
    pool.checkin(cache)
    return cache, result


def test_the_pool_keeps_at_most_n_conversations_and_forgets_the_least_recently_used(pair):
    pool = PromptCachePool(pair, PromptCacheBudget(conversations=2, nbytes=10**12))
    caches = [serve(pool, pair, conversation(i))[0] for i in range(3)]
    assert len(pool) == 2
    refs = [weakref.ref(c) for c in caches]
    # Conversation 0 was evicted (a cold start), 2 is still warm.
    assert serve(pool, pair, conversation(2))[1].cached_tokens == len(conversation(2)) - 1
    assert serve(pool, pair, conversation(0))[1].cached_tokens == 0
    assert len(pool) == 2
    del caches
    gc.collect()
    assert refs[0]() is None and refs[1]() is None, "evicted caches must be freed"
    assert refs[2]() is not None


def test_the_pool_stays_within_its_byte_budget(pair):
    one = serve(PromptCachePool(pair), pair, conversation(0))[0].nbytes
    assert one > 0
    pool = PromptCachePool(pair, PromptCacheBudget(conversations=8, nbytes=int(2.5 * one)))
    sizes = []
    for i in range(6):
        serve(pool, pair, conversation(i))
        sizes.append((len(pool), pool.nbytes))
        assert pool.nbytes <= pool.budget.nbytes
    assert max(n for n, _ in sizes) == 2  # two fit, a third never does
    tiny = PromptCachePool(pair, PromptCacheBudget(conversations=8, nbytes=one // 2))
    serve(tiny, pair, conversation(0))
    assert len(tiny) == 0  # a conversation larger than the whole budget is not kept


def test_a_request_takes_the_cache_with_the_longest_reuse_and_no_two_requests_share_one(pair):
    pool = PromptCachePool(pair, PromptCacheBudget(conversations=4, nbytes=10**12))
    a, _ = serve(pool, pair, conversation(0))
    b, _ = serve(pool, pair, conversation(1))
    history_b = list(b.tokens)
    assert pool.checkout(history_b + [9, 9], speculative=True) is b
    assert pool.checkout(history_b + [9, 9], speculative=True) is not b  # b is out: a new cache
    # A prompt sharing only a few tokens with a held conversation does not take (and rewind) it.
    short = pool.checkout(list(a.tokens[:3]) + [8] * 30, speculative=True)
    assert short is not a and not short.tokens and a in pool


def test_a_prompt_cache_size_of_zero_turns_reuse_off(pair):
    pool = PromptCachePool(pair, PromptCacheBudget(conversations=0))
    assert pool.checkout(conversation(0), speculative=True) is None
    pool.checkin(None)
    assert len(pool) == 0


def test_a_failed_generation_s_cache_is_not_kept(pair):
    pool = PromptCachePool(pair)
    cache = pool.checkout(conversation(0), speculative=True)
    pool.checkin(cache, reusable=False)
    assert len(pool) == 0


@pytest.mark.parametrize(
    "text, expected",
    [("2GB", 2 * 10**9), ("512MB", 512 * 10**6), ("1.5G", 1_500_000_000), ("64KiB", 65536), ("1000", 1000), ("3 gb", 3 * 10**9)],
)
def test_byte_sizes_parse_with_decimal_and_binary_units(text, expected):
    assert parse_bytes(text) == expected


def test_the_command_line_rejects_bad_prompt_cache_flags():
    from typer.testing import CliRunner

    from mlx_dspark.cli.server import app

    runner = CliRunner()
    result = runner.invoke(app, ["--port", "0", "--prompt-cache-bytes", "lots"])
    assert result.exit_code == 2 and "--prompt-cache-bytes" in result.output and "'lots'" in result.output
    result = runner.invoke(app, ["--port", "0", "--prompt-cache-size", "-1"])
    assert result.exit_code == 2 and "--prompt-cache-size must be >= 0" in result.output

