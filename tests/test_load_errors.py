"""Bad checkpoints and bad pairs each fail with a clear message naming the file and the field."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mlx_dspark.loading.convert import convert
from mlx_dspark.loading.load import load
from mlx_dspark.testing.tiny import write_tiny_draft, write_tiny_target


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _edit_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    weights = load_file(str(file))
    edit(weights)
    save_file(weights, str(file), metadata={"format": "pt"})


@pytest.fixture
def qwen3_copy(tiny_qwen3_target, tmp_path) -> Path:
    return _copy(tiny_qwen3_target, tmp_path / "target")


def _raises(exc, *fragments: str):
    return pytest.raises(exc, match=".*".join(re.escape(f) for f in fragments))


# -- directories and files ------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    with _raises(FileNotFoundError, f"target directory {tmp_path / 'nope'} does not exist"):
        load(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with _raises(FileNotFoundError, "is a file; expected a checkpoint directory"):
        load(tmp_path / "f")


def test_missing_config(qwen3_copy):
    (qwen3_copy / "config.json").unlink()
    with _raises(FileNotFoundError, f"{qwen3_copy}: no config.json"):
        load(qwen3_copy)


def test_invalid_config_json(qwen3_copy):
    (qwen3_copy / "config.json").write_text("{not json")
    with _raises(ValueError, f"{qwen3_copy / 'config.json'}: invalid JSON"):
        load(qwen3_copy)


def test_missing_safetensors(qwen3_copy):
    (qwen3_copy / "model.safetensors").unlink()
    with _raises(FileNotFoundError, f"{qwen3_copy}: no *.safetensors weight files"):
        load(qwen3_copy)


@pytest.mark.parametrize("keep", [5, 1000, -100])
def test_truncated_safetensors(qwen3_copy, keep):
    file = qwen3_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with _raises(ValueError, str(file), "truncated"):
        load(qwen3_copy)


def test_corrupt_safetensors_header(qwen3_copy):
    file = qwen3_copy / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:20] = b"\xff" * 12
    file.write_bytes(bytes(data))
    with _raises(ValueError, str(file), "corrupt"):
        load(qwen3_copy)


def test_index_naming_a_missing_shard(tmp_path):
    path = write_tiny_target(tmp_path / "t", family="qwen3", num_shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    with _raises(FileNotFoundError, "model.safetensors.index.json", "model-00002-of-00003.safetensors"):
        load(path)


def test_index_naming_a_tensor_no_shard_holds(tmp_path):
    path = write_tiny_target(tmp_path / "t", family="qwen3", num_shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with _raises(ValueError, "lists tensor(s) ['model.extra.weight'] that are in none of its shards"):
        load(path)


def test_missing_tokenizer(qwen3_copy):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (qwen3_copy / name).unlink()
    with _raises(FileNotFoundError, f"{qwen3_copy}: no tokenizer files"):
        load(qwen3_copy)


def test_hub_repo_that_cannot_be_downloaded(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    with _raises(FileNotFoundError, "target 'no-such-org/no-such-model' is not a local directory", "pass the local directory"):
        load("no-such-org/no-such-model")


# -- config and tensors ---------------------------------------------------------------------------


def test_wrong_architecture(qwen3_copy):
    # an architecture that is not ours goes to mlx-lm's model of the model_type, which must exist
    _edit_config(qwen3_copy, architectures=["NoSuchForCausalLM"], model_type="no_such_family")
    with _raises(ValueError, "config.json: model_type 'no_such_family' is not a model mlx-lm implements"):
        load(qwen3_copy)


def test_tensor_shape_mismatch_names_file_tensor_and_shapes(qwen3_copy):
    _edit_config(qwen3_copy, intermediate_size=192)
    with _raises(ValueError, "model.layers.0.mlp.down_proj.weight in model.safetensors: found (128, 256), expected (128, 192)"):
        load(qwen3_copy)


def test_missing_tensor(qwen3_copy):
    _edit_weights(qwen3_copy, lambda w: w.pop("model.layers.2.self_attn.k_norm.weight"))
    with _raises(ValueError, "missing tensor(s) ['model.layers.2.self_attn.k_norm.weight']"):
        load(qwen3_copy)


def test_unexpected_tensor(qwen3_copy):
    _edit_weights(qwen3_copy, lambda w: w.update({"model.layers.0.self_attn.bogus.weight": np.zeros(3, np.float32)}))
    with _raises(ValueError, "unexpected tensor(s) model.layers.0.self_attn.bogus.weight (in model.safetensors)"):
        load(qwen3_copy)


def test_quantized_weights_without_a_quantization_block(tiny_qwen3_target, tmp_path):
    out = convert(tiny_qwen3_target, tmp_path / "q", quantize=True, log=lambda _: None)
    config = json.loads((out / "config.json").read_text())
    del config["quantization"]
    (out / "config.json").write_text(json.dumps(config))
    with _raises(ValueError, "quantized tensors (*.scales) but config.json has no 'quantization' block"):
        load(out)


def test_quantizing_an_already_quantized_checkpoint(tiny_qwen3_target, tmp_path):
    out = convert(tiny_qwen3_target, tmp_path / "q", quantize=True, log=lambda _: None)
    with _raises(ValueError, "already quantized"):
        load(out, quantize=8)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dtype": "int8"}, "dtype 'int8' is not supported"),
        ({"quantize": 3}, "quantize bits 3 are not supported"),
        ({"quantize": 4, "q_group_size": 48}, "quantization group size 48 is not supported"),
    ],
)
def test_bad_load_options(tiny_qwen3_target, options, message):
    with _raises(ValueError, message):
        load(tiny_qwen3_target, **options)


# -- drafts and pairs ---------------------------------------------------------------------------


def test_draft_passed_as_target(tiny_qwen3_pair):
    _, draft = tiny_qwen3_pair
    with _raises(ValueError, "this is a DSpark / DFlash block draft", "pass it as draft="):
        load(draft)


def test_target_passed_as_draft_is_a_draft_model(tiny_qwen3_target):
    """A causal LM with none of the heads' keys is a draft model (mlx-lm's --draft-model; tests/test_draft_lm.py)."""
    assert list(load(tiny_qwen3_target, tiny_qwen3_target).heads) == ["lm"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": 64}, "hidden_size is 64 but the target"),
        ({"vocab_size": 500}, "vocab_size is 500 but the target"),
        ({"target_layer_ids": [0, 3]}, "target_layer_ids [0, 3] has [3] outside [-1, 2]"),
        ({"num_target_layers": 8}, "num_target_layers is 8 but the target"),
    ],
)
def test_pair_config_mismatch(tiny_qwen3_pair, tmp_path, changes, message):
    target, draft = tiny_qwen3_pair
    bad = _copy(draft, tmp_path / "d")
    _edit_config(bad, **changes)
    with _raises(ValueError, message):
        load(target, bad)


def test_mask_token_outside_the_vocab(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    bad = _copy(draft, tmp_path / "d")
    _edit_config(bad, mask_token_id=384)
    with _raises(ValueError, "mask_token_id 384 is outside the target's vocabulary [0, 384)"):
        load(target, bad)


def test_draft_missing_a_tensor(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    bad = _copy(draft, tmp_path / "d")
    _edit_weights(bad, lambda w: w.pop("markov_head.markov_w2.weight"))
    with _raises(ValueError, str(bad), "missing tensor(s) ['markov_head.markov_w2.weight']"):
        load(target, bad)


@pytest.mark.parametrize("name", ["embed_tokens.weight", "lm_head.weight"])
def test_draft_shared_tensor_differing_from_the_target(tiny_qwen3_pair, tmp_path, name):
    target, draft = tiny_qwen3_pair
    bad = _copy(draft, tmp_path / "d")
    _edit_weights(bad, lambda w: w.update({name: w[name] + 0.01}))
    with _raises(ValueError, f"draft tensor '{name}' differs from the target's"):
        load(target, bad)


def test_draft_shared_tensor_differing_from_a_quantized_target(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    q_target = convert(target, tmp_path / "t", quantize=True, q_bits=8, log=lambda _: None)
    bad = _copy(draft, tmp_path / "d")
    _edit_weights(bad, lambda w: w.update({"embed_tokens.weight": w["embed_tokens.weight"] * 1.5}))
    with _raises(ValueError, "draft tensor 'embed_tokens.weight' differs from the target's"):
        load(q_target, bad)


def test_spark_draft_embedding_of_another_target(tiny_spark_target, tmp_path):
    other = write_tiny_target(tmp_path / "other", family="spark2_5", seed=1)
    draft = write_tiny_draft(tmp_path / "d", target_path=other)
    with _raises(ValueError, "draft tensor 'embedding.weight' differs"):
        load(tiny_spark_target, draft)


def test_converter_reports_a_bad_source_before_writing(qwen3_copy, tmp_path):
    _edit_weights(qwen3_copy, lambda w: w.pop("model.norm.weight"))
    with _raises(ValueError, "missing tensor(s) ['model.norm.weight']"):
        convert(qwen3_copy, tmp_path / "o", log=lambda _: None)
    assert not (tmp_path / "o").exists()
