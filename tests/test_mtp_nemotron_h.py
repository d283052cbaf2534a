"""Nemotron-H's own MTP block as the draft (issue 35 item 2): the HF layout (`mtp.layers.<j>.*`: an attention
and a MoE layer, the input projection on the first, the final norm on the last) loaded, one step and a chain
equal to an independent NumPy restatement (tests/mtp_nemotron_h_reference.py), greedy speculation
token-identical to mlx-lm's own generate over 210 tokens on the Mamba-2 hybrid target, sampled speculation the
target's exact distribution, conversion keeping the block, `--draft auto`, refusals by field."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_dspark
from mlx_dspark.testing.mtp_nemotron_h_tiny import write_tiny_nemotron_h_target
from tests.mtp_nemotron_h_reference import NemotronHMTPReference
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
    return write_tiny_nemotron_h_target(tmp_path_factory.mktemp("nemotron_h") / "target", seed=0)


@pytest.fixture(scope="module")
def loaded(target_dir):
    return mlx_dspark.load(str(target_dir), draft="mtp")


def test_the_mtp_block_loads_apart_from_the_target_and_reads_its_embedding_and_head(loaded):
    mtp = loaded.heads["mtp"]
    assert loaded.draft is None and mtp.num_layers == 1 and [layer.block_type for layer in mtp.layers] == ["*", "E"]
    names = {k for k, _ in tree_flatten(mtp.parameters())}
    assert {"layers.0.eh_proj.weight", "layers.0.mixer.q_proj.weight", "layers.1.mixer.switch_mlp.fc1.weight",
            "layers.1.final_layernorm.weight"} <= names  # fmt: skip
    assert "layers.1.enorm.weight" not in names and "layers.0.final_layernorm.weight" not in names
    assert not any(k.startswith(("embeddings", "lm_head")) for k in names)
    assert not any("mtp" in k for k, _ in tree_flatten(loaded.target.parameters()))
    assert len(mtp.make_cache()) == 1  # the attention layer's; the MoE keeps none


def test_one_step_gives_the_numpy_restatements_logits(target_dir, loaded):
    target, mtp = loaded.target, loaded.heads["mtp"]
    hidden = final_hidden(target, PROMPT)
    nxt = PROMPT[1:] + [77]  # entry t pairs h_t with the token at t + 1
    out = mtp(mtp.embed(mx.array([nxt]), target), hidden, mtp.make_cache())
    assert close(np.array(mtp.logits(out, target)[0]), NemotronHMTPReference(target_dir).logits(nxt, np.array(hidden[0])))


def test_a_chained_proposal_is_the_restatements_chain_and_leaves_only_committed_entries(target_dir, loaded):
    proposal, proposer = greedy_chain_of(loaded)
    drafts, probs = NemotronHMTPReference(target_dir).greedy_chain(PROMPT[1:] + [77], np.array(final_hidden(loaded.target, PROMPT)[0]), 4)
    assert proposal.tokens[0].tolist() == drafts
    assert close(np.array(proposal.token_probs[0]), np.array(probs))
    assert all(c.offset == len(PROMPT) for c in proposer.cache)  # the 3 chained entries were trimmed


def test_greedy_mtp_speculation_is_mlx_lms_generate_over_200_tokens(target_dir, loaded):
    assert_greedy_speculation_is_mlx_lms_generate(target_dir, loaded)


def test_convert_keeps_the_mtp_block_under_its_hf_names_and_the_conversion_loads_the_same_block(target_dir, loaded, tmp_path):
    from safetensors import safe_open

    from mlx_dspark.loading.convert import convert

    out = convert(target_dir, tmp_path / "mlx", log=lambda _: None)
    written = {k for f in out.glob("*.safetensors") for k in safe_open(str(f), "np").keys()}
    assert "mtp.layers.1.mixer.switch_mlp.fc1.weight" in written and "mtp.layers.0.eh_proj.weight" in written
    assert_conversion_loads_the_same_layers(loaded, out)


def test_draft_auto_picks_the_mtp_block_when_the_files_hold_it_and_a_bare_checkpoint_says_how_to_get_it(target_dir, tmp_path):
    from mlx_dspark.loading.draft_registry import resolve_auto_draft

    reference, line = resolve_auto_draft(str(target_dir))
    assert reference == "mtp" and "MTP layers (1)" in line
    bare = write_tiny_nemotron_h_target(tmp_path / "bare", mtp=False)
    assert resolve_auto_draft(str(bare))[0] is None
    with pytest.raises(ValueError, match=r"bare: draft 'mtp'.*no mtp\.layers\.0\.\* / mtp\.layers\.1\.\* tensors.*mlx_dspark\.convert"):
        mlx_dspark.load(str(bare), draft="mtp")
    assert "mtp" not in mlx_dspark.load(str(bare)).heads  # the target itself loads


def test_refusals_name_the_field(tmp_path):
    two = write_tiny_nemotron_h_target(tmp_path / "two", mtp=False, mtp_layers=2)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers is 2; only 1 is supported.*Nemotron-H"):
        mlx_dspark.load(str(two), draft="mtp")
    none = write_tiny_nemotron_h_target(tmp_path / "none", mtp_layers=0)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers is absent or 0"):
        mlx_dspark.load(str(none), draft="mtp")
    mamba = write_tiny_nemotron_h_target(tmp_path / "mamba")
    config = json.loads((mamba / "config.json").read_text())
    (mamba / "config.json").write_text(json.dumps({**config, "mtp_layers_block_type": ["attention", "mamba"]}))
    with pytest.raises(ValueError, match=r"mtp_layers_block_type \['attention', 'mamba'\].*'attention' and 'moe' layers only"):
        mlx_dspark.load(str(mamba), draft="mtp")


def test_the_older_pattern_field_builds_the_same_block(tmp_path):
    from mlx_dspark.models.heads.mtp.nemotron_h import block_pattern

    assert block_pattern({"mtp_hybrid_override_pattern": "*E"}) == "*E"
    assert block_pattern({"mtp_layers_block_type": ["moe", "attention"], "mtp_hybrid_override_pattern": "*E"}) == "E*"
    assert block_pattern({}) == "*E"  # HF transformers' default


# -- sampled: the target's exact distribution ----------------------------------------------------------


def test_sampled_mtp_speculation_matches_the_exact_target_distribution(tmp_path):
    assert_sampled_speculation_is_exact(write_tiny_nemotron_h_target, tmp_path)
