"""Spark2_5ForCausalLM target against an independent NumPy float64 restatement (tests/spark_reference.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dspark.models import target_model_class

from mlx_dspark.models.layers import base
from mlx_dspark.models.target.mlx_lm import from_config, probe_target
from tests import spark_reference

SHARED = Path(__file__).resolve().parents[2] / "shared"
TOL = 1e-4


def tiny_config(**overrides) -> dict:
    config = {
        "architectures": ["Spark2_5ForCausalLM"],
        "model_type": "spark2_5",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,  # heads x head_dim = 96 != hidden_size, as in the real 4B
        "vocab_size": 101,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_theta": 10000.0, "partial_rotary_factor": 1.0},
            "full_attention": {"rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
        },
        "sliding_window": 8,
        "rms_norm_eps": 1e-6,
        "hidden_act": "gelu",
        "gate_attn_act_mode": "sigmoid",
        "headwise_attn_output_gate": True,
        "tie_word_embeddings": True,
    }
    config.update(overrides)
    return config


def build(config: dict):
    """The target as `load` builds it: mlx-lm's spark2_5 class (ours over it: models/target/spark2_5.py)."""
    return from_config(config, model_class=target_model_class(config))


def random_model(config: dict, *, seed: int = 0):
    """A float32 model with random weights (norm weights around 1), and the same weights as numpy."""
    model = build(config)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, param in tree_flatten(model.parameters()):
        shape = param.shape
        if name.endswith("norm.weight"):
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        elif "embedding" in name or "lm_head" in name:
            value = 0.5 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / math.sqrt(shape[-1])
        weights[name] = value.astype(np.float32)
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    mx.eval(model.parameters())
    probe_target(model)
    return model, weights


def random_ids(n: int, vocab: int, *, seed: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, vocab, size=(1, n)), dtype=mx.int32)


def decode_in_chunks(model, ids: mx.array, sizes) -> mx.array:
    cache = model.make_cache()
    outs, start = [], 0
    for size in sizes:
        logits, _ = model(ids[:, start : start + size], cache=cache)
        mx.eval(logits)
        outs.append(logits)
        start += size
    assert start == ids.shape[1]
    return mx.concatenate(outs, axis=1)


# --- shared pieces (models/layers/base.py) ---


@pytest.mark.parametrize("head_dim,factor,theta,offset", [(32, 1.0, 10000.0, 0), (32, 0.25, 5e6, 37), (24, 0.5, 1e6, 5)])
def test_rope_matches_rotate_half_formula_on_first_r_dims(head_dim, factor, theta, offset):
    x = np.random.default_rng(0).standard_normal((1, 2, 9, head_dim)).astype(np.float32)
    r = base.rotary_dims(head_dim, factor)
    got = np.array(base.RoPE(r, base=theta)(mx.array(x), offset))
    positions = np.arange(offset, offset + 9)
    for h in range(2):
        want = spark_reference.rope(x[0, h].astype(np.float64), positions, theta=theta, rotary_dims=r)
        np.testing.assert_allclose(got[0, h], want, atol=2e-5)


def test_gelu_is_the_exact_erf_form():
    x = np.linspace(-6, 6, 101)
    np.testing.assert_allclose(np.array(base.gelu(mx.array(x, dtype=mx.float32))), spark_reference.gelu(x), atol=1e-6)


# --- the model against the NumPy reference ---


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_numpy_reference(tied):
    config = tiny_config(tie_word_embeddings=tied)
    model, weights = random_model(config)
    ids = random_ids(40, config["vocab_size"])  # longer than the window (8)
    logits, _ = model(ids)
    want, _ = spark_reference.forward(config, weights, np.array(ids[0]))
    assert np.abs(want).max() > 1.0  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(np.array(logits[0]), want, atol=TOL, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_token_by_token_and_chunked_prefill_match_full_forward(tied):
    config = tiny_config(tie_word_embeddings=tied)
    model, _ = random_model(config, seed=3)
    ids = random_ids(45, config["vocab_size"], seed=4)
    full, _ = model(ids)
    np.testing.assert_allclose(np.array(decode_in_chunks(model, ids, [1] * 45)), np.array(full), atol=TOL, rtol=0)
    np.testing.assert_allclose(np.array(decode_in_chunks(model, ids, [7, 13, 1, 19, 5])), np.array(full), atol=TOL, rtol=0)


def test_last_only_returns_the_last_position():
    model, _ = random_model(tiny_config())
    ids = random_ids(12, 101)
    full, _ = model(ids)
    last, _ = model(ids, last_only=True)
    assert last.shape == (1, 1, 101)
    np.testing.assert_allclose(np.array(last[:, 0]), np.array(full[:, -1]), atol=1e-6)


def test_tapped_features_are_the_layer_outputs_in_the_order_given():
    config = tiny_config()
    model, weights = random_model(config)
    ids = random_ids(20, config["vocab_size"])
    tap_ids = (2, -1, 0)
    _, features = model(ids, tap_ids=tap_ids)
    _, hidden = spark_reference.forward(config, weights, np.array(ids[0]))
    want = np.concatenate([hidden[s + 1] for s in tap_ids], axis=-1)
    assert features.shape == (1, 20, 3 * config["hidden_size"])
    np.testing.assert_allclose(np.array(features[0]), want, atol=TOL, rtol=0)
    assert model(ids)[1] is None


@pytest.mark.parametrize("bad", [-3, 4, 10])
def test_tap_ids_out_of_range_are_refused(bad):
    model, _ = random_model(tiny_config())
    with pytest.raises(ValueError, match="tap ids"):
        model(random_ids(3, 101), tap_ids=(0, bad))


def test_bfloat16_model_keeps_a_float32_residual_and_stays_close():
    config = tiny_config()
    model, _ = random_model(config)
    ids = random_ids(30, config["vocab_size"])
    want, _ = model(ids)
    model.set_dtype(mx.bfloat16)
    logits, features = model(ids, tap_ids=(0,))
    assert logits.dtype == mx.bfloat16 and features.dtype == mx.bfloat16
    residual = model.layers[0](model.embed(ids).astype(mx.float32), dtype=mx.bfloat16)
    assert residual.dtype == mx.float32
    want = np.array(want)
    assert np.abs(np.array(logits.astype(mx.float32)) - want).max() < 0.05 * np.abs(want).max()


def test_quantized_tied_head_works_through_lm_head_logits():
    config = tiny_config()
    model, _ = random_model(config)
    ids = random_ids(10, config["vocab_size"])
    want, _ = model(ids)
    nn.quantize(model, group_size=32, bits=8)
    assert isinstance(model.model.embedding, nn.QuantizedEmbedding)
    logits, _ = model(ids)
    assert np.abs(np.array(logits) - np.array(want)).max() < 0.5
    h = model.model.norm(model.embed(ids))
    assert model.lm_head_logits(h).shape == (1, 10, config["vocab_size"])


def test_sanitize_drops_tied_head_and_rotary_buffers():
    model, weights = random_model(tiny_config())
    extra = dict(weights)
    extra["lm_head.weight"] = weights["model.embedding.weight"]
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(4)
    assert set(model.sanitize(extra)) == set(weights)


def test_make_cache_gives_rotating_windows_to_sliding_layers():
    model, _ = random_model(tiny_config())
    kinds = [type(c).__name__ for c in model.make_cache()]
    assert kinds == ["RotatingKVCache", "KVCache", "RotatingKVCache", "KVCache"]
    assert model.layer_types == tiny_config()["layer_types"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]}, "Unsupported layer types"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types length"),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e6}}}, "Missing RoPE parameters"),
        ({"gate_attn_act_mode": "silu"}, "sigmoid attention gates"),
        ({"hidden_act": "silu"}, "GELU"),
        ({"rope_parameters": {"sliding_attention": {"rope_theta": 1e4, "rope_type": "yarn"}, "full_attention": {"rope_theta": 1e6}}}, "rope_parameters.sliding_attention"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_parameters": {"sliding_attention": {"rope_theta": 1e4, "partial_rotary_factor": 0.3}, "full_attention": {"rope_theta": 1e6}}}, "rotary dimension"),
    ],
)
def test_bad_config_is_refused_naming_the_file_and_the_problem(overrides, message):
    with pytest.raises(ValueError, match=r"^cfg\.json: .*" + message.replace(".", r"\.")):
        from_config(tiny_config(**overrides), source="cfg.json", model_class=target_model_class(tiny_config()))


def test_missing_field_is_refused_naming_it():
    config = tiny_config()
    del config["head_dim"]
    with pytest.raises(ValueError, match="head_dim"):
        build(config)


def test_shared_fixture_matches_numpy_reference():
    target = SHARED / "fixtures" / "spark-tiny" / "target"
    if not target.is_dir():
        pytest.skip(f"shared fixture {target} is absent")
    config = json.loads((target / "config.json").read_text())
    model = build(config)
    weights = model.sanitize(mx.load(str(target / "model.safetensors")))
    model.load_weights(list(weights.items()), strict=True)
    ids = random_ids(24, config["vocab_size"])
    logits, _ = model(ids)
    want, _ = spark_reference.forward(config, {k: np.array(v) for k, v in weights.items()}, np.array(ids[0]))
    # Its logits reach ~20 (float32 rounding ~1e-4 there), so allow a relative part too.
    np.testing.assert_allclose(np.array(logits[0]), want, atol=TOL, rtol=1e-5)
