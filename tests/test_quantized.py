"""Quantized checkpoints: converted 4/8-bit models match mlx-lm's quantized qwen3 and load-time quantization."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_dspark.loading.convert import convert
from mlx_dspark.loading.load import load

PROMPT = mx.array([[5, 17, 42, 99, 300, 7, 11, 200, 3, 64, 128, 250, 31, 8, 90, 101, 77, 12, 140, 19, 23]])


def _quiet(_: str) -> None:
    pass


def _logits(model) -> np.ndarray:
    return np.array(model(PROMPT)[0])


def _mlx_lm_quantized_qwen3(hf_dir, *, bits: int, group_size: int) -> nn.Module:
    from mlx_lm.models import qwen3

    config = json.loads((hf_dir / "config.json").read_text())
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = model.sanitize(mx.load(str(hf_dir / "model.safetensors")))
    model.load_weights(list(weights.items()), strict=True)
    nn.quantize(
        model, group_size, bits,
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0,
    )  # fmt: skip
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_converted_quantized_qwen3_logits_match_mlx_lm(tiny_qwen3_target, tmp_path, bits, group_size):
    out = convert(tiny_qwen3_target, tmp_path / "q", quantize=True, q_bits=bits, q_group_size=group_size, log=_quiet)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": group_size, "bits": bits, "mode": "affine"}
    ours = load(out).target
    layer = ours.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, nn.QuantizedLinear)
    assert (layer.self_attn.o_proj.bits, layer.self_attn.o_proj.group_size) == (bits, group_size)
    reference = _mlx_lm_quantized_qwen3(tiny_qwen3_target, bits=bits, group_size=group_size)
    reference_logits = np.array(reference(PROMPT))
    np.testing.assert_allclose(_logits(ours), reference_logits, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
@pytest.mark.parametrize("bits", [4, 8])
def test_converted_quantized_equals_load_time_quantized(family, tiny_spark_pair, tiny_qwen3_pair, tmp_path, bits):
    target, draft = tiny_spark_pair if family == "spark2_5" else tiny_qwen3_pair
    q_target = convert(target, tmp_path / "t", quantize=True, q_bits=bits, q_group_size=64, log=_quiet)
    q_draft = convert(draft, tmp_path / "d", quantize=True, q_bits=bits, q_group_size=64, log=_quiet)
    converted = load(q_target, q_draft)
    at_load = load(target, draft, quantize=bits, q_group_size=64)
    np.testing.assert_array_equal(_logits(converted.target), _logits(at_load.target))
    assert isinstance(converted.draft.fc, nn.QuantizedLinear)
    from mlx.utils import tree_flatten

    a, b = dict(tree_flatten(converted.draft.parameters())), dict(tree_flatten(at_load.draft.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
def test_8bit_logits_stay_close_to_float(family, tiny_spark_target, tiny_qwen3_target):
    path = tiny_spark_target if family == "spark2_5" else tiny_qwen3_target
    full, quant = _logits(load(path).target), _logits(load(path, quantize=8, q_group_size=32).target)
    assert np.abs(full - quant).max() < 0.05 * np.abs(full).max()
    assert not np.array_equal(full, quant)


def test_quantized_draft_against_a_quantized_target_checks_kept_shared_copies(tiny_qwen3_pair, tmp_path):
    # the target's embedding is stored quantized; the draft's float copy is compared to its dequantization
    target, draft = tiny_qwen3_pair
    q_target = convert(target, tmp_path / "t", quantize=True, q_bits=4, log=_quiet)
    kept = convert(draft, tmp_path / "d", keep_shared=True, log=_quiet)
    assert load(q_target, kept).draft is not None


def test_per_layer_quantization_overrides_in_config_are_honoured(tiny_qwen3_target, tmp_path):
    # mlx-lm writes per-layer entries when layers use different settings: rewrite one layer at 8 bits
    out = convert(tiny_qwen3_target, tmp_path / "q", quantize=True, q_bits=4, q_group_size=64, log=_quiet)
    weights = dict(mx.load(str(out / "model.safetensors")))
    name = "model.layers.1.mlp.up_proj"
    float_weight = mx.dequantize(weights[f"{name}.weight"], weights[f"{name}.scales"], weights[f"{name}.biases"], group_size=64, bits=4)
    weights[f"{name}.weight"], weights[f"{name}.scales"], weights[f"{name}.biases"] = mx.quantize(float_weight, group_size=32, bits=8)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config = json.loads((out / "config.json").read_text())
    config["quantization"][name] = {"group_size": 32, "bits": 8}
    (out / "config.json").write_text(json.dumps(config))
    layer = load(out).target.model.layers[1].mlp
    assert (layer.up_proj.bits, layer.up_proj.group_size) == (8, 32)
    assert (layer.gate_proj.bits, layer.gate_proj.group_size) == (4, 64)


@pytest.mark.parametrize("bits", [4, 8])
def test_spark_target_quantizes_as_mlx_lm_does_keeping_the_gate_in_source_precision(tiny_spark_target, tmp_path, bits):
    """Our converter and load(quantize=) write / build what mlx-lm's own spark2_5 + quantize_model do."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import spark2_5 as mlx_lm_spark
    from mlx_lm.utils import quantize_model

    config = json.loads((tiny_spark_target / "config.json").read_text())
    reference = mlx_lm_spark.Model(mlx_lm_spark.ModelArgs.from_dict(config))
    reference.load_weights(list(reference.sanitize(dict(mx.load(str(tiny_spark_target / "model.safetensors")))).items()), strict=True)
    reference, reference_config = quantize_model(reference, config, 64, bits)
    theirs = dict(tree_flatten(reference.parameters()))
    assert "model.layers.0.self_attn.g_proj.scales" not in theirs  # mlx-lm keeps the gate float

    out = convert(tiny_spark_target, tmp_path / "q", quantize=True, q_bits=bits, q_group_size=64, log=_quiet)
    written = {}
    for file in sorted(out.glob("*.safetensors")):
        written.update(mx.load(str(file)))
    assert written.keys() == theirs.keys()
    for name in theirs:
        np.testing.assert_array_equal(np.array(written[name]), np.array(theirs[name]), err_msg=name)
    assert json.loads((out / "config.json").read_text())["quantization"] == reference_config["quantization"]

    at_load = load(tiny_spark_target, quantize=bits, q_group_size=64).target
    gate = at_load.model.layers[0].self_attn.g_proj
    assert type(gate) is nn.Linear and gate.weight.dtype == mx.float32
    assert isinstance(at_load.model.layers[0].self_attn.q_k_v_proj, nn.QuantizedLinear)
    ours = dict(tree_flatten(at_load.parameters()))
    assert ours.keys() == theirs.keys()
    for name in theirs:
        np.testing.assert_array_equal(np.array(ours[name]), np.array(theirs[name]), err_msg=name)
