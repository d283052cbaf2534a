"""Qwen3-Next's own MTP layer as the draft (issue 35 item 2): the HF layout (`mtp.*`, experts one by one,
zero-centred norms, no MTP field in config.json) loaded, one step and a chain equal to an independent NumPy
restatement (tests/mtp_qwen3_next_reference.py restates the MoE MLP), greedy speculation token-identical to
mlx-lm's own generate over 210 tokens on the hybrid target (GatedDeltaNet state rolled back each round),
sampled speculation the target's exact distribution, conversion keeping the layer, `--draft auto`, refusals."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_dspark
from mlx_dspark.loading.checkpoint import read_checkpoint
from mlx_dspark.testing.mtp_qwen3_next_tiny import write_tiny_qwen3_next_target
from tests.mtp_qwen3_next_reference import Qwen3NextMTPReference
from tests.mtp_helpers import (
    PROMPT,
    assert_conversion_loads_the_same_layers,
    assert_greedy_speculation_is_mlx_lms_generate,
    assert_sampled_speculation_is_exact,
    close,
    final_hidden,
    greedy_chain_of,
)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen3_next_target(tmp_path_factory.mktemp("qwen3_next") / "target", seed=0)


@pytest.fixture(scope="module")
def loaded(target_dir):
    return mlx_dspark.load(str(target_dir), draft="mtp")


def test_the_mtp_layer_loads_apart_from_the_target_with_its_moe_mlp(target_dir, loaded):
    mtp = loaded.heads["mtp"]
    assert loaded.draft is None and mtp.num_layers == 1 and mtp.raw_norms
    names = {k for k, _ in tree_flatten(mtp.parameters())}
    assert {"fc.weight", "layers.0.mlp.switch_mlp.up_proj.weight", "layers.0.mlp.shared_expert_gate.weight"} <= names
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in names)
    assert not any("mtp" in k for k, _ in tree_flatten(loaded.target.parameters()))
    assert "num_nextn_predict_layers" not in read_checkpoint(target_dir).config  # as the published configs


def test_one_step_gives_the_numpy_restatements_logits(target_dir, loaded):
    target, mtp = loaded.target, loaded.heads["mtp"]
    hidden = final_hidden(target, PROMPT)
    nxt = PROMPT[1:] + [77]  # entry t pairs h_t with the token at t + 1
    out = mtp(mtp.embed(mx.array([nxt]), target), hidden, mtp.make_cache())
    assert close(np.array(mtp.logits(out, target)[0]), Qwen3NextMTPReference(target_dir).logits(nxt, np.array(hidden[0])))


def test_a_chained_proposal_is_the_restatements_chain_and_leaves_only_committed_entries(target_dir, loaded):
    proposal, proposer = greedy_chain_of(loaded)
    expected = Qwen3NextMTPReference(target_dir).greedy_chain(PROMPT[1:] + [77], np.array(final_hidden(loaded.target, PROMPT)[0]), 4)
    assert proposal.tokens[0].tolist() == expected
    assert all(c.offset == len(PROMPT) for c in proposer.cache)  # the 3 chained entries were trimmed


def test_greedy_mtp_speculation_is_mlx_lms_generate_over_200_tokens(target_dir, loaded):
    assert_greedy_speculation_is_mlx_lms_generate(target_dir, loaded)


def test_convert_keeps_the_mtp_layer_and_the_conversion_loads_the_same_layer(target_dir, loaded, tmp_path):
    from mlx_dspark.loading.convert import convert

    out = convert(target_dir, tmp_path / "mlx", log=lambda _: None)
    converted = assert_conversion_loads_the_same_layers(loaded, out)
    assert not converted.heads["mtp"].raw_norms  # experts stacked and norms moved by mlx-lm's own sanitize, written so


def test_a_raw_files_norms_move_by_one_without_the_experts_beside_them(target_dir, loaded):
    """`convert` sanitizes shard by shard: a shard holding the layer's norms but not its experts still moves them."""
    norms = {k: v for k, v in read_checkpoint(target_dir).weights.items() if k.startswith("mtp.") and k.endswith("norm.weight")}
    moved = loaded.heads["mtp"].sanitize(norms)
    assert len(norms) == 5 and all(mx.array_equal(moved[k.removeprefix("mtp.")], v + 1.0).item() for k, v in norms.items())


def test_without_the_tensors_load_says_how_to_get_them_and_auto_does_not_pick_mtp(target_dir, tmp_path):
    from mlx_dspark.loading.draft_registry import resolve_auto_draft

    reference, line = resolve_auto_draft(str(target_dir))
    assert reference == "mtp" and "MTP layers (1)" in line
    bare = write_tiny_qwen3_next_target(tmp_path / "bare", mtp=False)
    with pytest.raises(ValueError, match=r"bare: draft 'mtp'.*MTP layer is in its original files.*no mtp\.\* tensors.*mlx_dspark\.convert"):
        mlx_dspark.load(str(bare), draft="mtp")
    assert resolve_auto_draft(str(bare))[0] is None
    # a Hub config without the field is not taken at its word; one that declares the layer is
    assert resolve_auto_draft("someone/qwen3-next", fetch_config=lambda _: bare / "config.json")[0] is None
    declared = write_tiny_qwen3_next_target(tmp_path / "declared", mtp=False, mtp_layers=1)
    assert resolve_auto_draft("someone/qwen3-next", fetch_config=lambda _: declared / "config.json")[0] == "mtp"


def test_more_than_one_or_zero_declared_layers_are_refused_by_field(tmp_path):
    two = write_tiny_qwen3_next_target(tmp_path / "two", mtp_layers=2)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers is 2; only 1 is supported.*Qwen3-Next"):
        mlx_dspark.load(str(two), draft="mtp")
    none = write_tiny_qwen3_next_target(tmp_path / "none", mtp=False, mtp_layers=0)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers is absent or 0"):
        mlx_dspark.load(str(none), draft="mtp")


# -- sampled: the target's exact distribution ----------------------------------------------------------


def test_sampled_mtp_speculation_matches_the_exact_target_distribution(tmp_path):
    assert_sampled_speculation_is_exact(write_tiny_qwen3_next_target, tmp_path)
