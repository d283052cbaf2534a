"""DFlash v1 drafts (z-lab, vLLM speculators) and DSpark ones (speculators, LiquidAI) on backbone
configurations the other tests do not name (issue 35): head_dim != hidden / heads with one KV head, three
layers with two sliding, one layer, a block of 3, taps in any order with the embedding, rms_norm_eps and
rope_theta, and (z-lab, speculators) a `rope_parameters.partial_rotary_factor` their Qwen3RotaryEmbedding
ignores. Greedy proposals are the NumPy restatement's (tests/dspark_reference.py): DFlash's argmax of the
block rows from row 1, DSpark's Markov path (and confidence) from row 0; DeepSpec's Markov heads at a rank
of 1 and blocks of 3 and 2."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.models.target.lm_head import target_head
from mlx_dspark.testing.draft_layouts import repackage
from mlx_dspark.testing.tiny import write_tiny_draft
from tests.dspark_reference import ReferenceDraft

CONFIGS = {  # name: (config overrides, layer types, taps)
    "head_dim16_one_kv_head": (dict(head_dim=16, num_key_value_heads=1), None, None),
    "three_layers_two_sliding": (dict(sliding_window=5), ["sliding_attention", "full_attention", "sliding_attention"], None),
    "one_full_layer_block3": (dict(block_size=3), ["full_attention"], None),
    "taps_unordered_with_the_embedding": ({}, None, [2, -1, 1]),
    "eps_and_theta": (dict(rms_norm_eps=0.5, rope_theta=1e6, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}), None, None),
    "partial_rotary_factor_in_rope_parameters": (
        dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25}), None, None,
    ),
}
LAYOUTS = ("deepspec", "zlab_dflash", "speculators_dflash", "speculators_dspark", "lfm2_backbone")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_proposals_are_the_references_on_config(name, layout, tiny_qwen3_target, tmp_path):
    overrides, layer_types, taps = CONFIGS[name]
    if name.startswith("partial") and layout in ("deepspec", "lfm2_backbone"):
        pytest.skip("DeepSpec's config (LiquidAI's too): a partial factor there is read as written (test_draft_packagings)")
    deepspec = write_tiny_draft(tmp_path / "deepspec", target_path=tiny_qwen3_target, seed=3, config_overrides=overrides,
                                layer_types=layer_types, target_layer_ids=taps)  # fmt: skip
    files = deepspec if layout == "deepspec" else repackage(deepspec, tmp_path / layout, layout)
    config = json.loads((deepspec / "config.json").read_text())
    if name.startswith("partial"):  # the published DFlash backbones turn the whole head
        config["rope_parameters"] = {"rope_theta": 10000.0}
    _check_greedy(mlx_dspark.load(str(tiny_qwen3_target), draft=str(files), dtype="float32"), deepspec, config)


@pytest.mark.parametrize(
    "head_type,rank,block_size", [("vanilla", 1, 7), ("gated", 16, 3), ("rnn", 16, 2)], ids=["rank1", "gated_block3", "rnn_block2"]
)
def test_deepspec_markov_heads_at_their_edges_are_the_references(head_type, rank, block_size, tiny_qwen3_target, tmp_path):
    deepspec = write_tiny_draft(tmp_path / "deepspec", target_path=tiny_qwen3_target, seed=3, markov_head_type=head_type,
                                markov_rank=rank, config_overrides=dict(block_size=block_size))  # fmt: skip
    config = json.loads((deepspec / "config.json").read_text())
    _check_greedy(mlx_dspark.load(str(tiny_qwen3_target), draft=str(deepspec), dtype="float32"), deepspec, config)


def _check_greedy(pair, deepspec, config):
    reference = ReferenceDraft(config, {k: np.array(v) for k, v in mx.load(str(deepspec / "model.safetensors")).items()})
    draft = pair.draft
    embedding, lm_head = np.array(pair.target.embedding.weight), np.array(target_head(pair.target).weight)
    features = np.random.default_rng(0).standard_normal((1, 11, len(draft.args.target_layer_ids) * 128)).astype(np.float32)
    ctx = draft.make_cache()
    draft.append_context(mx.array(features), ctx)
    first = draft.args.packaging.first_draft_row
    for anchor in (17, 250):
        out = draft.propose(mx.array([anchor]), ctx, target=pair.target)
        if draft.args.markov_rank:  # DSpark: the Markov path from row 0
            assert first == 0
            drafted = reference.draft(features[0], anchor, embedding=embedding, lm_head=lm_head)
            want = drafted["tokens"].tolist()
            if drafted["confidence"] is not None:
                np.testing.assert_allclose(np.array(out.confidence[0]), drafted["confidence"], atol=1e-4)
        else:  # DFlash: each row's argmax, from row 1
            want = np.argmax(reference.block_outputs(features[0], anchor, embedding)[first:] @ lm_head.T, axis=-1).tolist()
        assert out.tokens[0].tolist() == want[: draft.num_drafts]


@pytest.mark.parametrize(
    "layer_types,nested,error",
    [
        (["sliding_attention", "full_attention"], {"swa_window_size": 5}, None),
        (["full_attention"], {"swa_window_size": 0, "use_swa": False}, None),
        (["sliding_attention", "full_attention"], {"swa_window_size": 8}, "field 'dflash_config.swa_window_size' is 8 but the draft's layers"),
        (["sliding_attention"], {"sliding_window": -1}, "field 'dflash_config.sliding_window' is -1 but the draft's layers"),
        (["full_attention"], {"swa_window_size": 5}, "field 'dflash_config.swa_window_size' is 5 but the draft's layers"),
        (["full_attention"], {"use_swa": True}, "field 'dflash_config.use_swa' is true but the draft's layers"),
    ],
)  # fmt: skip
def test_a_window_under_dflash_config_must_be_the_layer_configs(layer_types, nested, error, tiny_qwen3_target, tmp_path):
    """mlx-vlm takes `dflash_config.swa_window_size` in place of `sliding_window`, LMDeploy refuses a mismatch and
    TensorRT-LLM windows only with `use_swa`: a window there that the layer config does not run is refused by name."""
    draft = write_tiny_draft(tmp_path / "draft", target_path=tiny_qwen3_target, seed=3, layer_types=layer_types,
                             sliding_window=5 if "sliding_attention" in layer_types else None, packaging="dflash_config")  # fmt: skip
    config = json.loads((draft / "config.json").read_text())
    config["dflash_config"].update(nested)
    (draft / "config.json").write_text(json.dumps(config))
    if error is None:
        assert mlx_dspark.load(str(tiny_qwen3_target), draft=str(draft), dtype="float32").draft.args.layer_window(0) == (
            5 if layer_types[0] == "sliding_attention" else None
        )
    else:
        with pytest.raises(ValueError, match=r"config.json: " + error.replace("(", r"\(")):
            mlx_dspark.load(str(tiny_qwen3_target), draft=str(draft), dtype="float32")


@pytest.mark.parametrize("layout", ["zlab_dflash", "deepspec"])
def test_a_zlab_draft_beside_a_target_that_scales_its_embedding_is_refused(layout, tmp_path):
    """z-lab's runtime (and mlx-vlm's) embeds the block through a Gemma target's scaled embedding; ours gives a
    qwen3-layer draft the raw table: refused for z-lab's architectures; a DeepSpec draft loads as before."""
    from mlx_dspark.testing.mlx_lm_checkpoints import write_draft_for, write_tiny_mlx_lm_target

    target = write_tiny_mlx_lm_target(tmp_path / "target", family="gemma4_text")
    deepspec = write_draft_for(tmp_path / "deepspec", target_path=target, seed=3)
    files = deepspec if layout == "deepspec" else repackage(deepspec, tmp_path / layout, layout)
    if layout == "deepspec":
        assert mlx_dspark.load(str(target), draft=str(files)).draft is not None
        return
    with pytest.raises(ValueError, match=r"config.json: a z-lab DFlash / DFlash 2 draft with qwen3-style layers beside a gemma4_text target"):
        mlx_dspark.load(str(target), draft=str(files))
