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
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.engine.mtp_propose import MTPProposer
from mlx_dspark.engine.options import SpeculationOptions
from mlx_dspark.engine.sample import Sampler
from mlx_dspark.loading.checkpoint import read_checkpoint
from mlx_dspark.loading.load import build_target
from mlx_dspark.loading.mtp import build_mtp
from mlx_dspark.models.base import FINAL_TAP
from mlx_dspark.models.mlx_lm_target import probe_target
from mlx_dspark.testing.mtp_qwen3_next_tiny import write_tiny_qwen3_next_target
from tests.engine_helpers import assert_chain_sampling_is_exact
from tests.mtp_qwen3_next_reference import Qwen3NextMTPReference
from tests.test_mtp import mlx_lm_greedy

PROMPT = [1, 5, 9, 20, 33, 7, 100, 250, 3, 64, 17, 42]
FIXED = SpeculationOptions(max_draft_tokens=3)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen3_next_target(tmp_path_factory.mktemp("qwen3_next") / "target", seed=0)


@pytest.fixture(scope="module")
def loaded(target_dir):
    return mlx_dspark.load(str(target_dir), draft="mtp")


def final_hidden(target, tokens: list[int]) -> mx.array:
    _, features = target(mx.array([tokens]), tap_ids=(FINAL_TAP,))
    return features  # (1, n, C)


def close(ours: np.ndarray, expected: np.ndarray) -> bool:
    return float(np.abs(ours - expected).max()) < 1e-4 * max(1.0, float(np.abs(expected).max()))


def test_the_mtp_layer_loads_apart_from_the_target_with_its_moe_mlp(target_dir, loaded):
    mtp = loaded.mtp
    assert loaded.draft is None and mtp.num_layers == 1 and mtp.raw_norms
    names = {k for k, _ in tree_flatten(mtp.parameters())}
    assert {"fc.weight", "layers.0.mlp.switch_mlp.up_proj.weight", "layers.0.mlp.shared_expert_gate.weight"} <= names
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in names)
    assert not any("mtp" in k for k, _ in tree_flatten(loaded.target.parameters()))
    assert "num_nextn_predict_layers" not in read_checkpoint(target_dir).config  # as the published configs


def test_one_step_gives_the_numpy_restatements_logits(target_dir, loaded):
    target, mtp = loaded.target, loaded.mtp
    hidden = final_hidden(target, PROMPT)
    nxt = PROMPT[1:] + [77]  # entry t pairs h_t with the token at t + 1
    out = mtp(mtp.embed(mx.array([nxt]), target), hidden, mtp.make_cache())
    assert close(np.array(mtp.logits(out, target)[0]), Qwen3NextMTPReference(target_dir).logits(nxt, np.array(hidden[0])))


def test_a_chained_proposal_is_the_restatements_chain_and_leaves_only_committed_entries(target_dir, loaded):
    target, mtp = loaded.target, loaded.mtp
    anchor = 77
    proposer = MTPProposer(mtp, target, prompt=PROMPT, greedy=True, temperature=1.0, block_size=4)
    proposer.extend(final_hidden(target, PROMPT))
    proposer.commit([anchor])
    proposal = proposer.propose(mx.array([anchor]), position=len(PROMPT), num_tokens=4)
    expected = Qwen3NextMTPReference(target_dir).greedy_chain(PROMPT[1:] + [anchor], np.array(final_hidden(target, PROMPT)[0]), 4)
    assert proposal.tokens[0].tolist() == expected
    assert all(c.offset == len(PROMPT) for c in proposer.cache)  # the 3 chained entries were trimmed


def test_greedy_mtp_speculation_is_mlx_lms_generate_over_200_tokens(target_dir, loaded):
    reference = mlx_lm_greedy(target_dir, PROMPT, 210)
    spec = mlx_dspark.generate(prepare_model(loaded, RunSettings(ignore_eos=True)), PROMPT, max_tokens=210, max_draft_tokens=3)
    assert spec.tokens == reference and len(reference) == 210
    assert spec.rounds < 210 and spec.acceptance_lengths


def test_convert_keeps_the_mtp_layer_and_the_conversion_loads_the_same_layer(target_dir, loaded, tmp_path):
    from mlx_dspark.loading.convert import convert

    out = convert(target_dir, tmp_path / "mlx", log=lambda _: None)
    converted = mlx_dspark.load(str(out), draft="mtp")
    assert not converted.mtp.raw_norms  # experts stacked and norms moved by mlx-lm's own sanitize, written so
    ours, theirs = dict(tree_flatten(loaded.mtp.parameters())), dict(tree_flatten(converted.mtp.parameters()))
    assert ours.keys() == theirs.keys() and all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)


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

VOCAB = 8
CHI_PROMPT = [1, 5, 2, 7, 3]  # test_lossless_sampling's PROMPT, which exact_distribution reads
CHI_SAMPLER = Sampler(temperature=0.7)


def test_sampled_mtp_speculation_matches_the_exact_target_distribution(tmp_path):
    path = write_tiny_qwen3_next_target(tmp_path / "chi", seed=5, vocab_size=VOCAB)
    checkpoint = read_checkpoint(path)
    target, mtp = build_target(checkpoint), build_mtp(checkpoint)
    target.eval()
    mx.eval(target.parameters(), mtp.parameters())
    probe_target(target)
    make = lambda: MTPProposer(mtp, target, prompt=CHI_PROMPT, greedy=False, temperature=CHI_SAMPLER.temperature)  # noqa: E731
    assert_chain_sampling_is_exact(target, make, sampler=CHI_SAMPLER, speculation=FIXED, runs=300, seed=11)
