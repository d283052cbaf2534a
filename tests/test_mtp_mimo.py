"""MiMo's own MTP layer as the draft (issue 35 item 2): the HF layout (`model.mtp_layers.<i>.*`) loaded,
one step, the layer choice and a chain equal to an independent NumPy restatement
(tests/mtp_mimo_reference.py restates the Qwen2 block too), greedy speculation token-identical to plain
decoding over 200 tokens, sampled speculation the target's exact distribution, conversion keeping the
layer, and the refusals."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.engine.proposers.mtp import MTPProposer
from mlx_dspark.engine.options import SpeculationOptions
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.loading.checkpoint import read_checkpoint
from mlx_dspark.loading.load import build_target
from mlx_dspark.loading.heads.mtp import build_mtp, mtp_skeleton
from mlx_dspark.models.layers.base import FINAL_TAP
from mlx_dspark.models.target.mlx_lm import probe_target
from mlx_dspark.testing.mtp_mimo_tiny import write_tiny_mimo_target
from tests.engine_helpers import assert_chain_sampling_is_exact
from tests.mtp_mimo_reference import MiMoMTPReference

PROMPT = [1, 5, 9, 20, 33, 7, 100, 250, 3, 64, 17, 42]
FIXED = SpeculationOptions(max_draft_tokens=3)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_tiny_mimo_target(tmp_path_factory.mktemp("mimo") / "target", seed=0)


@pytest.fixture(scope="module")
def loaded(target_dir):
    return mlx_dspark.load(str(target_dir), draft="mtp")


def final_hidden(target, tokens: list[int]) -> mx.array:
    _, features = target(mx.array([tokens]), tap_ids=(FINAL_TAP,))
    return features  # (1, n, C)


def close(ours: np.ndarray, expected: np.ndarray) -> bool:
    return float(np.abs(ours - expected).max()) < 1e-4 * max(1.0, float(np.abs(expected).max()))


def _flat(module):
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


def test_the_mtp_layer_loads_apart_from_the_target_and_reads_its_embedding_and_head(loaded):
    mtp = loaded.heads["mtp"]
    assert loaded.draft is None and mtp.num_layers == 1 and not mtp.own_embedding and not mtp.own_head
    names = {k for k, _ in _flat(mtp)}
    assert "layers.0.input_proj.weight" in names and "layers.0.mtp_block.self_attn.q_proj.bias" in names
    assert not any("embed" in k or "lm_head" in k for k in names)
    assert not any("mtp" in k for k, _ in _flat(loaded.target)) and len(loaded.target.layers) == 2


def test_one_step_gives_the_numpy_restatements_logits(target_dir, loaded):
    target, mtp = loaded.target, loaded.heads["mtp"]
    hidden = final_hidden(target, PROMPT)
    nxt = PROMPT[1:] + [77]  # entry t pairs h_t with the token at t + 1
    out = mtp(mtp.embed(mx.array([nxt]), target), hidden, mtp.make_cache())
    ours = np.array(mtp.logits(out, target)[0])
    assert close(ours, MiMoMTPReference(target_dir).step_logits(nxt, np.array(hidden[0])))


def test_a_chained_proposal_is_the_restatements_chain_and_leaves_only_committed_entries(target_dir, loaded):
    target, mtp = loaded.target, loaded.heads["mtp"]
    anchor = 77
    proposer = MTPProposer(mtp, target, prompt=PROMPT, greedy=True, temperature=1.0, block_size=4)
    proposer.extend(final_hidden(target, PROMPT))
    proposer.commit([anchor])
    proposal = proposer.propose(mx.array([anchor]), position=len(PROMPT), num_tokens=4)
    drafts, probs = MiMoMTPReference(target_dir).greedy_chain(PROMPT[1:] + [anchor], np.array(final_hidden(target, PROMPT)[0]), 4)
    assert proposal.tokens[0].tolist() == drafts
    assert close(np.array(proposal.token_probs[0]), np.array(probs))  # each step's own distribution, not only its argmax
    assert all(c.offset == len(PROMPT) for c in proposer.cache)  # the 3 chained entries were trimmed


def test_a_tied_embedding_target_gives_the_restatements_logits(tmp_path):
    path = write_tiny_mimo_target(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    loaded = mlx_dspark.load(str(path), draft="mtp")
    target, mtp = loaded.target, loaded.heads["mtp"]
    hidden = final_hidden(target, PROMPT)
    out = mtp(mtp.embed(mx.array([PROMPT[1:] + [9]]), target), hidden, mtp.make_cache())
    assert close(np.array(mtp.logits(out, target)[0]), MiMoMTPReference(path).step_logits(PROMPT[1:] + [9], np.array(hidden[0])))


def test_step_k_runs_layer_k_mod_n(tmp_path):
    """Two MTP layers (MiMo-7B publishes one; load refuses more, the module keeps the rule)."""
    from mlx.utils import tree_unflatten

    path = write_tiny_mimo_target(tmp_path / "two", mtp_layers=2)
    checkpoint = read_checkpoint(path)
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 2; only 1 is supported"):
        build_mtp(checkpoint)
    target = build_target(checkpoint)
    mx.eval(target.parameters())
    mtp = mtp_skeleton(checkpoint.config, {k: v.shape for k, v in checkpoint.weights.items()}, source=str(path))
    mtp.update(tree_unflatten(list(mtp.sanitize(dict(checkpoint.weights)).items())))
    hidden = final_hidden(target, PROMPT)
    nxt = PROMPT[1:] + [5]
    reference = MiMoMTPReference(path)
    for step in (0, 1, 2, 3):
        out = mtp(mtp.embed(mx.array([nxt]), target), hidden, mtp.make_cache(), step=step)
        assert close(np.array(mtp.logits(out, target, step=step)[0]), reference.step_logits(nxt, np.array(hidden[0]), step))
    assert not close(reference.step_logits(nxt, np.array(hidden[0]), 0), reference.step_logits(nxt, np.array(hidden[0]), 1))


def test_greedy_mtp_speculation_is_plain_decoding_over_200_tokens(loaded):
    model = prepare_model(loaded, RunSettings(ignore_eos=True))
    plain = mlx_dspark.generate(model, PROMPT, max_tokens=210, speculative=False)
    spec = mlx_dspark.generate(model, PROMPT, max_tokens=210, max_draft_tokens=3)
    assert spec.tokens == plain.tokens and len(spec.tokens) == 210
    assert spec.rounds < 210 and spec.acceptance_lengths


def test_convert_keeps_the_mtp_layer_under_its_hf_names_and_the_conversion_loads_the_same_layer(target_dir, loaded, tmp_path):
    from safetensors import safe_open

    from mlx_dspark.loading.convert import convert

    out = convert(target_dir, tmp_path / "mlx", log=lambda _: None)
    written = {k for f in out.glob("*.safetensors") for k in safe_open(str(f), "np").keys()}
    assert {k for k in written if k.startswith("model.mtp_layers.")} == {
        k for k in read_checkpoint(target_dir).weights if k.startswith("model.mtp_layers.")
    }
    converted = mlx_dspark.load(str(out), draft="mtp")
    ours, theirs = dict(_flat(loaded.heads["mtp"])), dict(_flat(converted.heads["mtp"]))
    assert ours.keys() == theirs.keys() and all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
    model = prepare_model(converted, RunSettings(ignore_eos=True))
    assert mlx_dspark.generate(model, PROMPT, max_tokens=40, max_draft_tokens=3).tokens == (
        mlx_dspark.generate(prepare_model(loaded, RunSettings(ignore_eos=True)), PROMPT, max_tokens=40, speculative=False).tokens
    )


def test_a_checkpoint_without_the_mtp_tensors_is_one_clear_error(tmp_path):
    bare = write_tiny_mimo_target(tmp_path / "bare", mtp=False)
    with pytest.raises(ValueError, match=r"bare: draft 'mtp'.*no model\.mtp_layers\.0\.\* tensors.*mlx_dspark\.convert"):
        mlx_dspark.load(str(bare), draft="mtp")
    assert "mtp" not in mlx_dspark.load(str(bare)).heads  # the target itself loads
    no_layers = write_tiny_mimo_target(tmp_path / "none", mtp_layers=0)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers is absent or 0"):
        mlx_dspark.load(str(no_layers), draft="mtp")


def test_draft_auto_picks_the_mtp_layer_when_the_files_hold_it(target_dir, tmp_path):
    from mlx_dspark.loading.draft_registry import resolve_auto_draft

    reference, line = resolve_auto_draft(str(target_dir))
    assert reference == "mtp" and "MTP layers (1)" in line
    assert resolve_auto_draft(str(write_tiny_mimo_target(tmp_path / "bare", mtp=False)))[0] is None


# -- sampled: the target's exact distribution ----------------------------------------------------------

VOCAB = 8
CHI_PROMPT = [1, 5, 2, 7, 3]  # test_lossless_sampling's PROMPT, which exact_distribution reads
RUNS = 300
CHI_SAMPLER = Sampler(temperature=0.7)


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    """An 8-token MiMo target and its MTP layer, loaded through the real path (no tokenizer needed)."""
    path = write_tiny_mimo_target(tmp_path_factory.mktemp("chi") / "target", seed=5, vocab_size=VOCAB)
    checkpoint = read_checkpoint(path)
    target, mtp = build_target(checkpoint), build_mtp(checkpoint)
    target.eval()
    mx.eval(target.parameters(), mtp.parameters())
    probe_target(target)
    return target, mtp


def test_sampled_mtp_speculation_matches_the_exact_target_distribution(tiny_vocab_pair):
    target, mtp = tiny_vocab_pair
    make = lambda: MTPProposer(mtp, target, prompt=CHI_PROMPT, greedy=False, temperature=CHI_SAMPLER.temperature)  # noqa: E731
    assert_chain_sampling_is_exact(target, make, sampler=CHI_SAMPLER, speculation=FIXED, runs=RUNS, seed=11)
