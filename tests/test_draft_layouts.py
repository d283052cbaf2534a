"""Drafts as people publish them: the layer family read from the tensors (either family with either
target), every safetensors packaging, a tap-id override, and the loader fed from memory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.loading.checkpoint import Checkpoint, read_checkpoint
from mlx_dspark.loading.load import build_draft, build_target
from mlx_dspark.models.layers.base import gelu
from mlx_dspark.testing.tiny import write_tiny_draft

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 2, "1 2 3 4 5 6 7 8 9 10"]


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def _proposal(pair, prompt_ids: list[int]):
    """The draft's first proposal after a prefill of `prompt_ids` (tokens, token_probs, confidence)."""
    target, draft = pair.target, pair.draft
    tokens = mx.array([prompt_ids], dtype=mx.int32)
    _, features = target(tokens, tap_ids=tuple(draft.args.target_layer_ids))
    ctx = draft.make_cache()
    draft.append_context(features[:, :-1], ctx)
    proposal = draft.propose(tokens[:, -1], ctx, target=target)
    return [np.array(proposal.tokens), np.array(proposal.token_probs), np.array(proposal.confidence)]


# -- the layer family comes from the draft's tensors ---------------------------------------------------


@pytest.mark.parametrize(
    ("target_family", "layer_family"),
    [("spark2_5", "qwen3"), ("spark2_5", "spark2_5"), ("qwen3", "spark2_5"), ("qwen3", "qwen3")],
)
def test_draft_of_either_layer_family_is_lossless_with_either_target(
    target_family, layer_family, tiny_spark_target, tiny_qwen3_target, tmp_path
):
    target = tiny_spark_target if target_family == "spark2_5" else tiny_qwen3_target
    draft = write_tiny_draft(tmp_path / "draft", target_path=target, layer_family=layer_family, seed=3)
    config = json.loads((draft / "config.json").read_text())
    assert config["model_type"] == target_family  # the config is the target's copy either way
    pair = mlx_dspark.load(target, draft=draft)
    assert pair.draft.args.family == layer_family
    attn = pair.draft.layers[0].self_attn
    assert hasattr(attn, "q_proj" if layer_family == "qwen3" else "q_k_v_proj")
    for prompt in PROMPTS:
        plain = mlx_dspark.generate(pair, prompt, max_tokens=30, speculative=False)
        spec = mlx_dspark.generate(pair, prompt, max_tokens=30)
        assert spec.tokens == plain.tokens and spec.acceptance_lengths


def test_qwen3_style_draft_reads_the_copied_spark_config_as_the_qwen3_family_does(tiny_spark_target, tmp_path):
    # The copy has no use_sliding_window and no rope_theta: layer_types + sliding_window decide the
    # window, rope_parameters keyed by layer type give each layer its RoPE, hidden_act its MLP.
    draft = write_tiny_draft(
        tmp_path / "draft", target_path=tiny_spark_target, layer_family="qwen3",
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    loaded = mlx_dspark.load(tiny_spark_target, draft=draft).draft
    args = loaded.args
    assert [args.layer_window(i) for i in range(2)] == [16, None]
    ropes = [(layer.self_attn.rope.base, layer.self_attn.rope.dims) for layer in loaded.layers]
    assert ropes == [(10000.0, 64), (5000000.0, 16)]
    assert args.layers.hidden_act == "gelu" and loaded.layers[0].mlp.act is gelu  # as transformers reads it
    _edit_config(draft, rope_parameters=None)
    with pytest.raises(ValueError, match=r"config.json: field 'rope_theta' \(or 'rope_parameters.rope_theta'\) is missing"):
        mlx_dspark.load(tiny_spark_target, draft=draft)


def test_draft_whose_family_cannot_be_told_is_refused_naming_its_tensors(tiny_qwen3_target, tmp_path):
    draft = write_tiny_draft(tmp_path / "draft", target_path=tiny_qwen3_target)
    weights = dict(mx.load(str(draft / "model.safetensors")))
    renamed = {k.replace("self_attn.q_proj", "self_attn.query"): v for k, v in weights.items()}
    mx.save_safetensors(str(draft / "model.safetensors"), renamed)
    with pytest.raises(ValueError, match=r"cannot tell the draft's layer family.*found neither.*layers\.0\.self_attn\.query\.weight"):
        mlx_dspark.load(tiny_qwen3_target, draft=draft)


# -- packagings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packaging", ["dflash_config", "model_prefix"])
@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
def test_every_packaging_loads_and_proposes_as_the_deepspec_layout(family, packaging, tiny_spark_target, tiny_qwen3_target, tmp_path):
    target = tiny_spark_target if family == "spark2_5" else tiny_qwen3_target
    reference = mlx_dspark.load(target, draft=write_tiny_draft(tmp_path / "deepspec", target_path=target, seed=5))
    packaged = write_tiny_draft(tmp_path / packaging, target_path=target, seed=5, packaging=packaging)
    config = json.loads((packaged / "config.json").read_text())
    if packaging == "dflash_config":
        assert "target_layer_ids" not in config and "target_layer_ids" in config["dflash_config"]
    else:
        assert all(k.startswith("model.") for k in mx.load(str(packaged / "model.safetensors")))
    pair = mlx_dspark.load(target, draft=packaged)
    prompt = list(range(20, 45))
    for mine, theirs in zip(_proposal(pair, prompt), _proposal(reference, prompt)):
        np.testing.assert_array_equal(mine, theirs)


def test_all_full_attention_draft_without_layer_types_or_window(tiny_qwen3_target, tmp_path):
    reference = write_tiny_draft(tmp_path / "ref", target_path=tiny_qwen3_target, seed=6, layer_types=["full_attention"] * 2)
    bare = tmp_path / "bare"
    shutil.copytree(reference, bare)
    # as a DFlash-style export writes it: no layer_types, no window (transformers' Qwen3Config default)
    _edit_config(bare, layer_types=None, sliding_window=None, use_sliding_window=False, max_window_layers=None)
    a, b = mlx_dspark.load(tiny_qwen3_target, draft=reference), mlx_dspark.load(tiny_qwen3_target, draft=bare)
    assert b.draft.args.layer_types == ["full_attention"] * 2
    assert [c.window for c in b.draft.make_cache()] == [None, None]
    prompt = list(range(30, 70))
    for mine, theirs in zip(_proposal(b, prompt), _proposal(a, prompt)):
        np.testing.assert_array_equal(mine, theirs)


def test_nested_and_top_level_fields_must_agree(tiny_qwen3_target, tmp_path):
    draft = write_tiny_draft(tmp_path / "d", target_path=tiny_qwen3_target, packaging="dflash_config")
    _edit_config(draft, mask_token_id=5)
    with pytest.raises(ValueError, match=r"mask_token_id is 5 but dflash_config.mask_token_id is \d+; they must agree"):
        mlx_dspark.load(tiny_qwen3_target, draft=draft)


def test_unknown_packaging_gets_one_error_listing_missing_and_unexpected_names(tiny_spark_target, tmp_path):
    draft = write_tiny_draft(tmp_path / "d", target_path=tiny_spark_target)
    weights = dict(mx.load(str(draft / "model.safetensors")))
    weights = {k.replace("hidden_norm", "enc_norm").replace("markov_head.", ""): v for k, v in weights.items()}
    mx.save_safetensors(str(draft / "model.safetensors"), weights)
    with pytest.raises(ValueError) as error:
        mlx_dspark.load(tiny_spark_target, draft=draft)
    message = str(error.value)
    assert "missing tensor(s) ['hidden_norm.weight', 'markov_head.markov_w1.weight', 'markov_head.markov_w2.weight']" in message
    assert "unexpected tensor(s) enc_norm.weight (in model.safetensors), markov_w1.weight" in message


# -- tap ids override ------------------------------------------------------------------------------------


def test_draft_tap_ids_replace_the_config_and_are_checked_against_the_target(tiny_qwen3_target, tmp_path):
    draft = write_tiny_draft(tmp_path / "d", target_path=tiny_qwen3_target, target_layer_ids=[0, 2])
    moved = tmp_path / "moved"
    shutil.copytree(draft, moved)
    _edit_config(moved, target_layer_ids=[1, 2])  # as an older converter's +1 convention might leave it
    reference = mlx_dspark.load(tiny_qwen3_target, draft=draft)
    fixed = mlx_dspark.load(tiny_qwen3_target, draft=moved, draft_tap_ids=[0, 2])
    assert fixed.draft.args.target_layer_ids == (0, 2)
    prompt = list(range(40, 60))
    for mine, theirs in zip(_proposal(fixed, prompt), _proposal(reference, prompt)):
        np.testing.assert_array_equal(mine, theirs)
    with pytest.raises(ValueError, match=r"draft_tap_ids \[0, 3\] has \[3\] outside \[-1, 2\]"):
        mlx_dspark.load(tiny_qwen3_target, draft=draft, draft_tap_ids=[0, 3])
    with pytest.raises(ValueError, match=r"draft_tap_ids \[0, 1, 2\] gives 3 tapped layers but fc.weight takes 2 x hidden_size"):
        mlx_dspark.load(tiny_qwen3_target, draft=draft, draft_tap_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="draft_tap_ids only applies with a draft"):
        mlx_dspark.load(tiny_qwen3_target, draft_tap_ids=[0, 2])


# -- building from memory (what a GGUF reader hands over) ------------------------------------------------


def test_target_and_draft_build_from_a_config_and_weights_in_memory(tiny_spark_pair):
    target_dir, draft_dir = tiny_spark_pair
    loaded = mlx_dspark.load(target_dir, draft=draft_dir)
    on_disk = read_checkpoint(target_dir)
    target = build_target(
        Checkpoint(
            config=dict(on_disk.config), weights={k: mx.array(v) for k, v in on_disk.weights.items()},
            origin=dict.fromkeys(on_disk.weights, "target.gguf"), path=Path("target.gguf"), config_source="target.gguf",
        )
    )  # fmt: skip
    tokens = mx.array([list(range(5, 25))])
    np.testing.assert_array_equal(np.array(target(tokens)[0]), np.array(loaded.target(tokens)[0]))
    draft_disk = read_checkpoint(draft_dir)
    weights = {k: mx.array(v) for k, v in draft_disk.weights.items()}
    checkpoint = Checkpoint(
        config=dict(draft_disk.config), weights=weights, origin=dict.fromkeys(weights, "draft.gguf"),
        path=Path("draft.gguf"), config_source="draft.gguf",
    )  # fmt: skip
    draft, shared = build_draft(checkpoint, target=target, target_source="target.gguf")
    assert set(shared) == {"embedding.weight"}
    weights.pop("norm.weight")
    with pytest.raises(ValueError, match=r"draft.gguf: the draft weights do not match draft.gguf: missing tensor\(s\) \['norm.weight'\]"):
        build_draft(checkpoint, target=target)
