"""Confidence-scheduled verification: the rule, the cost curve, losslessness, the options and the CLI.

No test measures time for correctness: curves are injected (flat, or a steep CPU-like slope).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

import mlx_dspark
from mlx_dspark.cli.generate import app as generate_app
from mlx_dspark.engine.round.decode import speculative_steps
from mlx_dspark.engine.options import OptionError, SpeculationOptions
from mlx_dspark.engine.proposers.base import Proposal
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.engine.costs.probe import cost_curve_for, measure_cost_curve
from mlx_dspark.engine.proposers.lookup import LOOKUP_MAX_TOKENS
from mlx_dspark.engine.costs.curve import CostCurve, scheduled_length
from mlx_dspark.testing.tiny import write_tiny_draft
from tests.engine_helpers import OracleProposer, make_draft, make_target
from tests.test_lossless_sampling import (
    MIN_P_VALUE,
    PROMPT,
    RUNS,
    SAMPLERS,
    VOCAB,
    RandomDraftProposer,
    chi_square_p_value,
    exact_distribution,
    marginals,
    to_array,
)

REPO = Path(__file__).resolve().parents[1]
# A CPU-like curve: every extra verified token costs 30% of a one-token forward, the draft 40%.
STEEP = CostCurve(draft_ms=0.4, verify_ms=tuple(1.0 + 0.3 * n for n in range(8)))
FLAT = CostCurve.flat(max_width=8)


def rate(confidence, curve, length):
    prefix, expected = 1.0, 1.0
    for c in confidence[:length]:
        prefix *= c
        expected += prefix
    return expected / curve.round_ms(length)


# -- the rule ---------------------------------------------------------------------------------------


def test_flat_curve_admits_every_position_up_to_the_first_zero_confidence():
    rng = random.Random(0)
    for _ in range(500):
        confidence = [rng.uniform(1e-6, 1.0) for _ in range(7)]
        assert scheduled_length(confidence, FLAT) == 7
        zero_at = rng.randrange(7)
        confidence[zero_at] = 0.0
        assert scheduled_length(confidence, FLAT) == zero_at
    # even where E(l) + a rounds to E(l) in floating point, a(l) > 0 is admitted on a flat curve
    assert scheduled_length([1e-30] * 7, FLAT) == 7


def test_scheduled_length_stops_at_the_first_position_that_does_not_raise_the_rate():
    rng = random.Random(1)
    cut_lengths = Counter()
    for _ in range(500):
        confidence = [rng.random() for _ in range(7)]
        steps = sorted(rng.uniform(0, 1) for _ in range(8))
        curve = CostCurve(draft_ms=rng.uniform(0, 1), verify_ms=tuple(1 + s for s in steps))
        length = scheduled_length(confidence, curve)
        cut_lengths[length] += 1
        rates = [rate(confidence, curve, n) for n in range(8)]
        assert all(rates[n + 1] > rates[n] for n in range(length)), "every admitted position raised the rate"
        assert length == 7 or rates[length + 1] <= rates[length] * (1 + 1e-12), "it stopped where the rate did not rise"
    assert len(cut_lengths) >= 4, f"the random cases should cut at many lengths, got {sorted(cut_lengths)}"


def test_scheduled_length_on_a_steep_curve_by_hand():
    # admit 1 iff a1 * T0 > E0 * (T1 - T0): a1 * 1.4 > 0.3, a1 > 0.214
    assert scheduled_length([0.2, 0.99], STEEP) == 0
    assert scheduled_length([0.25, 0.5], STEEP) == 1  # then a2 = 0.125, E = 1.25: 0.125 * 1.7 > 1.25 * 0.3 fails
    assert scheduled_length([0.25, 0.99], STEEP) == 2  # a2 = 0.2475: 0.2475 * 1.7 > 0.375
    assert scheduled_length([0.95] * 7, STEEP) == 7


def test_scheduled_length_needs_a_curve_as_wide_as_the_round():
    with pytest.raises(ValueError, match="widths up to 3"):
        scheduled_length([0.5] * 3, CostCurve.flat(max_width=3))


# -- the cost curve ---------------------------------------------------------------------------------


def test_cost_curve_reads_the_benchmarks_cost_curve_json_and_pools_noise_bumps():
    path = REPO / "benchmarks" / "results" / "cpu-cost-curve-f32-quiet.json"
    raw = json.loads(path.read_text())
    curve = CostCurve.from_file(path)
    assert curve.max_width == len(raw["verify_ms"]) == 8
    assert curve.draft_ms == raw["draft_block_ms"]
    assert all(b >= a for a, b in zip(curve.verify_ms, curve.verify_ms[1:]))
    assert sum(curve.verify_ms) == pytest.approx(sum(raw["verify_ms"].values()))  # pooling keeps the mean
    assert curve.source == str(path)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("{not json", "not valid JSON"),
        ('{"draft_block_ms": 1.0, "verify_ms": {"1": 1.0, "3": 2.0}}', "without gaps"),
        ('{"verify_ms": {"1": 1.0}}', "draft_block_ms"),
    ],
)
def test_cost_curve_file_errors_name_the_file(tmp_path, content, message):
    path = tmp_path / "cost_curve.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        CostCurve.from_file(path)
    assert str(path) in str(err.value)


def test_cost_curve_rejects_decreasing_or_negative_times():
    with pytest.raises(ValueError, match="must not decrease"):
        CostCurve(draft_ms=0.0, verify_ms=(2.0, 1.0))
    with pytest.raises(ValueError, match="finite times"):
        CostCurve(draft_ms=-1.0, verify_ms=(1.0,))


def test_cost_curve_is_measured_once_then_read_from_the_disk_cache(tiny_spark_pair, tmp_path):
    pair = mlx_dspark.load(str(tiny_spark_pair[0]), draft=str(tiny_spark_pair[1]))
    calls = []

    def fake_measure(target, draft):
        calls.append(1)
        return CostCurve(draft_ms=2.0, verify_ms=(1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5))

    first = cost_curve_for(pair, cache_dir=tmp_path, measure=fake_measure)
    second = cost_curve_for(pair, cache_dir=tmp_path, measure=fake_measure)
    assert calls == [1]
    assert first.verify_ms == second.verify_ms == (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5)
    assert len(list(tmp_path.glob("*.json"))) == 1
    # another dtype of the same pair is another entry
    pair.target.set_dtype(mx.bfloat16)
    cost_curve_for(pair, cache_dir=tmp_path, measure=fake_measure)
    assert calls == [1, 1] and len(list(tmp_path.glob("*.json"))) == 2


def test_quick_measurement_covers_every_verify_width_of_the_block(tiny_spark_pair):
    pair = mlx_dspark.load(str(tiny_spark_pair[0]), draft=str(tiny_spark_pair[1]))
    curve = measure_cost_curve(pair.target, pair.draft, context=24, repeats=1)
    assert curve.max_width == max(int(pair.draft.args.block_size) + 1, LOOKUP_MAX_TOKENS + 1)  # lookup's widths too
    assert curve.draft_ms > 0 and all(v > 0 for v in curve.verify_ms)


# -- options ----------------------------------------------------------------------------------------


def test_speculation_options_validate_the_schedule_and_the_curve_width():
    with pytest.raises(OptionError, match="verify_schedule must be one of fixed, confidence"):
        SpeculationOptions(verify_schedule="adaptive")
    with pytest.raises(OptionError, match="cost_curve must be a schedule.CostCurve"):
        SpeculationOptions(cost_curve={"verify_ms": [1.0]})
    short = SpeculationOptions(verify_schedule="confidence", cost_curve=CostCurve.flat(max_width=4), max_draft_tokens=None)
    with pytest.raises(OptionError, match="widths 1..8"):
        short.draft_length(7)
    # auto stays within the widths its curve covers (draft_length.AutoLength caps itself)
    assert dataclasses.replace(short, max_draft_tokens="auto").draft_length(7) == 7
    assert dataclasses.replace(short, max_draft_tokens=3).draft_length(7) == 3  # the cap also caps the curve needed


# -- losslessness -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["spark2_5", "qwen3"])
def pair(request):
    paths = request.getfixturevalue(f"tiny_{'spark' if request.param == 'spark2_5' else 'qwen3'}_pair")
    return mlx_dspark.load(str(paths[0]), draft=str(paths[1]))


@pytest.mark.parametrize("prompt", ["Hello", "The quick brown fox jumps over the lazy dog. " * 3, list(range(10, 60))])
def test_confidence_schedule_greedy_equals_plain_greedy(pair, prompt):
    plain = mlx_dspark.generate(pair, prompt, max_tokens=60, speculative=False)
    steep = mlx_dspark.generate(pair, prompt, max_tokens=60, verify_schedule="confidence", cost_curve=STEEP)
    assert steep.tokens == plain.tokens
    assert steep.text == plain.text
    capped = mlx_dspark.generate(  # the cap bounds DSpark blocks; lookup blocks (on by default) are sized by their match
        pair, prompt, max_tokens=60, verify_schedule="confidence", cost_curve=FLAT, max_draft_tokens=3, lookup="off"
    )
    assert capped.tokens == plain.tokens
    assert max(capped.proposal_lengths) <= 3  # the per-round maximum is respected


def test_steep_curve_cuts_rounds_and_flat_curve_never_verifies_fewer_than_fixed(pair):
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    fixed = mlx_dspark.generate(pair, prompt, max_tokens=60)
    flat = mlx_dspark.generate(pair, prompt, max_tokens=60, verify_schedule="confidence", cost_curve=FLAT)
    steep = mlx_dspark.generate(pair, prompt, max_tokens=60, verify_schedule="confidence", cost_curve=STEEP)
    # sigmoid confidences are > 0, so on a flat curve every proposed draft is verified, as with "fixed"
    assert flat.proposal_lengths == fixed.proposal_lengths and flat.tokens == fixed.tokens
    # the random draft's confidences (~0.5) make the steep curve cut
    assert min(steep.proposal_lengths) < max(fixed.proposal_lengths)


def test_confidence_schedule_cuts_an_oracle_exactly_where_its_confidence_is_zero(pair):
    prompt = list(range(10, 30))
    reference = mlx_dspark.generate(pair, prompt, max_tokens=80, speculative=False, stop_token_ids=[]).tokens

    class ConfidentOracle(OracleProposer):
        def propose(self, anchor, *, position, num_tokens):
            zero_at = self.rounds % 8  # 1-based position with c = 0 (0: none)
            proposal = super().propose(anchor, position=position, num_tokens=num_tokens)
            confidence = [0.0 if k + 1 == zero_at else 0.9 for k in range(num_tokens)]
            return dataclasses.replace(proposal, confidence=mx.array([confidence]))

    oracle = ConfidentOracle(reference, len(prompt), pair.target.args.vocab_size, errors=lambda r: ())
    result = mlx_dspark.generate(
        pair, prompt, max_tokens=60, proposer=oracle, verify_schedule="confidence", cost_curve=FLAT, stop_token_ids=[]
    )
    assert result.tokens == reference[:60]
    assert len(result.proposal_lengths) > 10
    for round_index, proposed in enumerate(result.proposal_lengths[:-2]):  # the last rounds stop at max_tokens
        zero_at = round_index % 8
        assert proposed == (zero_at - 1 if zero_at else 7), (round_index, result.proposal_lengths)


class ConfidentRandomDraft(RandomDraftProposer):
    """Random drafts whose confidence c(k) depends on x(k - 1) only (like the real head): non-anticipating."""

    def __init__(self, *, greedy: bool, guide: np.ndarray, seed: int = 0):
        super().__init__(greedy=greedy, guide=guide, seed=seed)
        self.confidence_of_previous = np.random.default_rng(seed + 1).uniform(0.05, 0.95, size=VOCAB).astype(np.float32)

    def propose(self, anchor, *, position, num_tokens):
        proposal = super().propose(anchor, position=position, num_tokens=num_tokens)
        previous = mx.concatenate([anchor.reshape(1), proposal.tokens[0, : num_tokens - 1]])
        confidence = mx.array(self.confidence_of_previous)[previous]
        return dataclasses.replace(proposal, confidence=confidence[None])


def scheduled_runs(target, sampler, factory, *, length, seed, curve):
    speculation = SpeculationOptions(verify_schedule="confidence", cost_curve=curve, max_draft_tokens=None)  # full blocks, cut by the schedule
    mx.random.seed(seed)
    outcomes, proposed = Counter(), Counter()
    for _ in range(RUNS):
        tokens = []
        for step in speculative_steps(target, factory(), PROMPT, sampler=sampler, speculation=speculation):
            tokens.extend(step.tokens)
            if step.verified:
                proposed[step.proposed] += 1
            if len(tokens) >= length:
                break
        outcomes[tuple(tokens[:length])] += 1
    return to_array(outcomes, length), proposed


@pytest.fixture(scope="module")
def small_target():
    return make_target("spark2_5", seed=11, vocab_size=VOCAB, layers=2, window=4, embedding_scale=0.5)


# admit position 1 iff a1 > 0.5; position 2 iff a2 > (1 + a1) / 3: every round length 0, 1 and 2 occurs
SMALL_STEEP = CostCurve(draft_ms=0.0, verify_ms=(1.0, 1.5, 2.0))


@pytest.mark.parametrize("drafting", ["sample", "greedy"])
def test_confidence_schedule_sampling_matches_the_exact_target_distribution(small_target, drafting):
    sampler = SAMPLERS["temperature"]
    exact = exact_distribution(small_target, sampler, 3)
    guide = marginals(exact)[1:]
    counts, proposed = scheduled_runs(
        small_target,
        sampler,
        lambda: ConfidentRandomDraft(greedy=drafting == "greedy", guide=guide, seed=6),
        length=3,
        seed=2024,
        curve=SMALL_STEEP,
    )
    assert set(proposed) == {0, 1, 2}, f"the schedule should choose every length, got {dict(proposed)}"
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > MIN_P_VALUE
    for observed, expected in zip(marginals(counts), marginals(exact)):
        assert chi_square_p_value(observed, expected) > MIN_P_VALUE


@pytest.mark.parametrize("family, drafting", [("spark2_5", "sample"), ("qwen3", "greedy")])
def test_confidence_schedule_with_the_real_draft_matches_the_exact_target_distribution(family, drafting):
    window = {"window": 4} if family == "spark2_5" else {}
    target = make_target(family, seed=6 if family == "spark2_5" else 5, vocab_size=VOCAB, layers=4, embedding_scale=0.5, **window)
    draft = make_draft(target, seed=6, markov_head_type="gated" if family == "qwen3" else "vanilla")
    sampler = SAMPLERS["temperature_top_k"]
    exact = exact_distribution(target, sampler, 3)
    counts, proposed = scheduled_runs(
        target,
        sampler,
        lambda: DraftProposer(draft, target, greedy=drafting == "greedy", temperature=sampler.temperature),
        length=3,
        seed=4321,
        curve=STEEP,
    )
    assert len(proposed) >= 2, f"the schedule should vary the length, got {dict(proposed)}"
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > MIN_P_VALUE
    for observed, expected in zip(marginals(counts), marginals(exact)):
        assert chi_square_p_value(observed, expected) > MIN_P_VALUE


def test_an_anticipating_schedule_would_be_caught(small_target):
    """The chi-square test can fail here: judging x(k) by its own draft probability biases sampled drafts."""
    sampler = SAMPLERS["temperature"]
    exact = exact_distribution(small_target, sampler, 3)
    guide = marginals(exact)[1:]

    class Anticipating(RandomDraftProposer):
        def propose(self, anchor, *, position, num_tokens):
            proposal = super().propose(anchor, position=position, num_tokens=num_tokens)
            own = mx.take_along_axis(proposal.draft_probs[0], proposal.tokens[0][:, None], axis=-1)[:, 0]
            return dataclasses.replace(proposal, confidence=(own > 0.15).astype(mx.float32)[None])

    counts, _ = scheduled_runs(
        small_target, sampler, lambda: Anticipating(greedy=False, guide=guide), length=3, seed=7, curve=SMALL_STEEP
    )
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) < 1e-6


# -- errors and the command line --------------------------------------------------------------------


def test_a_draft_without_a_confidence_head_is_refused(tiny_spark_pair, tmp_path):
    target, _ = tiny_spark_pair
    plain_draft = write_tiny_draft(tmp_path / "draft", target_path=target, enable_confidence_head=False)
    pair = mlx_dspark.load(str(target), draft=str(plain_draft))
    with pytest.raises(ValueError, match="needs a draft with a confidence head.*use verify_schedule 'fixed'"):
        mlx_dspark.generate(pair, "Hi", max_tokens=4, verify_schedule="confidence", cost_curve=FLAT)
    result = CliRunner().invoke(
        generate_app, ["--model", str(target), "--draft", str(plain_draft), "--prompt", "Hi", "--verify-schedule", "confidence"]
    )
    assert result.exit_code == 2 and "needs a draft with a confidence head" in result.output


def test_a_proposer_without_confidences_is_refused(pair):
    oracle = OracleProposer([1] * 40, 3, pair.target.args.vocab_size, errors=lambda r: ())
    with pytest.raises(ValueError, match="proposals carry none"):
        mlx_dspark.generate(pair, [5, 6, 7], max_tokens=8, proposer=oracle, verify_schedule="confidence", cost_curve=FLAT)


def test_generate_cli_uses_the_cost_curve_file_and_says_so(tiny_spark_pair, tmp_path):
    target, draft = tiny_spark_pair
    path = tmp_path / "cost_curve.json"
    path.write_text(json.dumps(STEEP.to_json()))
    common = ["--model", str(target), "--draft", str(draft), "--prompt", "Hello there", "--max-tokens", "12", "--json"]
    fixed = CliRunner().invoke(generate_app, common)
    scheduled = CliRunner().invoke(generate_app, [*common, "--verify-schedule", "confidence", "--cost-curve-file", str(path)])
    assert scheduled.exit_code == 0, scheduled.output
    assert f"cost curve: {path}" in scheduled.stderr
    assert json.loads(scheduled.stdout.strip().splitlines()[-1])["tokens"] == json.loads(fixed.stdout.strip().splitlines()[-1])["tokens"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--verify-schedule", "adaptive"], "--verify-schedule: verify_schedule must be one of fixed, confidence"),
        (["--verify-schedule", "confidence", "--cost-curve-file", "/nonexistent/cost.json"], "cost curve file /nonexistent/cost.json does not exist"),
    ],
)
def test_generate_cli_schedule_errors_are_one_line(tiny_spark_pair, extra, message):
    target, draft = tiny_spark_pair
    result = CliRunner().invoke(generate_app, ["--model", str(target), "--draft", str(draft), "--prompt", "Hi", *extra])
    assert result.exit_code == 2 and message in result.output
