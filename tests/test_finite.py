"""Non-finite weights are named at load time and non-finite logits stop generation at the first step."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dspark.api import generate
from mlx_dspark.models.target.finite import NonFiniteError, check_finite_logits, check_finite_weights, nonfinite_parameters
from mlx_dspark.loading.load import load


def poison(module: nn.Module, name: str, value: float, *, index: int = 0) -> None:
    """Put `value` into one element of the parameter `name`."""
    param = dict(tree_flatten(module.parameters()))[name]
    flat = param.reshape(-1)
    flat[index] = value
    module.update(tree_unflatten([(name, flat.reshape(param.shape))]))


def test_finite_weights_pass_and_every_damaged_tensor_is_named(tiny_spark_pair):
    target, draft = tiny_spark_pair
    model = load(target, draft=draft)
    check_finite_weights(model.target, what="target")
    check_finite_weights(model.draft, what="draft")
    assert nonfinite_parameters(model.target) == []

    poison(model.target, "model.layers.2.mlp.up_proj.weight", math.nan, index=17)
    poison(model.target, "model.norm.weight", math.inf)
    assert nonfinite_parameters(model.target) == ["model.layers.2.mlp.up_proj.weight", "model.norm.weight"]
    with pytest.raises(NonFiniteError, match=r"target's weights .* 2 tensor\(s\): model\.layers\.2\.mlp\.up_proj\.weight, model\.norm\.weight"):
        check_finite_weights(model.target, what="target")


def test_quantized_layers_are_checked_through_their_scales_and_biases(tiny_spark_pair):
    target, _ = tiny_spark_pair
    model = load(target, quantize=4)
    check_finite_weights(model.target, what="target")
    scales = [n for n, _ in tree_flatten(model.target.parameters()) if n.endswith(".scales")]
    assert scales, "nothing was quantized"
    poison(model.target, scales[0], -math.inf)
    poison(model.target, scales[0].replace(".scales", ".biases"), math.nan)
    assert nonfinite_parameters(model.target) == [scales[0], scales[0].replace(".scales", ".biases")]


def test_non_finite_logits_stop_generation_at_the_first_step_with_a_clear_error(tiny_spark_pair):
    target, draft = tiny_spark_pair
    model = load(target, draft=draft)
    poison(model.target, "model.layers.0.self_attn.out_proj.weight", math.nan)
    with pytest.raises(NonFiniteError, match="first step"):
        generate(model, "Once upon", max_tokens=4)
    check_finite_logits(mx.array([0.0, -1e30]), step="a step")  # large but finite is fine
    with pytest.raises(NonFiniteError, match="at a step"):
        check_finite_logits(mx.array([0.0, math.inf]), step="a step")


def test_load_names_the_nonfinite_tensor_of_a_target_and_of_a_draft(tmp_path, tiny_spark_pair):
    """load() refuses NaN weights by tensor name, and a NaN in the draft before its shared copies are compared."""
    import shutil

    from mlx_dspark.loading.load import load

    target_dir, draft_dir = tiny_spark_pair
    for role, source in (("target", target_dir), ("draft", draft_dir)):
        broken = tmp_path / role
        shutil.copytree(source, broken)
        weights = mx.load(str(broken / "model.safetensors"))
        name = sorted(k for k in weights if k.endswith("mlp.down_proj.weight"))[0]
        weights[name] = mx.full(weights[name].shape, float("nan"), weights[name].dtype)
        mx.save_safetensors(str(broken / "model.safetensors"), weights)
        with pytest.raises(ValueError, match=f"the {role} .*NaN or Inf.*{name}"):
            if role == "target":
                load(broken)
            else:
                load(target_dir, draft=broken)
