"""Qwen3.5's own MTP layers as the draft (issue 35 item 2): the HF `mtp.*` layout loaded, one step and a
chain equal to an independent NumPy restatement, greedy speculation token-identical to mlx-lm's own
generate, sampled speculation the target's exact distribution, the MTP cache rolled back to exactly the
committed entries, conversion keeping the layers, the refusals, `--draft mtp` / `--draft auto`."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.engine.round.decode import speculative_steps
from mlx_dspark.engine.proposers.mtp import MTPProposer
from mlx_dspark.engine.options import SpeculationOptions
from mlx_dspark.engine.proposers.base import Proposal, Proposer
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.models.layers.base import FINAL_TAP
from mlx_dspark.testing.mtp_tiny import write_tiny_qwen3_5_mtp_target
from tests.engine_helpers import assert_chain_sampling_is_exact, sampled_prefix
from tests.mtp_reference import MTPReference

PROMPT = [1, 5, 9, 20, 33, 7, 100, 250, 3, 64, 17, 42]
FIXED = SpeculationOptions(max_draft_tokens=3)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen3_5_mtp_target(tmp_path_factory.mktemp("mtp") / "target", seed=0)


@pytest.fixture(scope="module")
def loaded(target_dir):
    return mlx_dspark.load(str(target_dir), draft="mtp")


VARIANTS = {  # name -> the tiny writer's options (beside the dense target above)
    # a Qwen3.5-MoE target: its MTP layer's MLP a sparse MoE, the experts fused as HF stores them
    "qwen3_5_moe": dict(family="qwen3_5_moe"),
    # the small Qwen3.5s' tied head (the MTP's logits through the embedding) and another partial rotary factor
    "tied-half-rotary": dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                                        "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}


@pytest.fixture(scope="module")
def variants(tmp_path_factory, target_dir, loaded):
    """name -> (target directory, loaded with draft 'mtp'), each built once, when first asked for."""
    built = {"qwen3_5": (target_dir, loaded)}

    def get(name: str):
        if name not in built:
            path = write_tiny_qwen3_5_mtp_target(tmp_path_factory.mktemp(f"mtp-{name}") / "target", seed=3, **VARIANTS[name])
            built[name] = (path, mlx_dspark.load(str(path), draft="mtp"))
        return built[name]

    return get


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def family_pair(request, variants):
    return variants(request.param)


@pytest.fixture(scope="module", params=["qwen3_5", *VARIANTS])
def variant_pair(request, variants):
    return variants(request.param)


def final_hidden(target, tokens: list[int]) -> mx.array:
    _, features = target(mx.array([tokens]), tap_ids=(FINAL_TAP,))
    return features  # (1, n, C)


def test_the_checkpoint_holds_the_15_hf_mtp_tensors_and_they_load(target_dir, loaded):
    names = json.loads((target_dir / "config.json").read_text())
    assert names["text_config"]["mtp_num_hidden_layers"] == 1
    reference = MTPReference(target_dir)
    assert len([k for k in reference.w if k.startswith("mtp.")]) == 15
    assert loaded.draft is None and loaded.heads["mtp"] is not None and loaded.heads["mtp"].raw_norms


def test_the_final_tap_is_the_states_mlx_lms_head_reads(loaded):
    target = loaded.target
    logits, features = target(mx.array([PROMPT]), tap_ids=(FINAL_TAP,), last_only=True)
    assert features.shape == (1, len(PROMPT), target.args.hidden_size) and logits.shape[1] == 1
    full, _ = target(mx.array([PROMPT]))
    assert mx.allclose(target.model_head_logits(features), full, atol=1e-5).item()
    assert mx.allclose(logits[:, -1], full[:, -1], atol=1e-5).item()


def test_one_mtp_step_gives_the_numpy_restatements_logits(variant_pair):
    target_dir, loaded = variant_pair
    target, mtp = loaded.target, loaded.heads["mtp"]
    hidden = final_hidden(target, PROMPT)
    nxt = PROMPT[1:] + [77]  # entry t pairs h_t with the token at t + 1
    out = mtp(target.embed(mx.array([nxt])), hidden, mtp.make_cache())
    ours = np.array(target.lm_head_logits(out)[0])
    expected = MTPReference(target_dir).logits(nxt, np.array(hidden[0]))
    assert np.abs(ours - expected).max() < 1e-4 * max(1.0, np.abs(expected).max())


def test_a_chained_proposal_is_the_restatements_chain_and_leaves_only_committed_entries(variant_pair):
    target_dir, loaded = variant_pair
    target, mtp = loaded.target, loaded.heads["mtp"]
    anchor = 77
    proposer = MTPProposer(mtp, target, prompt=PROMPT, greedy=True, temperature=1.0, block_size=4)
    proposer.extend(final_hidden(target, PROMPT))
    proposer.commit([anchor])
    proposal = proposer.propose(mx.array([anchor]), position=len(PROMPT), num_tokens=4)
    expected = MTPReference(target_dir).greedy_chain(PROMPT[1:] + [anchor], np.array(final_hidden(target, PROMPT)[0]), 4)
    assert proposal.tokens[0].tolist() == expected
    assert all(c.offset == len(PROMPT) for c in proposer.cache)  # the 3 chained entries were trimmed


class Injecting(Proposer):
    """The real MTP proposer runs every round (its chain, its trims), but the block verified is the reference
    continuation with one wrong token in most rounds: partial acceptances of every length."""

    def __init__(self, inner: MTPProposer, reference: list[int], prompt_len: int, vocab: int):
        self.inner, self.reference, self.prompt_len, self.vocab = inner, reference, prompt_len, vocab
        self.tap_ids, self.block_size = inner.tap_ids, inner.block_size
        self.rng = random.Random(0)

    def extend(self, features):
        self.inner.extend(features)

    def commit(self, tokens):
        self.inner.commit(tokens)

    def propose(self, anchor, *, position, num_tokens):
        mx.eval(self.inner.propose(anchor, position=position, num_tokens=num_tokens).tokens)
        start = position - self.prompt_len + 1
        tokens = list(self.reference[start : start + num_tokens])
        if self.rng.random() < 0.8:
            k = self.rng.randrange(num_tokens)
            tokens[k] = (tokens[k] + 1) % self.vocab
        return Proposal(tokens=mx.array([tokens], dtype=mx.int32))


def mlx_lm_greedy(target: Path, prompt: list[int], max_tokens: int) -> list[int]:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(target))
    tokenizer.eos_token_ids = []
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]


def test_greedy_mtp_speculation_is_mlx_lms_generate(family_pair):
    target_dir, loaded = family_pair
    reference = mlx_lm_greedy(target_dir, PROMPT, 50)
    steps = speculative_steps(loaded.target, MTPProposer(loaded.heads["mtp"], loaded.target, prompt=PROMPT, greedy=True, temperature=1.0),
                              PROMPT, sampler=Sampler(), speculation=FIXED)  # fmt: skip
    assert sampled_prefix(steps, 50, Counter()) == tuple(reference)
    # through the API: lookup on (the default), so the MTP proposer runs inside the Chooser
    result = mlx_dspark.generate(prepare_model(loaded, RunSettings(ignore_eos=True)), PROMPT, max_tokens=50, max_draft_tokens=3)
    assert result.tokens == reference and result.rounds > 0


def test_after_partial_acceptances_the_mtp_cache_holds_exactly_the_committed_entries(target_dir, loaded):
    target, mtp = loaded.target, loaded.heads["mtp"]
    reference = mlx_lm_greedy(target_dir, PROMPT, 48)
    inner = MTPProposer(mtp, target, prompt=PROMPT, greedy=True, temperature=1.0)
    proposer = Injecting(inner, reference, len(PROMPT), target.args.vocab_size)
    stats = Counter()
    tokens = sampled_prefix(speculative_steps(target, proposer, PROMPT, sampler=Sampler(), speculation=FIXED), 40, stats)
    assert tokens == tuple(reference[:40]) and stats["rejected"] >= stats["rounds"] // 2 and stats["accepted"] > 10
    inner.flush()
    n = inner.entries
    sequence = inner.tokens
    fresh = mtp.make_cache()
    mtp(target.embed(mx.array([sequence[1 : n + 1]])), final_hidden(target, sequence[:n]), fresh)
    for live, cold in zip(inner.cache, fresh):
        assert live.offset == cold.offset == n
        assert mx.allclose(live.keys[..., :n, :], cold.keys[..., :n, :], atol=1e-4).item()
        assert mx.allclose(live.values[..., :n, :], cold.values[..., :n, :], atol=1e-4).item()


# -- sampled: the target's exact distribution ----------------------------------------------------------

VOCAB = 8
CHI_PROMPT = [1, 5, 2, 7, 3]
RUNS = 300
DRAWS = 1500
CHI_SAMPLER = Sampler(temperature=0.7)


@pytest.fixture(scope="module")
def tiny_vocab_pair():
    """An 8-token qwen3_5 target and its MTP layers, random weights (embeddings large so the context matters)."""
    from mlx.utils import tree_flatten, tree_unflatten

    from mlx_dspark.models.target import mlx_lm as mlx_lm_target
    from mlx_dspark.models.heads.mtp.qwen3_5 import MTP, MTPArgs
    from mlx_dspark.testing.mlx_lm_checkpoints import _random
    from mlx_dspark.testing.mtp_tiny import tiny_qwen3_5_mtp_config

    config = tiny_qwen3_5_mtp_config({"bos": 1, "eos": 2, "pad": 0}, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                     num_attention_heads=2, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=1,
                                     linear_key_head_dim=16, linear_value_head_dim=16)  # fmt: skip
    rng = np.random.default_rng(5)
    target = mlx_lm_target.from_config(config)
    target.update(tree_unflatten([(n, mx.array(_random(rng, n, tuple(p.shape)) * (30.0 if "embed" in n else 1.0)))
                                  for n, p in tree_flatten(target.parameters())]))  # fmt: skip
    mlx_lm_target.probe_target(target)
    mtp = MTP(MTPArgs.from_dict(config), raw_norms=False)
    mtp.update(tree_unflatten([(n, mx.array(_random(rng, n, tuple(p.shape)))) for n, p in tree_flatten(mtp.parameters())]))
    mx.eval(target.parameters(), mtp.parameters())
    return target, mtp


def test_sampled_mtp_speculation_matches_the_exact_target_distribution(tiny_vocab_pair):
    target, mtp = tiny_vocab_pair
    make = lambda: MTPProposer(mtp, target, prompt=CHI_PROMPT, greedy=False, temperature=CHI_SAMPLER.temperature)  # noqa: E731
    assert_chain_sampling_is_exact(target, make, sampler=CHI_SAMPLER, speculation=FIXED, runs=RUNS, seed=11)


def test_sampled_mtp_drafts_are_drawn_from_the_distributions_they_report(tiny_vocab_pair):
    """What sampled acceptance needs of a proposer: each draft is a draw from its reported q (the first
    position's q is fixed by the state; the second's, given the first draw, is averaged over the draws)."""
    from tests.test_lossless_sampling import chi_square_p_value

    target, mtp = tiny_vocab_pair
    proposer = MTPProposer(mtp, target, prompt=CHI_PROMPT, greedy=False, temperature=CHI_SAMPLER.temperature)
    _, features = target(mx.array([CHI_PROMPT]), tap_ids=(FINAL_TAP,))
    proposer.extend(features)
    proposer.commit([4])
    first, second, q2 = np.zeros(VOCAB), np.zeros(VOCAB), np.zeros(VOCAB)
    mx.random.seed(3)
    for _ in range(DRAWS):  # the state is the same every time: the chained entries are trimmed after each
        proposal = proposer.propose(mx.array([4]), position=len(CHI_PROMPT), num_tokens=2)
        tokens, probs = proposal.tokens[0].tolist(), np.array(proposal.draft_probs[0], dtype=np.float64)
        first[tokens[0]] += 1
        second[tokens[1]] += 1
        q2 += probs[1] / DRAWS
    q1 = probs[0]
    assert chi_square_p_value(first, q1 / q1.sum()) > 1e-4
    assert chi_square_p_value(second, q2 / q2.sum()) > 1e-4
    assert all(c.offset == len(CHI_PROMPT) for c in proposer.cache)


# -- loading, conversion, refusals, the command line -----------------------------------------------------


def test_convert_keeps_the_mtp_layers_and_the_conversion_loads_the_same_layers(family_pair, tmp_path):
    from mlx.utils import tree_flatten

    from mlx_dspark.loading.convert import convert

    target_dir, loaded = family_pair
    out = convert(target_dir, tmp_path / "mlx", log=lambda _: None)
    converted = mlx_dspark.load(str(out), draft="mtp")
    assert not converted.heads["mtp"].raw_norms  # norms written in MLX form, with the conv kernels moved
    ours, theirs = dict(tree_flatten(loaded.heads["mtp"].parameters())), dict(tree_flatten(converted.heads["mtp"].parameters()))
    assert ours.keys() == theirs.keys() and all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)


def test_a_target_without_mtp_tensors_says_how_to_get_them(tmp_path):
    bare = write_tiny_qwen3_5_mtp_target(tmp_path / "bare", mtp=False)
    with pytest.raises(ValueError, match=r"no mtp\.\* tensors.*mlx_dspark\.convert"):
        mlx_dspark.load(str(bare), draft="mtp")


def _two_layer_targets() -> dict:
    from mlx_dspark.testing.mtp_deepseek_tiny import write_tiny_nextn_target
    from mlx_dspark.testing.mtp_mimo_tiny import write_tiny_mimo_target
    from mlx_dspark.testing.mtp_nemotron_h_tiny import write_tiny_nemotron_h_target
    from mlx_dspark.testing.mtp_qwen3_next_tiny import write_tiny_qwen3_next_target

    field = "num_nextn_predict_layers"
    return {  # family -> (writer of a target declaring 2 MTP layers, the field the line must name)
        "qwen3_5": (lambda p: write_tiny_qwen3_5_mtp_target(p, mtp_layers=2), "text_config.mtp_num_hidden_layers"),
        "mimo": (lambda p: write_tiny_mimo_target(p, mtp_layers=2), field),
        "deepseek_v3": (lambda p: write_tiny_nextn_target(p, family="deepseek_v3", nextn_layers=2), field),
        "glm4_moe": (lambda p: write_tiny_nextn_target(p, family="glm4_moe", nextn_layers=2), field),
        "qwen3_next": (lambda p: write_tiny_qwen3_next_target(p, mtp=False, mtp_layers=2), field),
        "nemotron_h": (lambda p: write_tiny_nemotron_h_target(p, mtp=False, mtp_layers=2), field),
    }


@pytest.mark.parametrize("family", ["qwen3_5", "mimo", "deepseek_v3", "glm4_moe", "qwen3_next", "nemotron_h"])
def test_more_than_one_mtp_layer_is_refused_in_one_line_naming_the_file_and_field(family, tmp_path):
    """Every published checkpoint of these families has one (Qwen3.5's readings differ too: vLLM's step k runs
    layer k mod n, mlx-vlm's every layer in order); --draft auto does not take layers load() refuses."""
    from mlx_dspark.loading.draft_registry import resolve_auto_draft

    write, field = _two_layer_targets()[family]
    two = write(tmp_path / "two")
    with pytest.raises(ValueError, match=rf"two/config\.json: draft 'mtp': {re.escape(field)} is 2; only 1 is supported") as refused:
        mlx_dspark.load(str(two), draft="mtp")
    assert "\n" not in str(refused.value)
    assert resolve_auto_draft(str(two))[0] is None


def test_a_target_that_declares_no_mtp_layers_is_one_clear_error(tmp_path):
    from mlx_dspark.testing.mlx_lm_checkpoints import write_tiny_mlx_lm_target

    plain = write_tiny_mlx_lm_target(tmp_path / "llama", family="llama")
    with pytest.raises(ValueError, match="model_type 'llama' has no MTP layers"):
        mlx_dspark.load(str(plain), draft="mtp")


def test_draft_auto_picks_mtp_for_a_target_carrying_the_layers_and_no_known_draft(target_dir, tmp_path):
    from mlx_dspark.loading.draft_registry import resolve_auto_draft

    reference, line = resolve_auto_draft(str(target_dir))
    assert reference == "mtp" and "MTP layers" in line
    bare = write_tiny_qwen3_5_mtp_target(tmp_path / "bare", mtp=False)
    assert resolve_auto_draft(str(bare))[0] is None


def test_generate_cli_with_draft_mtp(target_dir, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.generate", "--model", str(target_dir), "--draft", "mtp", "--prompt", "Hello",
         "--max-tokens", "12", "--max-draft-tokens", "3", "--json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "MLX_DSPARK_COST_DIR": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["speculative"] is True and result["acceptance_lengths"]
    plain = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.generate", "--model", str(target_dir), "--prompt", "Hello", "--max-tokens", "12", "--json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "MLX_DSPARK_COST_DIR": str(tmp_path)},
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout.strip().splitlines()[-1])["tokens"] == result["tokens"]


def test_a_single_chained_head_is_not_healed_as_a_block_draft(loaded, monkeypatch, tmp_path):
    """The healer's round model is a block draft's (one draft block + a verify): a chain's rounds cost
    draft_ms + k x draft_step_ms, so its cached curve must come back as measured, not with every draft
    step charged to its draft block."""
    import json

    from mlx_dspark.engine.costs import heal as cost_heal

    from mlx_dspark.engine.costs import probe as cost_probe

    monkeypatch.setattr(cost_heal, "ENABLED", True)
    monkeypatch.setenv(cost_probe.COST_DIR_ENV, str(tmp_path))  # a cost cache of its own (nothing reaches later tests)
    mlx_dspark.generate(loaded, PROMPT, max_tokens=40)  # auto length, the default, over the chain's curve
    cached = json.loads(cost_probe.cost_curve_path(loaded, head="mtp").read_text())
    assert "healing" not in cached and cached["draft_block_ms"] == 0.0  # the flat synthetic curve (tests)
