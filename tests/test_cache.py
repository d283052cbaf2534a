"""Caches: trim_caches, and rollback through a target that equals never having decoded the trimmed tokens."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache

from mlx_lm.models.cache import RotatingKVCache

from mlx_dspark.models import target_model_class
from mlx_dspark.models.caches.kv import trim_caches
from mlx_dspark.models.target.mlx_lm import from_config

WINDOW, ROLLBACK = 16, 8


def position_coded(start: int, n: int, generation: int) -> mx.array:
    """Keys whose value is their position plus a tag of which write produced them: (1, 1, n, 2)."""
    pos = np.arange(start, start + n, dtype=np.float32)
    return mx.array(np.stack([pos, np.full(n, generation, np.float32)], axis=-1)[None, None])


def test_trim_caches_is_all_or_nothing():
    caches = [KVCache(), KVCache()]
    for c, n in zip(caches, (3, 2)):
        c.update_and_fetch(position_coded(0, n, 0), position_coded(0, n, 0))
    with pytest.raises(ValueError, match="cannot roll back 3"):
        trim_caches(caches, 3)
    assert [c.offset for c in caches] == [3, 2]
    assert trim_caches(caches, 2) == 2
    assert [c.offset for c in caches] == [1, 0]


# --- rollback through a model, long after the sliding caches dropped old positions ---


def spark_model():
    config = {"model_type": "spark2_5",
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 53, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_theta": 10000.0},
            "full_attention": {"rope_theta": 1e6, "partial_rotary_factor": 0.5},
        },
    }  # fmt: skip
    return from_config(config, model_class=target_model_class(config))


def qwen3_model():
    config = {"model_type": "qwen3",
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 53, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }  # fmt: skip
    return from_config(config)


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
    cache = model.make_cache()  # mlx-lm's own: a rotating window on the sliding layer (spark2_5)
    tokens: list[int] = []  # committed tokens, positions 0..len-1
    logits_at: dict[int, np.ndarray] = {}  # position -> logits from the cached decode that committed it
    refused = 0
    while len(tokens) < 600:
        # a verify is 2 or more wide (a wrapped rotating window updates one position in place: no rollback)
        size = int(rng.integers(2, 10)) if rng.random() > 0.02 else 40  # now and then a chunk > window + 8
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
        except ValueError:  # rolling back past the latest forward (a rotating window cannot)
            refused += 1
            assert n > size and all(c.offset == len(tokens) for c in cache)
            n = min(n, size)
            trim_caches(cache, n)
        del tokens[len(tokens) - n :]
        assert all(c.offset == len(tokens) for c in cache)
        sliding = [c for c in cache if isinstance(c, RotatingKVCache)]
        assert all(c.keys.shape[2] <= WINDOW + 40 for c in sliding)
    # The reference: one uncached forward over the committed tokens only.
    want, _ = model(mx.array([tokens], dtype=mx.int32))
    got = np.stack([logits_at[t] for t in range(len(tokens))])
    np.testing.assert_allclose(got, np.array(want[0]), atol=1e-4, rtol=0)
    assert np.abs(np.array(want)).max() > 1.0
    assert refused < 300
