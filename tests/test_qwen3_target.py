"""qwen3: the target is mlx-lm's own class (taps, heads, refusals), and qwen3-style draft layer args."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen3 as mlx_lm_qwen3

from mlx_dspark.models.layers import qwen3
from mlx_dspark.models.target.mlx_lm import from_config, probe_target

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


def random_target(config: dict, *, seed: int = 0):
    """mlx-lm's qwen3 as `load` builds it, with random weights (norm weights around 1)."""
    model = from_config(config)
    rng = np.random.default_rng(seed)
    weights = []
    for name, param in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            value = 1.0 + 0.2 * rng.standard_normal(param.shape)
        elif "embed_tokens" in name or "lm_head" in name:
            value = 0.5 * rng.standard_normal(param.shape)
        else:
            value = rng.standard_normal(param.shape) / math.sqrt(param.shape[-1])
        weights.append((name, mx.array(value.astype(np.float32))))
    model.update(tree_unflatten(weights))
    mx.eval(model.parameters())
    probe_target(model)
    return model


def random_ids(n: int, vocab: int, *, seed: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, vocab, size=(1, n)), dtype=mx.int32)


def test_the_target_is_mlx_lms_own_model_and_gives_its_logits():
    model = random_target(tiny_config())
    assert isinstance(model, mlx_lm_qwen3.Model)
    ids = random_ids(20, 67)
    bare = mlx_lm_qwen3.Model(mlx_lm_qwen3.ModelArgs.from_dict(tiny_config()))
    bare.update(model.parameters())
    np.testing.assert_array_equal(np.array(model(ids)[0]), np.array(bare(ids)))


def test_tapped_features_are_the_layer_outputs_run_by_hand():
    model = random_target(tiny_config())
    ids = random_ids(20, 67)
    _, features = model(ids, tap_ids=(1, -1))
    mask = "causal"
    h0 = model.embed(ids)
    h1 = model.layers[0](h0, mask, None)
    h2 = model.layers[1](h1, mask, None)
    np.testing.assert_allclose(np.array(features), np.array(mx.concatenate([h2, h0], axis=-1)), atol=1e-6)


@pytest.mark.parametrize("bad", [-3, 3])
def test_tap_ids_out_of_range_are_refused(bad):
    model = random_target(tiny_config())
    with pytest.raises(ValueError, match="tap ids"):
        model(random_ids(3, 67), tap_ids=(bad,))


def test_last_only_and_lm_head_logits_agree_with_full_logits():
    model = random_target(tiny_config(tie_word_embeddings=True))
    ids = random_ids(9, 67)
    full, _ = model(ids)
    last, _ = model(ids, last_only=True)
    np.testing.assert_allclose(np.array(last[:, 0]), np.array(full[:, -1]), atol=1e-6)
    _, final = model(ids, tap_ids=(-2,))  # -2: the final normed hidden state
    np.testing.assert_allclose(np.array(model.lm_head_logits(final)), np.array(full), atol=1e-5)


def test_a_sliding_window_qwen3_target_is_refused_not_run_without_its_window():
    config = tiny_config(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"] * 3)
    with pytest.raises(ValueError, match=r"cfg.json: use_sliding_window True: mlx-lm's qwen3 model has no sliding-window layers"):
        from_config(config, source="cfg.json")


# --- qwen3-style draft layers: their args (models/layers/qwen3.py) ---


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
def test_bad_draft_layer_config_is_refused_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        qwen3.ModelArgs.from_dict(tiny_config(**overrides))


def test_draft_layers_are_sliding_only_with_use_sliding_window():
    types = ["sliding_attention", "sliding_attention", "full_attention"]
    off = qwen3.ModelArgs.from_dict(tiny_config(layer_types=types, sliding_window=4, use_sliding_window=False))
    assert off.effective_layer_types() == ["full_attention"] * 3
    # Without the field (never so in a config transformers wrote; so in a spark2_5 config copied into a
    # qwen3-style draft) an explicit layer_types decides, as DSPARK.md section 3 reads it.
    absent = qwen3.ModelArgs.from_dict(tiny_config(layer_types=types, sliding_window=4))
    assert absent.effective_layer_types() == types and absent.window == 4
    assert qwen3.ModelArgs.from_dict(tiny_config(sliding_window=4)).effective_layer_types() == ["full_attention"] * 3
    on = qwen3.ModelArgs.from_dict(tiny_config(layer_types=types, sliding_window=4, use_sliding_window=True))
    assert on.effective_layer_types() == types
    # transformers' default when layer_types is absent: sliding from max_window_layers on
    derived = qwen3.ModelArgs.from_dict(tiny_config(sliding_window=4, use_sliding_window=True, max_window_layers=1))
    assert derived.effective_layer_types() == ["full_attention", "sliding_attention", "sliding_attention"]


def test_shared_fixture_loads_and_gives_mlx_lms_logits():
    target = SHARED / "fixtures" / "deepspec-tiny" / "target"
    if not target.is_dir():
        pytest.skip(f"shared fixture {target} is absent")
    import mlx_dspark
    from mlx_lm.utils import load_model

    loaded = mlx_dspark.load(target).target
    bare, _ = load_model(target)
    ids = random_ids(24, loaded.args.vocab_size)
    np.testing.assert_array_equal(np.array(loaded(ids)[0]), np.array(bare(ids)))
