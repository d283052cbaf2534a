"""Drafts as their producers publish them (vLLM speculators DSpark / DFlash + Markov / DFlash,
LiquidAI's backbone-only LFM2 heads, z-lab DFlash, and the same as `dflash` GGUFs): each tiny random
checkpoint is written in that layout from a DeepSpec-layout draft, loaded, and must propose exactly
what the equivalent DeepSpec-layout draft (same weights) proposes, and decode losslessly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.testing.draft_layouts import repackage, write_gemma4_draft
from mlx_dspark.testing.gguf_writer import write_gguf_draft
from mlx_dspark.testing.tiny import write_tiny_draft

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


@pytest.fixture(scope="module")
def deepspec(tiny_qwen3_target, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("published")
    return tiny_qwen3_target, write_tiny_draft(root / "deepspec", target_path=tiny_qwen3_target, seed=7)


def _equivalent(source: Path, dst: Path, *, sample_from_anchor: bool = True, heads: bool = True) -> Path:
    """The DeepSpec-layout draft a packaging means: the same weights, DeepSpec's field names."""
    shutil.copytree(source, dst)
    config = json.loads((dst / "config.json").read_text())
    config["sample_from_anchor"] = sample_from_anchor
    if not heads:
        config.update(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)
        config.pop("markov_head_type")
        weights = {k: v for k, v in mx.load(str(dst / "model.safetensors")).items() if not k.startswith(("markov_head.", "confidence_head."))}
        mx.save_safetensors(str(dst / "model.safetensors"), weights)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _proposal(pair, *, anchor: int = 17):
    draft = pair.draft
    width = len(draft.args.target_layer_ids) * pair.target.args.hidden_size
    ctx = draft.make_cache()
    draft.append_context(mx.array(np.random.default_rng(0).standard_normal((1, 20, width)).astype(np.float32)), ctx)
    out = draft.propose(mx.array([anchor]), ctx, target=pair.target)
    return out


def _same(a, b) -> None:
    assert a.tokens.tolist() == b.tokens.tolist()
    np.testing.assert_array_equal(np.array(a.token_probs), np.array(b.token_probs))
    assert (a.confidence is None) == (b.confidence is None)
    if a.confidence is not None:
        np.testing.assert_array_equal(np.array(a.confidence), np.array(b.confidence))


def _lossless(pair) -> None:
    plain = mlx_dspark.generate(pair, PROMPT, max_tokens=40, speculative=False)
    spec = mlx_dspark.generate(pair, PROMPT, max_tokens=40)
    assert spec.tokens == plain.tokens and spec.acceptance_lengths


CASES = {
    # packaging -> (what the DeepSpec-layout equivalent sets, what the loaded draft must be)
    "speculators_dspark": ({}, dict(first_row=0, markov=True)),
    "speculators_dflash_markov": ({"sample_from_anchor": False}, dict(first_row=1, markov=True)),
    "speculators_dflash": ({"sample_from_anchor": False, "heads": False}, dict(first_row=1, markov=False)),
    "lfm2_backbone": ({}, dict(first_row=0, markov=True)),
    "zlab_dflash": ({"sample_from_anchor": False, "heads": False}, dict(first_row=1, markov=False)),
}


@pytest.mark.parametrize("packaging", list(CASES))
def test_published_packaging_proposes_as_the_equivalent_deepspec_draft_and_is_lossless(packaging, deepspec, tmp_path):
    target, source = deepspec
    equivalent, expect = CASES[packaging]
    packaged = repackage(source, tmp_path / packaging, packaging)
    reference = mlx_dspark.load(target, draft=_equivalent(source, tmp_path / "equivalent", **equivalent), dtype="float32")
    pair = mlx_dspark.load(target, draft=packaged, dtype="float32")
    assert pair.draft.args.packaging.first_draft_row == expect["first_row"]
    assert hasattr(pair.draft, "markov_head") is expect["markov"]
    assert pair.draft.num_drafts == 7 - expect["first_row"]
    _same(_proposal(pair), _proposal(reference))
    _lossless(pair)


def test_a_block_draft_without_markov_head_proposes_every_position_from_the_base_logits_of_one_pass(deepspec, tmp_path):
    # z-lab DFlash: [anchor, mask x 6] in one forward; drafts k = 1..6 are argmax of the base logits of
    # rows 1..6 (no sequential head), exactly what the draft's own block forward gives.
    target, source = deepspec
    pair = mlx_dspark.load(target, draft=repackage(source, tmp_path / "zlab", "zlab_dflash"), dtype="float32")
    draft = pair.draft
    width = len(draft.args.target_layer_ids) * pair.target.args.hidden_size
    features = mx.array(np.random.default_rng(0).standard_normal((1, 20, width)).astype(np.float32))
    ctx = draft.make_cache()
    draft.append_context(features, ctx)
    hidden = draft.block_hidden(mx.array([17]), ctx, target=pair.target)
    base = np.array(pair.target.lm_head_logits(hidden))[0]
    assert _proposal(pair).tokens.tolist()[0] == base[1:].argmax(-1).tolist()


@pytest.mark.parametrize("packaging", ["lfm2_backbone", "zlab_dflash"])
def test_the_same_drafts_as_dflash_gguf_propose_as_their_safetensors(packaging, deepspec, tmp_path):
    target, source = deepspec
    equivalent, _ = CASES[packaging]
    hf = repackage(source, tmp_path / packaging, packaging)
    base = _equivalent(source, tmp_path / "equivalent", **equivalent)
    # as upstream's converter writes them: no sample_from_anchor key (a Markov-less file drafts from row 1)
    gguf = write_gguf_draft(base, tmp_path / "draft.gguf", target_path=target, include_shared=False)
    from_gguf = mlx_dspark.load(target, draft=gguf, dtype="float32")
    _same(_proposal(from_gguf), _proposal(mlx_dspark.load(target, draft=hf, dtype="float32")))
    _lossless(from_gguf)


def _edit(path: Path, change) -> None:
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("packaging", "change", "message"),
    [
        # a DFlash2 config with some of its fields: the missing ones named (tests/test_dflash2_draft.py loads whole ones)
        ("zlab_dflash", lambda c: c["dflash_config"].update(selector_rank=64), r"a DFlash2 draft needs dflash_config field\(s\) \['conv_kernel_size', 'conv_group_size', 'selector_top_k'\]"),
        ("zlab_dflash", lambda c: c.update(architectures=["DFlash2DraftModel"]), r"a DFlash2 draft needs dflash_config field\(s\) \['conv_kernel_size'"),
        # an eagle3 config goes to the EAGLE-3 loader (tests/test_eagle3_draft.py), which runs one-layer drafts
        ("speculators_dspark", lambda c: c.update(speculators_model_type="eagle3"), r"field 'transformer_layer_config\.num_hidden_layers' is 2; only one-layer EAGLE-3"),
        ("speculators_dspark", lambda c: c.update(sliding_window_non_causal=False), r"sliding_window_non_causal is false: the draft's sliding layers attend causally"),
    ],
)
def test_packagings_we_do_not_run_are_refused_in_one_line_naming_the_file_and_field(packaging, change, message, deepspec, tmp_path):
    target, source = deepspec
    path = repackage(source, tmp_path / packaging, packaging)
    _edit(path, change)
    with pytest.raises(ValueError, match=message) as e:
        mlx_dspark.load(target, draft=path)
    assert "config.json" in str(e.value) and "\n" not in str(e.value)


def test_speculators_per_type_rope_is_the_sliding_entry_for_every_layer(deepspec, tmp_path):
    # speculators' flatten_rope_parameters: one RoPE (the sliding_attention entry) for all draft layers
    target, source = deepspec
    path = repackage(source, tmp_path / "spec", "speculators_dspark")
    rope = {"sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}, "full_attention": {"rope_theta": 5e6, "rope_type": "default"}}
    _edit(path, lambda c: c["transformer_layer_config"].update(rope_parameters=rope, layer_types=["sliding_attention", "full_attention"]))
    pair = mlx_dspark.load(target, draft=path, dtype="float32")
    assert [layer.self_attn.rope.base for layer in pair.draft.layers] == [10000.0, 10000.0]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", 64, r"config.json: hidden_size is 64 but the target \(.*\) has 128: they must be equal"),
        ("target_layer_ids", [0, 3], r"config.json: target_layer_ids \[0, 3\] has \[3\] outside \[-1, 2\]"),
    ],
)
def test_a_gemma4_draft_that_does_not_fit_the_target_names_the_file_and_field(field, value, message, tiny_qwen3_target, tmp_path):
    path = write_gemma4_draft(tmp_path / "draft", target_path=tiny_qwen3_target)
    _edit(path, lambda c: c.update({field: value}))
    with pytest.raises(ValueError, match=message) as e:
        mlx_dspark.load(tiny_qwen3_target, draft=path)
    assert "\n" not in str(e.value)


def test_backbone_only_heads_use_a_tied_targets_embedding_and_head(tiny_spark_pair, tmp_path):
    # LiquidAI's LFM2 heads ship no embedding / head: on a tied target both come from its one table
    target, source = tiny_spark_pair
    pair = mlx_dspark.load(target, draft=repackage(source, tmp_path / "lfm2", "lfm2_backbone"), dtype="float32")
    assert pair.target.args.tie_word_embeddings and not hasattr(pair.draft, "lm_head")
    _same(_proposal(pair), _proposal(mlx_dspark.load(target, draft=source, dtype="float32")))
    _lossless(pair)


def test_speculators_layers_copied_from_a_hybrid_verifiers_text_config(tiny_qwen3_target, tmp_path):
    # speculators writes the verifier's text config with the draft's depth: a qwen3_5 verifier's 64
    # linear / full layer_types and its partial_rotary_factor; the DFlash backbone reads layer i's entry
    # only for "sliding_attention" and ropes the whole head
    source = write_tiny_draft(tmp_path / "deepspec", target_path=tiny_qwen3_target, seed=9, layer_types=["full_attention"] * 2)
    path = repackage(source, tmp_path / "spec", "speculators_dspark")
    hybrid = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]}
    _edit(path, lambda c: c["transformer_layer_config"].update(model_type="qwen3_5_text", layer_types=hybrid, rope_parameters=rope))
    pair = mlx_dspark.load(tiny_qwen3_target, draft=path, dtype="float32")
    assert pair.draft.args.layer_types == ["full_attention"] * 2
    assert [layer.self_attn.rope.dims for layer in pair.draft.layers] == [32, 32]
    _same(_proposal(pair), _proposal(mlx_dspark.load(tiny_qwen3_target, draft=source, dtype="float32")))


def test_zlab_dflash_without_taps_reads_them_as_zlab_derives_them(deepspec, tmp_path):
    # dflash/model.py: target_layer_ids default to build_target_layer_ids(num_target_layers, num_hidden_layers)
    from mlx_dspark.models.heads.dspark.args import zlab_tap_ids

    assert zlab_tap_ids({"num_target_layers": 36, "num_hidden_layers": 5}, source="c") == [1, 9, 17, 25, 33]
    assert zlab_tap_ids({"num_target_layers": 28, "num_hidden_layers": 1}, source="c") == [14]
    target, source = deepspec
    path = repackage(source, tmp_path / "zlab", "zlab_dflash")
    _edit(path, lambda c: c["dflash_config"].pop("target_layer_ids"))  # 4 target layers, 2 draft layers
    pair = mlx_dspark.load(target, draft=path, dtype="float32", draft_tap_ids=None)
    assert list(pair.draft.args.target_layer_ids) == zlab_tap_ids({"num_target_layers": 4, "num_hidden_layers": 2}, source="c")
    _edit(path, lambda c: c.pop("num_target_layers"))
    with pytest.raises(ValueError, match=r"config.json: no target_layer_ids .* z-lab DFlash's default taps"):
        mlx_dspark.load(target, draft=path)
