"""load(): both families from HF directories (f32, bf16, sharded), dtype casts, pairs and tokenizers."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dspark import load as package_load
from mlx_dspark.loading.load import LoadedModel, load
from mlx_dspark.testing.tiny import write_tiny_target

PROMPT = mx.array([[5, 17, 42, 99, 300, 7, 11, 200, 3, 64, 128, 250, 31, 8, 90, 101, 77, 12, 140, 19, 23]])


def _logits(model, tokens=PROMPT) -> np.ndarray:
    logits, _ = model(tokens)
    return np.array(logits.astype(mx.float32))


def _target(family, spark, qwen3):
    return spark if family == "spark2_5" else qwen3


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
def test_load_hf_target_gives_model_tokenizer_and_config(family, tiny_spark_target, tiny_qwen3_target):
    path = _target(family, tiny_spark_target, tiny_qwen3_target)
    loaded = load(path)
    assert isinstance(loaded, LoadedModel)
    assert loaded.draft is None and loaded.draft_config is None and loaded.draft_path is None
    assert loaded.target_path == path and loaded.target_config["model_type"] == family
    assert isinstance(loaded.target, importlib.import_module(f"mlx_lm.models.{family}").Model)  # mlx-lm's class
    logits = _logits(loaded.target)
    assert logits.shape == (1, PROMPT.shape[1], loaded.target_config["vocab_size"])
    assert np.isfinite(logits).all() and logits.std() > 0.1
    text = "Hello, world!"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text, add_special_tokens=False)) == text


def test_package_level_load_keeps_working_after_the_submodule_is_imported(tiny_qwen3_target):
    import mlx_dspark
    import mlx_dspark.loading.load  # noqa: F401  (a submodule import must not rebind the package attribute `load`)

    first, second = package_load(tiny_qwen3_target), mlx_dspark.load(tiny_qwen3_target)
    assert isinstance(second, LoadedModel) and first.target_config == second.target_config


def test_qwen3_eos_ids_include_generation_config_ones(tiny_qwen3_target):
    loaded = load(tiny_qwen3_target)
    tok = loaded.tokenizer
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert loaded.tokenizer.eos_token_ids == {im_end, endoftext}


def test_spark_tokenizer_loads_without_running_or_asking_for_custom_code(tiny_spark_target):
    loaded = load(tiny_spark_target)
    assert "auto_map" in loaded.target_config
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt[0] == loaded.target_config["bos_token_id"]


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_half_precision_hf_directory_loads_as_stored_with_logits_close_to_f32(
    family, stored, tiny_spark_target, tiny_qwen3_target, tmp_path
):
    half = write_tiny_target(tmp_path / stored, family=family, seed=0, dtype=stored)
    loaded = load(half)
    dtypes = {v.dtype for _, v in tree_flatten(loaded.target.parameters())}
    assert dtypes == {getattr(mx, stored)}
    reference = _logits(load(_target(family, tiny_spark_target, tiny_qwen3_target)).target)
    got = _logits(loaded.target)
    assert np.abs(got - reference).max() < 0.1 * np.abs(reference).max()
    assert (got.argmax(-1) == reference.argmax(-1)).mean() > 0.8


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
def test_dtype_cast_on_load_equals_a_bf16_checkpoint(family, tiny_spark_target, tiny_qwen3_target, tmp_path):
    bf16 = write_tiny_target(tmp_path / "bf16", family=family, seed=0, dtype="bfloat16")
    cast = load(_target(family, tiny_spark_target, tiny_qwen3_target), dtype="bfloat16")
    assert {v.dtype for _, v in tree_flatten(cast.target.parameters())} == {mx.bfloat16}
    np.testing.assert_array_equal(_logits(cast.target), _logits(load(bf16).target))


def test_dtype_cast_up_from_bf16_to_float32(tmp_path):
    bf16 = write_tiny_target(tmp_path / "bf16", family="qwen3", seed=0, dtype="bfloat16")
    loaded = load(bf16, dtype=mx.float32)
    assert {v.dtype for _, v in tree_flatten(loaded.target.parameters())} == {mx.float32}


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
def test_sharded_hf_directory_loads_identically(family, tiny_spark_target, tiny_qwen3_target, tmp_path):
    sharded = write_tiny_target(tmp_path / "sharded", family=family, seed=0, num_shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    np.testing.assert_array_equal(
        _logits(load(sharded).target), _logits(load(_target(family, tiny_spark_target, tiny_qwen3_target)).target)
    )


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
def test_pair_loads_with_shared_tensors_dropped_from_the_draft(family, tiny_spark_pair, tiny_qwen3_pair):
    target, draft = tiny_spark_pair if family == "spark2_5" else tiny_qwen3_pair
    loaded = load(target, draft)
    assert loaded.draft_path == draft and loaded.draft_config["target_layer_ids"] == [0, 2]
    names = {k for k, _ in tree_flatten(loaded.draft.parameters())}
    assert not any(k.startswith(("embed_tokens.", "embedding.", "lm_head.")) for k in names)
    assert "fc.weight" in names and "markov_head.markov_w1.weight" in names


def test_pair_loads_from_a_draft_without_shared_copies(tiny_qwen3_target, tmp_path):
    from mlx_dspark.testing.tiny import write_tiny_draft

    draft = write_tiny_draft(tmp_path / "draft", target_path=tiny_qwen3_target, include_shared=False)
    assert load(tiny_qwen3_target, draft).draft is not None


def test_load_time_quantization_keeps_norms_float_and_skips_indivisible_layers(tmp_path):
    # intermediate 192: down_proj's input dim is not a multiple of 128, so it stays float at group 128
    path = write_tiny_target(tmp_path / "t", family="qwen3", intermediate_size=192)
    loaded = load(path, quantize=4, q_group_size=128)
    import mlx.nn as nn

    layer = loaded.target.model.layers[0]
    assert isinstance(layer.mlp.gate_proj, nn.QuantizedLinear) and layer.mlp.gate_proj.group_size == 128
    assert isinstance(layer.mlp.down_proj, nn.Linear) and not isinstance(layer.mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(layer.input_layernorm, nn.RMSNorm) and isinstance(layer.self_attn.q_norm, nn.RMSNorm)
    assert isinstance(loaded.target.model.embed_tokens, nn.QuantizedEmbedding)
