"""Qwen3ForCausalLM target against mlx-lm's own qwen3 model on the same random weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen3 as mlx_lm_qwen3
from mlx_lm.models.cache import make_prompt_cache

from mlx_dspark.models import qwen3

SHARED = Path(__file__).resolve().parents[2] / "shared"
TOL = 1e-4


def tiny_config(**overrides) -> dict:
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 67,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }
    config.update(overrides)
    return config


def random_weights(model, *, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = {}
    for name, param in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            value = 1.0 + 0.2 * rng.standard_normal(param.shape)
        elif "embed_tokens" in name or "lm_head" in name:
            value = 0.5 * rng.standard_normal(param.shape)
        else:
            value = rng.standard_normal(param.shape) / math.sqrt(param.shape[-1])
        weights[name] = value.astype(np.float32)
    return weights


def load(model, weights: dict[str, np.ndarray]):
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())
    return model


def pair(config: dict, *, seed: int = 0):
    """Our model and mlx-lm's, holding the same random weights."""
    ours = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = random_weights(ours, seed=seed)
    theirs = mlx_lm_qwen3.Model(mlx_lm_qwen3.ModelArgs.from_dict(config))
    return load(ours, weights), load(theirs, weights), weights


def random_ids(n: int, vocab: int, *, seed: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, vocab, size=(1, n)), dtype=mx.int32)


def assert_close(got: mx.array, want: mx.array, atol: float = TOL):
    want = np.array(want)
    assert np.abs(want).max() > 1.0  # not a comparison of near-zero numbers
    np.testing.assert_allclose(np.array(got), want, atol=atol, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_full_forward_matches_mlx_lm_past_one_cache_step(tied):
    ours, theirs, _ = pair(tiny_config(tie_word_embeddings=tied))
    ids = random_ids(300, 67)  # mlx-lm's KVCache grows in steps of 256
    logits, features = ours(ids)
    assert features is None
    assert_close(logits, theirs(ids))


@pytest.mark.parametrize("tied", [True, False])
def test_token_by_token_decode_matches_mlx_lm(tied):
    ours, theirs, _ = pair(tiny_config(tie_word_embeddings=tied), seed=5)
    ids = random_ids(300, 67, seed=6)
    cache, their_cache = ours.make_cache(), make_prompt_cache(theirs)
    # a prefill chunk, then one token at a time across the 256 boundary
    got, want = [ours(ids[:, :250], cache=cache)[0]], [theirs(ids[:, :250], cache=their_cache)]
    for t in range(250, 300):
        got.append(ours(ids[:, t : t + 1], cache=cache)[0])
        want.append(theirs(ids[:, t : t + 1], cache=their_cache))
        mx.eval(got[-1], want[-1])
    assert_close(mx.concatenate(got, axis=1), mx.concatenate(want, axis=1))
    assert_close(mx.concatenate(got, axis=1), ours(ids)[0])


def test_tapped_features_are_the_layer_outputs_run_by_hand():
    ours, _, _ = pair(tiny_config())
    ids = random_ids(20, 67)
    _, features = ours(ids, tap_ids=(1, -1))
    h0 = ours.embed(ids)
    h1 = ours.layers[0](h0)
    h2 = ours.layers[1](h1)
    np.testing.assert_allclose(np.array(features), np.array(mx.concatenate([h2, h0], axis=-1)), atol=1e-6)


@pytest.mark.parametrize("bad", [-2, 2])
def test_tap_ids_out_of_range_are_refused(bad):
    ours, _, _ = pair(tiny_config())
    with pytest.raises(ValueError, match="tap ids"):
        ours(random_ids(3, 67), tap_ids=(bad,))


def test_last_only_and_lm_head_logits_agree_with_full_logits():
    ours, _, _ = pair(tiny_config(tie_word_embeddings=True))
    ids = random_ids(9, 67)
    full, _ = ours(ids)
    last, _ = ours(ids, last_only=True)
    np.testing.assert_allclose(np.array(last[:, 0]), np.array(full[:, -1]), atol=1e-6)
    h = ours.embed(ids)
    for layer in ours.layers:
        h = layer(h)
    np.testing.assert_allclose(np.array(ours.lm_head_logits(ours.model.norm(h))), np.array(full), atol=1e-6)


def test_rope_theta_may_come_from_rope_parameters():
    config = tiny_config()
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    assert qwen3.ModelArgs.from_dict(config).rope_theta == 10000.0


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters"),
        ({"rope_theta": None}, "rope_theta"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"use_sliding_window": True, "sliding_window": 4, "layer_types": ["sliding_attention"] * 2}, "layer_types"),
        ({"use_sliding_window": True, "sliding_window": 4, "layer_types": ["sliding_attention", "local", "full_attention"]}, "layer_types"),
    ],
)
def test_bad_config_is_refused_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        qwen3.ModelArgs.from_dict(tiny_config(**overrides))


def test_sliding_layers_only_with_use_sliding_window():
    types = ["sliding_attention", "sliding_attention", "full_attention"]
    off = qwen3.Model(qwen3.ModelArgs.from_dict(tiny_config(layer_types=types, sliding_window=4, use_sliding_window=False)))
    assert off.layer_types == ["full_attention"] * 3
    # Without the field (never so in a config transformers wrote; so in a spark2_5 config copied into a
    # qwen3-style draft) an explicit layer_types decides, as DSPARK.md section 3 reads it.
    absent = qwen3.ModelArgs.from_dict(tiny_config(layer_types=types, sliding_window=4))
    assert absent.effective_layer_types() == types and absent.window == 4
    assert qwen3.ModelArgs.from_dict(tiny_config(sliding_window=4)).effective_layer_types() == ["full_attention"] * 3
    on = qwen3.Model(qwen3.ModelArgs.from_dict(tiny_config(layer_types=types, sliding_window=4, use_sliding_window=True)))
    assert on.layer_types == types
    assert [type(c).__name__ for c in on.make_cache()] == ["SlidingKVCache", "SlidingKVCache", "KVCache"]
    # transformers' default when layer_types is absent: sliding from max_window_layers on
    derived = qwen3.ModelArgs.from_dict(tiny_config(sliding_window=4, use_sliding_window=True, max_window_layers=1))
    assert derived.effective_layer_types() == ["full_attention", "sliding_attention", "sliding_attention"]


def test_sliding_window_limits_what_a_position_sees():
    # Two sliding layers with window 4: position t depends on tokens t-6 .. t only.
    config = tiny_config(
        num_hidden_layers=2, use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"] * 2
    )
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    load(model, random_weights(model))
    ids = random_ids(12, 67)
    changed = mx.array(np.concatenate([[(int(ids[0, 0]) + 1) % 67], np.array(ids[0, 1:])])[None], dtype=mx.int32)
    delta = np.abs(np.array(model(ids)[0] - model(changed)[0])).max(axis=-1)[0]
    assert delta[6] > 1e-3 and delta[7:].max() == 0.0
    # and the cached, chunked path agrees with the full forward
    cache, outs = model.make_cache(), []
    for start, size in [(0, 5), (5, 1), (6, 6)]:
        outs.append(model(ids[:, start : start + size], cache=cache)[0])
    np.testing.assert_allclose(np.array(mx.concatenate(outs, axis=1)), np.array(model(ids)[0]), atol=TOL)


def test_shared_fixture_loads_and_matches_mlx_lm():
    target = SHARED / "fixtures" / "deepspec-tiny" / "target"
    if not target.is_dir():
        pytest.skip(f"shared fixture {target} is absent")
    config = json.loads((target / "config.json").read_text())
    ours = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    theirs = mlx_lm_qwen3.Model(mlx_lm_qwen3.ModelArgs.from_dict(config))
    weights = {k: np.array(v) for k, v in mx.load(str(target / "model.safetensors")).items()}
    load(ours, ours.sanitize(dict(weights)))
    load(theirs, theirs.sanitize(dict(weights)))
    ids = random_ids(30, config["vocab_size"])
    np.testing.assert_allclose(np.array(ours(ids)[0]), np.array(theirs(ids)), atol=TOL)
