"""The tiny writer produces the reference layouts (key names, shapes, config fields) and a real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from mlx_dspark.testing.tiny import write_tiny_draft, write_tiny_target
from mlx_dspark.testing.tiny_tokenizer import VOCAB_SIZE, build_tokenizer


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            out.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return out


def _layer0_names(shapes: dict, prefix: str) -> set[str]:
    return {k[len(prefix):] for k in shapes if k.startswith(prefix)}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_spark_target_has_the_reference_key_names_and_config_fields(tiny_spark_target, shared_fixtures):
    ref = shared_fixtures / "spark-tiny" / "target"
    mine, theirs = _shapes(tiny_spark_target), _shapes(ref)
    assert _layer0_names(mine, "model.layers.0.") == _layer0_names(theirs, "model.layers.0.")
    assert {k for k in mine if "layers" not in k} == {k for k in theirs if "layers" not in k}
    config, ref_config = _config(tiny_spark_target), _config(ref)
    assert set(ref_config) - set(config) == set()
    assert config["architectures"] == ["Spark2_5ForCausalLM"] and config["auto_map"] == ref_config["auto_map"]
    assert set(config["layer_types"]) == {"sliding_attention", "full_attention"}
    assert config["hidden_size"] != config["num_attention_heads"] * config["head_dim"]
    assert config["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25


def test_qwen3_target_has_the_reference_key_names_and_config_fields(tiny_qwen3_target, shared_fixtures):
    ref = shared_fixtures / "deepspec-tiny" / "target"
    mine, theirs = _shapes(tiny_qwen3_target), _shapes(ref)
    assert _layer0_names(mine, "model.layers.0.") == _layer0_names(theirs, "model.layers.0.")
    assert {k for k in mine if "layers" not in k} == {k for k in theirs if "layers" not in k}
    assert set(_config(ref)) - set(_config(tiny_qwen3_target)) == set()


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_qwen3_draft_matches_the_deepspec_fixture_layout(tiny_qwen3_target, shared_fixtures, tmp_path, head):
    ref_dir = shared_fixtures / "deepspec-tiny" / {"vanilla": "draft", "gated": "draft-gated", "rnn": "draft-rnn"}[head]
    ref_config = _config(ref_dir)
    draft = write_tiny_draft(
        tmp_path / "draft",
        target_path=tiny_qwen3_target,
        markov_head_type=head,
        confidence_head_with_markov=ref_config["confidence_head_with_markov"],
        layer_types=ref_config["layer_types"],
        sliding_window=ref_config["sliding_window"],
    )
    mine, theirs = _shapes(draft), _shapes(ref_dir)
    assert set(mine) == set(theirs)
    # shapes scale with hidden (128 here, 64 there) and vocab; the Markov/confidence dims relate the same way
    hidden, ref_hidden, rank = 128, 64, 16
    assert theirs.get("markov_head.joint_proj.weight", (3 * rank, 2 * rank + ref_hidden)) == (3 * rank, 2 * rank + ref_hidden)
    assert mine.get("markov_head.joint_proj.weight", (3 * rank, 2 * rank + hidden)) == (3 * rank, 2 * rank + hidden)
    conf_in = hidden + rank if ref_config["confidence_head_with_markov"] else hidden
    assert mine["confidence_head.proj.weight"] == (1, conf_in)
    config = _config(draft)
    dspark_fields = ["block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
                     "enable_confidence_head", "confidence_head_with_markov", "layer_types", "sliding_window",
                     "num_target_layers", "architectures", "model_type"]
    for field in dspark_fields:
        assert field in config, field
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"


def test_spark_draft_uses_spark_layer_names_and_shares_the_tied_embedding(tiny_spark_pair):
    target, draft = tiny_spark_pair
    shapes = _shapes(draft)
    assert "embedding.weight" in shapes and "lm_head.weight" not in shapes
    assert {"self_attn.q_k_v_proj.weight", "self_attn.g_proj.weight", "self_attn.out_proj.weight"} <= _layer0_names(shapes, "layers.0.")
    config = _config(draft)
    assert config["architectures"] == ["Spark2_5DSparkModel"] and config["model_type"] == "spark2_5"
    with safe_open(str(target / "model.safetensors"), "np") as t, safe_open(str(draft / "model.safetensors"), "np") as d:
        np.testing.assert_array_equal(t.get_tensor("model.embedding.weight"), d.get_tensor("embedding.weight"))


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
def test_mask_token_is_a_special_token_inside_the_vocab(family, tiny_spark_pair, tiny_qwen3_pair):
    target, draft = tiny_spark_pair if family == "spark2_5" else tiny_qwen3_pair
    mask = _config(draft)["mask_token_id"]
    assert 0 <= mask < _config(target)["vocab_size"] == VOCAB_SIZE
    tokenizer, specials = build_tokenizer(family)
    assert specials["<|mask|>"] == mask and tokenizer.get_vocab_size() == VOCAB_SIZE


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
def test_tokenizer_loads_with_mlx_lm_and_round_trips_text(family, tiny_spark_target, tiny_qwen3_target):
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
    from mlx_lm.utils import load_tokenizer

    path = tiny_spark_target if family == "spark2_5" else tiny_qwen3_target
    tokenizer = load_tokenizer(path, {"trust_remote_code": False})
    text = "Hello, world! The quick brown fox: 1 + 3 = 4, héllo 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges are in use
    assert isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    marker = "<|Bot|>" if family == "spark2_5" else "<|im_start|>assistant\n"
    assert prompt.endswith(marker)
    eos = _config(path)["eos_token_id"]
    assert eos in tokenizer.eos_token_ids


def test_writer_is_deterministic_and_seed_dependent(tmp_path):
    a = write_tiny_target(tmp_path / "a", family="qwen3", seed=3)
    b = write_tiny_target(tmp_path / "b", family="qwen3", seed=3)
    c = write_tiny_target(tmp_path / "c", family="qwen3", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_sharded_and_bf16_variants_write_an_index_and_bf16_tensors(tmp_path):
    path = write_tiny_target(tmp_path / "t", family="spark2_5", dtype="bfloat16", num_shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (path / "model.safetensors").exists()
    with safe_open(str(path / "model-00001-of-00003.safetensors"), "np") as st:
        assert st.get_slice(next(iter(st.keys()))).get_dtype() == "BF16"


def test_weights_give_non_degenerate_logit_scales(tiny_qwen3_target):
    with safe_open(str(tiny_qwen3_target / "model.safetensors"), "np") as st:
        embed = st.get_tensor("model.embed_tokens.weight")
        norm = st.get_tensor("model.norm.weight")
    assert 0.02 <= embed.std() <= 0.2
    assert abs(norm.mean() - 1.0) < 0.1
