"""The reference tiny checkpoints in ../shared/fixtures (written by transformers / DeepSpec) load and convert."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import qwen3 as mlx_lm_qwen3
from mlx_lm.models import spark2_5 as mlx_lm_spark2_5
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

from mlx_dspark.loading.convert import convert
from mlx_dspark.loading.load import load

PROMPT = mx.array([[5, 17, 42, 99, 200, 7, 11, 150, 3, 64, 128, 250, 31, 8, 90, 101, 77, 12, 140, 19, 23]])
DRAFTS = ["draft", "draft-gated", "draft-rnn"]


def _quiet(_: str) -> None:
    pass


def _logits(model) -> np.ndarray:
    return np.array(model(PROMPT)[0])


def _params(model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_spark_tiny_target_loads_with_its_tokenizer(shared_fixtures):
    path = shared_fixtures / "spark-tiny" / "target"
    loaded = load(path)
    assert isinstance(loaded.target, mlx_lm_spark2_5.Model)  # mlx-lm's class
    logits = _logits(loaded.target)
    assert logits.shape == (1, PROMPT.shape[1], 272) and np.isfinite(logits).all()
    assert loaded.tokenizer.eos_token_ids == {1}
    text = "Hello, Spark!"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text, add_special_tokens=False)) == text
    # the tied embedding is the file's tensor
    stored = load_file(str(path / "model.safetensors"))["model.embedding.weight"]
    np.testing.assert_array_equal(np.array(loaded.target.model.embedding.weight), stored)


def test_deepspec_tiny_target_loads_with_generation_config_eos_ids(shared_fixtures):
    loaded = load(shared_fixtures / "deepspec-tiny" / "target")
    assert isinstance(loaded.target, mlx_lm_qwen3.Model)
    assert loaded.tokenizer.eos_token_ids == {258, 256}
    assert np.isfinite(_logits(loaded.target)).all()


@pytest.mark.parametrize("name", DRAFTS)
def test_deepspec_drafts_load_with_their_target_and_keep_the_file_values(shared_fixtures, name):
    root = shared_fixtures / "deepspec-tiny"
    loaded = load(root / "target", root / name)
    stored = load_file(str(root / name / "model.safetensors"))
    params = _params(loaded.draft)
    assert set(stored) - set(params) == {"embed_tokens.weight", "lm_head.weight"}  # shared, dropped
    for key, value in params.items():
        np.testing.assert_array_equal(value, stored[key], err_msg=key)


@pytest.mark.parametrize("name", DRAFTS)
def test_deepspec_drafts_convert_and_load_identically(shared_fixtures, tmp_path, name):
    root = shared_fixtures / "deepspec-tiny"
    target = convert(root / "target", tmp_path / "t", log=_quiet)
    draft = convert(root / name, tmp_path / "d", log=_quiet)
    direct, converted = load(root / "target", root / name), load(target, draft)
    np.testing.assert_array_equal(_logits(converted.target), _logits(direct.target))
    a, b = _params(converted.draft), _params(direct.draft)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_spark_tiny_target_converts_quantized_and_stays_close(shared_fixtures, tmp_path):
    path = shared_fixtures / "spark-tiny" / "target"
    out = convert(path, tmp_path / "q", quantize=True, q_bits=8, q_group_size=32, log=_quiet)
    full, quant = _logits(load(path).target), _logits(load(out).target)
    assert np.abs(full - quant).max() < 0.1 * np.abs(full).max()
    assert (full.argmax(-1) == quant.argmax(-1)).mean() >= 0.9


def test_deepspec_pair_proposes_a_block_after_loading(shared_fixtures):
    root = shared_fixtures / "deepspec-tiny"
    pair = load(root / "target", root / "draft-rnn")
    taps = tuple(pair.draft_config["target_layer_ids"])
    logits, features = pair.target(PROMPT, tap_ids=taps)
    ctx = pair.draft.make_cache()
    pair.draft.append_context(features, ctx)
    anchor = mx.argmax(logits[:, -1], axis=-1)
    proposal = pair.draft.propose(anchor, ctx, target=pair.target, greedy=True)
    assert proposal.tokens.shape == (1, pair.draft_config["block_size"])
    assert proposal.confidence is not None
