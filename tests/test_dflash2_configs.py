"""DFlash 2 drafts on configurations the other tests do not name (issue 35): conv kernel and group sizes,
selector rank and top-K at their edges, block sizes, head_dim != hidden / heads, GQA ratios, one and three
layers with sliding ones among them, taps in any order or with the embedding, rms_norm_eps and rope_theta,
attention biases, embedding / output scales, bf16 files. Each loads through `mlx_dspark.load` and proposes what the
independent NumPy restatement (tests/dflash2_reference.py) of the published math proposes; what we cannot
honour is refused in one line naming the field."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.models.heads.dspark.dflash2 import DFlash2Draft
from mlx_dspark.models.target.lm_head import target_head
from mlx_dspark.testing.dflash2_tiny import write_dflash2_draft
from mlx_dspark.testing.tiny import write_tiny_draft
from tests.dflash2_reference import DFlash2Reference

VOCAB = 384  # the tiny qwen3 target's (hidden 128, 4 heads of 32, 2 KV heads, 4 layers)

# name: (DFlash 2 options of write_dflash2_draft, backbone config overrides, layer types, taps, dflash_config extras)
CONFIGS = {
    "kernel1_one_group": (dict(kernel_size=1, group_size=128), {}, None, None, {}),
    "kernel3_group1": (dict(kernel_size=3, group_size=1), {}, None, None, {}),
    "kernel5_over_a_block_of_4": (dict(kernel_size=5), dict(block_size=4), None, None, {}),
    "top_k1_rank1": (dict(top_k=1, rank=1), {}, None, None, {}),
    "top_k_whole_vocab": (dict(top_k=VOCAB), {}, None, None, {}),
    "block2_one_draft": ({}, dict(block_size=2), None, None, {}),
    "head_dim16_one_kv_head": ({}, dict(head_dim=16, num_key_value_heads=1), None, None, {}),
    "head_dim48_no_gqa": ({}, dict(head_dim=48, num_key_value_heads=4), None, None, {}),
    "one_full_layer": ({}, {}, ["full_attention"], None, {}),
    "three_layers_two_sliding": ({}, dict(sliding_window=5), ["sliding_attention", "full_attention", "sliding_attention"], None, {}),
    "eps_and_theta": ({}, dict(rms_norm_eps=0.5, rope_theta=1e6, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}), None, None, {}),
    "taps_reversed": ({}, {}, None, [2, 0], {}),
    "three_taps_with_the_embedding": ({}, {}, None, [-1, 2, 1], {}),
    # z-lab's Qwen3RotaryEmbedding (and mlx-vlm) turn the whole head whatever rope_parameters' factor says
    "partial_rotary_factor_in_rope_parameters": ({}, dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25}), None, None, {}),
    "attention_bias": ({}, dict(attention_bias=True), None, None, {}),
    "all_scales": (dict(output_multiplier=0.6, softcap=15.0), {}, None, None, {"input_embedding_scale": 3.0}),
}


def _write(root, target, name, *, dtype="float32"):
    dflash, overrides, layer_types, taps, extras = CONFIGS[name]
    deepspec = write_tiny_draft(root / "deepspec", target_path=target, seed=3, config_overrides=overrides, layer_types=layer_types,
                                target_layer_ids=taps)  # fmt: skip
    draft_dir = write_dflash2_draft(deepspec, root / "dflash2", seed=4, dtype=dtype, **dflash)
    if overrides.get("attention_bias"):  # z-lab's attention reads config.attention_bias: q/k/v/o biases
        _add_attention_biases(draft_dir)
    if extras:
        config = json.loads((draft_dir / "config.json").read_text())
        config["dflash_config"].update(extras)
        (draft_dir / "config.json").write_text(json.dumps(config))
    return draft_dir


def _add_attention_biases(draft_dir) -> None:
    weights = dict(mx.load(str(draft_dir / "model.safetensors")))
    rng = np.random.default_rng(7)
    for name in [n for n in weights if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))]:
        weights[name.replace(".weight", ".bias")] = mx.array(0.5 * rng.standard_normal(weights[name].shape[0]).astype(np.float32))
    mx.save_safetensors(str(draft_dir / "model.safetensors"), weights, metadata={"format": "pt"})


def _reference(draft_dir) -> DFlash2Reference:
    config = json.loads((draft_dir / "config.json").read_text())
    weights = {}
    for f in sorted(draft_dir.glob("*.safetensors")):
        weights.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()})  # bf16 through MLX
    return DFlash2Reference({**config, **config["dflash_config"]}, weights)


def _check_proposals(pair, reference):
    draft = pair.draft
    assert isinstance(draft, DFlash2Draft) and draft.args.packaging.first_draft_row == 1
    embedding, lm_head = np.array(pair.target.embedding.weight), np.array(target_head(pair.target).weight)
    width = len(draft.args.target_layer_ids) * pair.target.args.hidden_size
    features = np.random.default_rng(0).standard_normal((1, 11, width)).astype(np.float32)
    ctx = draft.make_cache()
    draft.append_context(mx.array(features), ctx)
    for anchor in (17, 250):
        out = draft.propose(mx.array([anchor]), ctx, target=pair.target)
        want = reference.select(features[0], anchor, embedding=embedding, lm_head=lm_head, n=draft.num_drafts)
        assert out.tokens[0].tolist() == want["tokens"]
        q = np.exp(want["scores"][0] - want["scores"][0].max())
        np.testing.assert_allclose(float(out.token_probs[0, 0]), (q / q.sum()).max(), rtol=1e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_proposals_are_the_references_on_config(name, tiny_qwen3_target, tmp_path):
    draft_dir = _write(tmp_path, tiny_qwen3_target, name)
    pair = mlx_dspark.load(str(tiny_qwen3_target), draft=str(draft_dir), dtype="float32")
    _check_proposals(pair, _reference(draft_dir))


def test_a_bf16_draft_file_proposes_as_the_reference_on_its_stored_values(tiny_qwen3_target, tmp_path):
    draft_dir = _write(tmp_path, tiny_qwen3_target, "kernel3_group1", dtype="bfloat16")
    pair = mlx_dspark.load(str(tiny_qwen3_target), draft=str(draft_dir), dtype="float32")
    assert pair.draft.candidate_selector.successor_codebook.dtype == mx.float32
    _check_proposals(pair, _reference(draft_dir))


@pytest.fixture(scope="module")
def plain_dflash2(tiny_qwen3_target, tmp_path_factory):
    return _write(tmp_path_factory.mktemp("dflash2-plain"), tiny_qwen3_target, "one_full_layer")


@pytest.mark.parametrize(
    "where,updates,message",
    [
        ("dflash_config", dict(sample_from_anchor=True), "field 'sample_from_anchor' is true but a DFlash2 draft drafts from block row 1"),
        ("top", dict(draft_vocab_size=100), "field 'draft_vocab_size' is 100 but a DFlash2 draft's selector reads the target's whole LM head"),
        ("top", dict(markov_rank=4, markov_head_type="vanilla"), "markov_rank > 0 on a DFlash2 draft"),
        ("top", dict(enable_confidence_head=True, confidence_head_with_markov=False), "enable_confidence_head true on a DFlash2 draft"),
        ("dflash_config", dict(output_multiplier=0), "field 'dflash_config.output_multiplier' must be a finite number > 0, got 0"),
        ("top", dict(selector_top_k=2), "selector_top_k is 2 but dflash_config.selector_top_k is 4; they must agree"),
        ("top", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_parameters has rope_type 'yarn'"),
        ("top", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling has rope_type 'llama3'"),
        ("top", dict(partial_rotary_factor=0.5), "field 'partial_rotary_factor' is 0.5 on a z-lab DFlash draft"),
        ("top", dict(is_causal=True), "field 'is_causal' is True: the draft's block would attend causally"),
        ("dflash_config", dict(causal=True), "field 'dflash_config.causal' is True: the draft's block would attend causally"),
        ("dflash_config", dict(attention_sink_bias=True), "field 'dflash_config.attention_sink_bias' is True: the draft's attention has learned sink logits"),
    ],
)  # fmt: skip
def test_fields_a_dflash2_draft_cannot_honour_are_refused_by_name(plain_dflash2, tiny_qwen3_target, tmp_path, where, updates, message):
    import shutil

    draft_dir = shutil.copytree(plain_dflash2, tmp_path / "draft")
    config = json.loads((draft_dir / "config.json").read_text())
    (config if where == "top" else config["dflash_config"]).update(updates)
    (draft_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json: " + message.replace("(", r"\(")):
        mlx_dspark.load(str(tiny_qwen3_target), draft=str(draft_dir), dtype="float32")


def test_false_flags_and_an_explicit_false_sample_from_anchor_load(plain_dflash2, tiny_qwen3_target, tmp_path):
    import shutil

    draft_dir = shutil.copytree(plain_dflash2, tmp_path / "draft")
    config = json.loads((draft_dir / "config.json").read_text())
    config.update(is_causal=False, sample_from_anchor=False)
    config["dflash_config"].update(causal=False, attention_sink_bias=False)
    (draft_dir / "config.json").write_text(json.dumps(config))
    pair = mlx_dspark.load(str(tiny_qwen3_target), draft=str(draft_dir), dtype="float32")
    _check_proposals(pair, _reference(draft_dir))


def test_a_reduced_draft_vocabulary_is_refused_for_a_dflash2_draft(plain_dflash2, tiny_qwen3_target):
    with pytest.raises(ValueError, match="a DFlash2 draft's candidate selector reads the target's whole LM head"):
        mlx_dspark.load(str(tiny_qwen3_target), draft=str(plain_dflash2), dtype="float32", draft_vocab=64)


@pytest.mark.parametrize("to", ["gguf", "zlab"])
@pytest.mark.parametrize("name", ["kernel5_over_a_block_of_4", "three_layers_two_sliding", "three_taps_with_the_embedding", "all_scales"])
def test_exports_of_the_configurations_propose_as_the_reference(name, to, tiny_qwen3_target, tmp_path):
    """llama.cpp's GGUF and z-lab's layout, written by `export` and read back, on configurations beyond the
    fixtures': the same proposals as the restatement of the source files."""
    from mlx_dspark.export.write import export_draft

    draft_dir = _write(tmp_path, tiny_qwen3_target, name)
    out = tmp_path / ("d.gguf" if to == "gguf" else "zlab")
    export_draft(str(draft_dir), out, to=to, target=str(tiny_qwen3_target))
    _check_proposals(mlx_dspark.load(str(tiny_qwen3_target), draft=str(out), dtype="float32"), _reference(draft_dir))


def test_default_taps_read_num_target_layers_under_dflash_config_too(plain_dflash2, tiny_qwen3_target, tmp_path):
    """z-lab's default taps (no target_layer_ids) from a `num_target_layers` given under dflash_config, as
    mlx-vlm reads it: one per draft layer, the middle target layer for a one-layer draft."""
    import shutil

    draft_dir = shutil.copytree(plain_dflash2, tmp_path / "draft")
    config = json.loads((draft_dir / "config.json").read_text())
    config["dflash_config"]["num_target_layers"] = config.pop("num_target_layers")
    del config["dflash_config"]["target_layer_ids"]
    weights = dict(mx.load(str(draft_dir / "model.safetensors")))
    weights["fc.weight"] = weights["fc.weight"][:, :128]  # one tap: the one-layer draft's
    mx.save_safetensors(str(draft_dir / "model.safetensors"), weights, metadata={"format": "pt"})
    (draft_dir / "config.json").write_text(json.dumps(config))
    pair = mlx_dspark.load(str(tiny_qwen3_target), draft=str(draft_dir), dtype="float32")
    assert pair.draft.args.target_layer_ids == (2,)


def test_a_target_with_tied_embeddings_gives_the_selector_its_embedding_as_the_head(tmp_path):
    """The selector's unary logits come from the target's LM head; a tied target's is its embedding (the
    restatement is given the embedding matrix itself as the head)."""
    from mlx_dspark.testing.tiny import write_tiny_target

    target = write_tiny_target(tmp_path / "target", family="qwen3", seed=0, tie_word_embeddings=True)
    deepspec = write_tiny_draft(tmp_path / "deepspec", target_path=target, seed=3)
    draft_dir = write_dflash2_draft(deepspec, tmp_path / "dflash2", seed=4)
    pair = mlx_dspark.load(str(target), draft=str(draft_dir), dtype="float32")
    embedding = np.array(pair.target.embedding.weight)
    reference, draft = _reference(draft_dir), pair.draft
    features = np.random.default_rng(0).standard_normal((1, 9, len(draft.args.target_layer_ids) * 128)).astype(np.float32)
    ctx = draft.make_cache()
    draft.append_context(mx.array(features), ctx)
    out = draft.propose(mx.array([17]), ctx, target=pair.target)
    assert out.tokens[0].tolist() == reference.select(features[0], 17, embedding=embedding, lm_head=embedding, n=draft.num_drafts)["tokens"]
