"""Caches: SlidingKVCache bookkeeping, bounded memory, and rollback that equals never having decoded."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache

from mlx_dspark.models.cache import SlidingKVCache, make_target_cache, trim_caches
from mlx_dspark.models import qwen3, spark2_5

WINDOW, ROLLBACK = 16, 8


def position_coded(start: int, n: int, generation: int) -> mx.array:
    """Keys whose value is their position plus a tag of which write produced them: (1, 1, n, 2)."""
    pos = np.arange(start, start + n, dtype=np.float32)
    return mx.array(np.stack([pos, np.full(n, generation, np.float32)], axis=-1)[None, None])


def test_sliding_cache_returns_exactly_the_positions_the_new_queries_see():
    rng = np.random.default_rng(0)
    cache = SlidingKVCache(WINDOW, max_rollback=ROLLBACK)
    latest = {}  # position -> generation of the write that is current
    for generation in range(600):
        n = int(rng.integers(1, 9)) if generation % 50 else int(rng.integers(20, 300))
        q_start = cache.offset
        keys = position_coded(q_start, n, generation)
        got_keys, got_values = cache.update_and_fetch(keys, keys * 2)
        for p in range(q_start, q_start + n):
            latest[p] = generation
        first = max(0, q_start - WINDOW + 1)
        got = np.array(got_keys[0, 0])
        np.testing.assert_array_equal(got[:, 0], np.arange(first, cache.offset))
        np.testing.assert_array_equal(got[:, 1], [latest[p] for p in range(first, cache.offset)])
        np.testing.assert_array_equal(np.array(got_values), 2 * np.array(got_keys))
        assert cache.keys.shape[2] <= WINDOW + ROLLBACK + max(n, SlidingKVCache.step)
        # Rolling back within each update (as the loop does) never limits the next rollback.
        assert cache.trimmable() == min(ROLLBACK, cache.offset)
        trim = int(rng.integers(0, min(n, ROLLBACK) + 1))
        assert cache.trim(trim) == trim
    assert cache.offset > 10 * (WINDOW + ROLLBACK + SlidingKVCache.step)


def test_sliding_cache_memory_stays_bounded_over_thousands_of_positions():
    cache = SlidingKVCache(WINDOW, max_rollback=ROLLBACK)
    sizes = set()
    for t in range(5000):
        cache.update_and_fetch(position_coded(t, 1, 0), position_coded(t, 1, 0))
        sizes.add(cache.keys.shape[2])
    per_position = 2 * 2 * 4  # keys + values, 2 float32 each
    assert max(sizes) <= WINDOW + ROLLBACK + SlidingKVCache.step
    assert cache.nbytes <= (WINDOW + ROLLBACK + SlidingKVCache.step) * per_position
    # A big chunk grows the buffer once; the next small update shrinks it back.
    cache.update_and_fetch(position_coded(5000, 1000, 1), position_coded(5000, 1000, 1))
    for t in range(6000, 6000 + 2 * SlidingKVCache.step):
        cache.update_and_fetch(position_coded(t, 1, 0), position_coded(t, 1, 0))
    assert cache.keys.shape[2] <= WINDOW + ROLLBACK + SlidingKVCache.step


def test_sliding_cache_rollback_limits_are_enforced():
    cache = SlidingKVCache(WINDOW, max_rollback=ROLLBACK)
    cache.update_and_fetch(position_coded(0, 1000, 0), position_coded(0, 1000, 0))
    with pytest.raises(ValueError, match="max_rollback"):
        cache.trim(ROLLBACK + 1)
    assert cache.offset == 1000
    cache.trim(ROLLBACK)
    # Rolling back 8 again after a one-position update would lose keys inside the window.
    for t in range(cache.offset, cache.offset + 400):  # make sure the buffer has been compacted
        cache.update_and_fetch(position_coded(t, 1, 0), position_coded(t, 1, 0))
    while cache.trimmable() == ROLLBACK:
        cache.trim(ROLLBACK)
        cache.update_and_fetch(position_coded(cache.offset, 1, 0), position_coded(cache.offset, 1, 0))
    offset = cache.offset
    with pytest.raises(ValueError, match="window"):
        cache.trim(ROLLBACK)
    assert cache.offset == offset
    with pytest.raises(ValueError):
        cache.trim(-1)


def test_sliding_cache_before_wrapping_trims_like_a_plain_cache():
    cache = SlidingKVCache(WINDOW, max_rollback=ROLLBACK)
    cache.update_and_fetch(position_coded(0, 5, 0), position_coded(0, 5, 0))
    assert cache.trim(ROLLBACK) == 5  # clamped to what it holds, as mlx-lm's KVCache
    assert cache.offset == 0 and cache.is_trimmable()


def test_trim_caches_is_all_or_nothing():
    caches = make_target_cache(["full_attention", "sliding_attention"], window=WINDOW)
    assert isinstance(caches[0], KVCache) and isinstance(caches[1], SlidingKVCache)
    for c in caches:
        c.update_and_fetch(position_coded(0, 3, 0), position_coded(0, 3, 0))
    with pytest.raises(ValueError, match="cannot roll back 4"):
        trim_caches(caches, 4)
    assert [c.offset for c in caches] == [3, 3]
    assert trim_caches(caches, 2) == 2
    assert [c.offset for c in caches] == [1, 1]


def test_make_target_cache_refuses_unknown_layer_types():
    with pytest.raises(ValueError, match="chunked"):
        make_target_cache(["chunked_attention"], window=4)
    with pytest.raises(ValueError, match="sliding_window"):
        make_target_cache(["sliding_attention"], window=None)


# --- rollback through a model, long after the sliding caches dropped old positions ---


def spark_model() -> spark2_5.Model:
    config = {
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 53, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_theta": 10000.0},
            "full_attention": {"rope_theta": 1e6, "partial_rotary_factor": 0.5},
        },
    }  # fmt: skip
    return spark2_5.Model(spark2_5.ModelArgs.from_dict(config))


def qwen3_model() -> qwen3.Model:
    config = {
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 53, "rope_theta": 10000.0,
        "use_sliding_window": True, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
    }  # fmt: skip
    return qwen3.Model(qwen3.ModelArgs.from_dict(config))


def randomize(model, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = []
    for name, p in tree_flatten(model.parameters()):
        scale = 0.5 if "embed" in name else 1 / math.sqrt(p.shape[-1])
        value = 1 + 0.2 * rng.standard_normal(p.shape) if name.endswith("norm.weight") else scale * rng.standard_normal(p.shape)
        params.append((name, mx.array(value.astype(np.float32))))
    model.update(tree_unflatten(params))
    return model


@pytest.mark.parametrize("make_model", [spark_model, qwen3_model], ids=["spark2_5", "qwen3"])
def test_random_rollbacks_give_the_logits_of_never_having_decoded_the_trimmed_tokens(make_model):
    model = randomize(make_model())
    vocab = model.args.vocab_size
    rng = np.random.default_rng(1)
    cache = model.make_cache()
    for c in cache:
        if isinstance(c, SlidingKVCache):
            c.step = 32  # compact every few dozen positions, so rollbacks meet many compactions
    tokens: list[int] = []  # committed tokens, positions 0..len-1
    logits_at: dict[int, np.ndarray] = {}  # position -> logits from the cached decode that committed it
    refused = 0
    while len(tokens) < 1500:
        size = int(rng.integers(1, 9)) if rng.random() > 0.02 else 40  # now and then a chunk > window + 8
        chunk = rng.integers(0, vocab, size=size).tolist()
        start = len(tokens)
        logits, _ = model(mx.array([chunk], dtype=mx.int32), cache=cache)
        logits = np.array(logits[0])
        tokens += chunk
        for i in range(size):
            logits_at[start + i] = logits[i]
        n = int(rng.integers(1, ROLLBACK + 1)) if rng.random() < 0.5 else 0
        try:
            trim_caches(cache, n)
        except ValueError:  # rolling back past this chunk right after another rollback
            refused += 1
            assert n > size and all(c.offset == len(tokens) for c in cache)
            n = min(n, size)
            trim_caches(cache, n)
        del tokens[len(tokens) - n :]
        assert all(c.offset == len(tokens) for c in cache)
        sliding = [c for c in cache if isinstance(c, SlidingKVCache)]
        assert all(c.keys.shape[2] <= WINDOW + ROLLBACK + 40 for c in sliding)
    # The reference: one uncached forward over the committed tokens only.
    want, _ = model(mx.array([tokens], dtype=mx.int32))
    got = np.stack([logits_at[t] for t in range(len(tokens))])
    np.testing.assert_allclose(got, np.array(want[0]), atol=1e-4, rtol=0)
    assert np.abs(np.array(want)).max() > 1.0
    assert refused < 100
