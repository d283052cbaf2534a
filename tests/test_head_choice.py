"""Several draft heads, one round's proposal (issue 35.4, engine/policy/head_choice.py): each round the head with
the most expected tokens per millisecond proposes (its own acceptance so far and its own costs), every
head sees every committed position, and the output stays plain decoding's token for token."""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark
from mlx_dspark.engine.proposers.base import Proposer
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.engine.round.decode import speculative_steps
from mlx_dspark.engine.policy.draft_length import FixedLength
from mlx_dspark.engine.policy.head_choice import HeadChoice
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.engine.costs.curve import CostCurve
from mlx_dspark.testing.mtp_tiny import write_tiny_qwen3_5_mtp_target
from mlx_dspark.testing.tiny import write_tiny_draft
from tests.engine_helpers import OracleProposer, greedy_reference, make_target

PROMPT = [5, 17, 33, 5, 17, 60, 2, 9, 11, 40]
TOKENS = 120


def _errors(rate: float, seed: int):
    """Draft positions 1..7 corrupted independently with probability 1 - rate (deterministic per round)."""
    return lambda round_index: [k for k in range(1, 8) if random.Random(seed * 10_007 + round_index * 31 + k).random() > rate]


class TapRecorder(OracleProposer):
    """An oracle head that also keeps the features it was given (to check its own columns)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.features: list[mx.array] = []

    def extend(self, features: mx.array) -> None:
        super().extend(features)
        self.features.append(features)


def _run(target, heads: dict, curves: dict, *, cap: int = 4) -> tuple[list[int], HeadChoice]:
    choice = HeadChoice(heads, {name: FixedLength(cap) for name in heads}, curves)
    tokens: list[int] = []
    for step in speculative_steps(target, choice, PROMPT, sampler=Sampler(), draft_length=choice):
        tokens.extend(step.tokens)
        if len(tokens) >= TOKENS:
            break
    return tokens[:TOKENS], choice


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", seed=2, tie=True, embedding_scale=0.3)


@pytest.fixture(scope="module")
def reference(target):
    return greedy_reference(target, PROMPT, TOKENS + 16)


def test_the_head_that_is_accepted_more_proposes_most_rounds_and_the_output_is_plain_decodings(target, reference):
    vocab = target.args.vocab_size
    heads = {"good": OracleProposer(reference, len(PROMPT), vocab, errors=_errors(0.9, 1), tap_ids=(0,)),
             "bad": OracleProposer(reference, len(PROMPT), vocab, errors=_errors(0.2, 2), tap_ids=(1,))}  # fmt: skip
    flat = CostCurve(draft_ms=1.0, verify_ms=(1.0,) * 8)
    tokens, choice = _run(target, heads, {"good": flat, "bad": flat})
    assert tokens == reference[:TOKENS]
    assert choice.chosen["good"] > 3 * choice.chosen["bad"] and choice.chosen["bad"] >= 1, dict(choice.chosen)
    assert choice.acceptance["good"][0] > choice.acceptance["bad"][0]


def test_a_cheaper_head_wins_over_a_slightly_better_expensive_one(target, reference):
    vocab = target.args.vocab_size
    heads = {"block": OracleProposer(reference, len(PROMPT), vocab, errors=_errors(0.8, 3)),
             "chain": OracleProposer(reference, len(PROMPT), vocab, errors=_errors(0.9, 4))}  # fmt: skip
    verify = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7)
    curves = {"block": CostCurve(draft_ms=0.3, verify_ms=verify),  # one forward for the whole block
              "chain": CostCurve(draft_ms=0.0, draft_step_ms=1.0, verify_ms=verify)}  # one forward per draft  # fmt: skip
    tokens, choice = _run(target, heads, curves)
    assert tokens == reference[:TOKENS]
    assert choice.chosen["block"] > 3 * choice.chosen["chain"], dict(choice.chosen)
    # the same heads at equal costs: the better one proposes
    flat = CostCurve(draft_ms=0.3, verify_ms=verify)
    fresh = {name: OracleProposer(reference, len(PROMPT), vocab, errors=_errors(rate, seed))
             for name, rate, seed in (("block", 0.8, 3), ("chain", 0.9, 4))}  # fmt: skip
    _, equal = _run(target, fresh, {"block": flat, "chain": flat})
    assert equal.chosen["chain"] > equal.chosen["block"], dict(equal.chosen)


def test_each_head_gets_its_own_tapped_columns_of_every_committed_position(target, reference):
    vocab = target.args.vocab_size
    heads = {"a": TapRecorder(reference, len(PROMPT), vocab, errors=_errors(0.7, 5), tap_ids=(2, 0)),
             "b": TapRecorder(reference, len(PROMPT), vocab, errors=_errors(0.7, 6), tap_ids=(0, -1))}  # fmt: skip
    flat = CostCurve(draft_ms=1.0, verify_ms=(1.0,) * 8)
    tokens, choice = _run(target, heads, {"a": flat, "b": flat})
    assert choice.tap_ids == (2, 0, -1)
    _, full = target(mx.array([PROMPT + tokens]), tap_ids=(2, 0, -1))
    hidden = target.args.hidden_size
    for head, columns in ((heads["a"], (0, 1)), (heads["b"], (1, 2))):
        got = mx.concatenate(head.features, axis=1)  # every committed position, in order
        want = mx.concatenate([full[..., c * hidden : (c + 1) * hidden] for c in columns], axis=-1)[:, : got.shape[1]]
        assert got.shape[1] >= len(PROMPT) + TOKENS - 8
        assert mx.allclose(got, want, atol=1e-4).item()


def test_a_choice_needs_two_heads_each_with_a_policy():
    head = OracleProposer([1, 2, 3], 1, 8, errors=lambda r: [])
    with pytest.raises(ValueError, match="two or more heads"):
        HeadChoice({"one": head}, {"one": FixedLength(2)}, {"one": None})


@pytest.fixture(scope="module")
def dspark_and_mtp(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("heads")
    target = write_tiny_qwen3_5_mtp_target(root / "target", seed=0)
    draft = write_tiny_draft(root / "draft", target_path=target, seed=1, layer_family="qwen3", include_shared=False)
    return target, draft


def test_a_dspark_draft_and_the_targets_mtp_layers_load_together_and_stay_lossless(dspark_and_mtp, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_COST_DIR", str(tmp_path / "cost"))
    target, draft = dspark_and_mtp
    pair = mlx_dspark.load(str(target), draft=f"{draft},mtp")
    assert pair.draft is not None and pair.heads["mtp"] is not None
    pair = prepare_model(pair, RunSettings(ignore_eos=True))
    plain = mlx_dspark.generate(pair, PROMPT, max_tokens=200, speculative=False).tokens
    assert len(plain) == 200
    for options in ({}, {"max_draft_tokens": 3, "lookup": "off"}):  # auto over both measured curves; fixed
        assert mlx_dspark.generate(pair, PROMPT, max_tokens=200, **options).tokens == plain, options
    # each head's curve is cached apart (tests: synthetic flat curves, conftest.py)
    assert len(list((tmp_path / "cost" / "in-process").glob("*.json"))) == 2
    with pytest.raises(ValueError, match="are both a DSpark / DFlash block draft; give at most one draft of each kind"):
        mlx_dspark.load(str(target), draft=[str(draft), str(draft), "mtp"])


def test_the_mtp_heads_curve_charges_each_chained_draft(dspark_and_mtp, monkeypatch):
    """`measure_mtp_curve` for real on the chain (its verify widths stubbed: tests time no target forwards)."""
    from mlx_dspark.engine.costs import probe as cost_probe

    monkeypatch.undo()  # conftest's synthetic curves: this test measures the chain itself
    monkeypatch.setattr(cost_probe, "measure_cost_curve", lambda target, draft, **kw: CostCurve.flat(max_width=8).with_context(32))
    pair = mlx_dspark.load(str(dspark_and_mtp[0]), draft="mtp")
    curve = cost_probe.measure_chain_curve(pair.target, pair.heads["mtp"], head="mtp", repeats=2, chain=4)
    assert curve.draft_step_ms > 0 and curve.round_ms(3) == pytest.approx(curve.draft_ms + 3 * curve.draft_step_ms + 1.0)


def test_an_eagle3_draft_and_the_targets_mtp_layers_are_two_heads_too(dspark_and_mtp, tmp_path):
    from mlx_dspark.testing.eagle3_tiny import write_eagle3_draft

    target = dspark_and_mtp[0]
    eagle = write_eagle3_draft(tmp_path / "eagle3", target_path=target, seed=3, include_embedding=False)
    pair = mlx_dspark.load(str(target), draft=f"{eagle},mtp")
    assert pair.heads["eagle3"] is not None and pair.heads["mtp"] is not None and pair.draft is None
    pair = prepare_model(pair, RunSettings(ignore_eos=True))
    plain = mlx_dspark.generate(pair, PROMPT, max_tokens=120, speculative=False).tokens
    spec = mlx_dspark.generate(pair, PROMPT, max_tokens=120, max_draft_tokens=3, lookup="off")
    assert spec.tokens == plain and spec.rounds < 120


def test_a_block_draft_an_eagle3_draft_and_the_mtp_layers_are_three_heads(dspark_and_mtp, tmp_path, monkeypatch):
    """Two draft files and the MTP layers: three heads, each with its own cached curve (the EAGLE-3 head's keyed
    by its own file), greedy output plain decoding's; the block draft's options apply to the block draft."""
    from mlx_dspark.engine.costs.probe import cache_key
    from mlx_dspark.engine.proposers import loaded_heads
    from mlx_dspark.testing.eagle3_tiny import write_eagle3_draft

    monkeypatch.setenv("MLX_DSPARK_COST_DIR", str(tmp_path / "cost"))
    target, draft = dspark_and_mtp
    eagle = write_eagle3_draft(tmp_path / "eagle3", target_path=target, seed=3, include_embedding=False)
    pair = mlx_dspark.load(str(target), draft=f"{draft},{eagle},mtp", draft_tap_ids=[0, 2])
    assert loaded_heads(pair) == ["draft", "eagle3", "mtp"]
    assert pair.draft_path == Path(draft) and pair.head_source("eagle3")[0] == Path(eagle)
    assert pair.draft.args.target_layer_ids == (0, 2)
    alone = mlx_dspark.load(str(target), draft=str(eagle))
    assert cache_key(pair, head="eagle3") == cache_key(alone, head="eagle3") != cache_key(pair, head="draft")
    pair = prepare_model(pair, RunSettings(ignore_eos=True))
    plain = mlx_dspark.generate(pair, PROMPT, max_tokens=120, speculative=False).tokens
    spec = mlx_dspark.generate(pair, PROMPT, max_tokens=120, max_draft_tokens=3, lookup="off")
    assert spec.tokens == plain and spec.rounds < 120
    assert len(list((tmp_path / "cost" / "in-process").glob("*.json"))) == 3
    with pytest.raises(ValueError, match="both an EAGLE-3 draft"):
        mlx_dspark.load(str(target), draft=f"{eagle},{eagle}")
    with pytest.raises(ValueError, match="export one draft at a time"):
        from mlx_dspark.export.source import _one_draft

        _one_draft(f"{draft},{eagle}")


def test_calibrate_shows_each_heads_own_curve(dspark_and_mtp, tmp_path, monkeypatch):
    """`calibrate` on a pair of two heads: the block draft's curve, then the MTP chain's with its cost per
    draft (measured for real on the chain; verify widths stubbed: tests time no target forwards)."""
    from typer.testing import CliRunner

    from mlx_dspark.cli.calibrate import app
    from mlx_dspark.engine.costs import probe as cost_probe

    monkeypatch.undo()  # conftest's synthetic curves: the chain is measured here
    monkeypatch.setenv(cost_probe.COST_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(cost_probe, "measure_cost_curve", lambda target, draft, **kw: CostCurve.flat(max_width=8).with_context(32))
    target, draft = dspark_and_mtp
    result = CliRunner().invoke(app, ["--model", str(target), "--draft", f"{draft},mtp"])
    assert result.exit_code == 0, result.output
    assert "context 32: draft block" in result.output and "head mtp:" in result.output
    assert "ms per draft" in result.output.split("head mtp:")[1]
    assert len(list(tmp_path.glob("*.json"))) == 2


class _Estimating(Proposer):
    """A draft that says what its round would give and cost (as HeadChoice does)."""

    tap_ids, block_size = (), 7

    def __init__(self, estimate):
        self.estimate = estimate

    def round_estimate(self, length):
        return self.estimate


def test_lookup_is_weighed_against_the_round_heads_own_estimate():
    """choose.Chooser: a lookup block of a repeated context against the draft head's own (expected tokens, ms):
    a cheap, well-accepted head's block wins the round, a dear or poorly accepted one loses it to lookup."""
    from mlx_dspark.engine.policy.proposal_choice import Chooser, RoundCost
    from mlx_dspark.engine.proposers.lookup import ContextIndex

    cost = RoundCost(draft=5.0, verify=(10.0, 10.5, 11.0, 11.5, 12.0))  # the pair's first head: a dear block
    context = list(range(30)) + list(range(4))  # a 4-token match: lookup's block of 5 scores 0.22 tokens per ms
    plans = {}
    for name, estimate in (("cheap", (3.5, 1.0)), ("dear", (3.5, 80.0)), ("poor", (0.05, 1.0)), ("unknown", None)):
        chooser = Chooser(draft=_Estimating(estimate), index=ContextIndex(context, ngram_sizes=(4,)), cost=cost)
        plans[name] = chooser.plan(num_tokens=4, room=40)
    assert plans["cheap"].draft_size == 4
    assert plans["dear"].draft_size == 0 and plans["dear"].proposal.source == "lookup"
    assert plans["poor"].draft_size == 0 and plans["poor"].proposal.source == "lookup"
    assert plans["unknown"].draft_size == 0  # no estimate: the chooser's own prior rate and the pair's dear block


def test_the_round_estimate_is_the_chosen_heads_acceptance_and_cost():
    block = CostCurve(draft_ms=6.0, verify_ms=(10.0,) * 9, context=32)
    chain = CostCurve(draft_ms=0.5, verify_ms=(10.0,) * 9, context=32, draft_step_ms=1.5)
    heads = {name: OracleProposer([], prompt_len=0, vocab_size=8, errors=lambda r: []) for name in ("block", "chain")}
    choice = HeadChoice(heads,
                        {"block": FixedLength(4), "chain": FixedLength(3)}, {"block": block, "chain": chain})
    assert choice.round_estimate(3) is None  # no head chosen yet
    choice.acceptance["chain"] = [0.9, 0.5, 0.1] + [0.0] * (len(choice.acceptance["chain"]) - 3)
    choice.acceptance["block"] = [0.1] * len(choice.acceptance["block"])
    assert choice.next_length(position=0) == 3 and choice._current == "chain"
    expected, ms = choice.round_estimate(3)
    assert ms == pytest.approx(0.5 + 3 * 1.5) and expected == pytest.approx(0.9 + 0.9 * 0.5 + 0.9 * 0.5 * 0.1)


def test_a_chained_heads_steps_are_charged_when_lookup_is_weighed_against_it():
    """One chained head beside lookup (no HeadChoice): its curve's cost per draft counts against its block (the
    chooser took a chain for free: RoundCost read the curve's draft_ms alone, 0 for a chain)."""
    from mlx_dspark.engine.policy.proposal_choice import SourceRate, Chooser, RoundCost
    from mlx_dspark.engine.proposers.lookup import ContextIndex

    context = list(range(30)) + list(range(4))
    sizes = {}
    for step_ms in (0.0, 5.0):
        curve = CostCurve(draft_ms=0.0, verify_ms=(10.0, 10.5, 11.0, 11.5, 12.0, 12.5, 13.0, 13.5, 14.0), context=32,
                          draft_step_ms=step_ms)  # fmt: skip
        chooser = Chooser(draft=_Estimating(None), index=ContextIndex(context, ngram_sizes=(4,)), cost=RoundCost.from_curve(curve))
        chooser.draft_rate = SourceRate(hits=9.0, misses=1.0)
        sizes[step_ms] = chooser.plan(num_tokens=4, room=40).draft_size
    assert sizes == {0.0: 4, 5.0: 0}
