"""The draft length policy (engine/policy/draft_length.py): `auto` on synthetic cost curves and synthetic
acceptance (nothing is timed), and the lossless property when the length changes between rounds."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark
from mlx_dspark.engine.proposers.lookup import LOOKUP_MAX_TOKENS
from mlx_dspark.engine.costs.probe import measure_cost_curve  # bound at import: the real one (conftest patches the module's)
from mlx_dspark.engine.round.decode import plain_steps, speculative_steps
from mlx_dspark.engine.policy.draft_length import AutoLength, DraftLength, FixedLength, break_even, expected_tokens, make_draft_length, rates
from mlx_dspark.engine.options import OptionError, SpeculationOptions
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.engine.costs.curve import CostCurve
from tests.test_lossless_sampling import (
    MIN_P_VALUE,
    PROMPT,
    RUNS,
    RandomDraftProposer,
    chi_square_p_value,
    exact_distribution,
    marginals,
    target,  # noqa: F401  (the module's tiny V = 8 target fixture)
    to_array,
)

# A GPU-like curve: wider verifies cost a little more, a draft block a fraction of a step.
GENTLE = CostCurve(draft_ms=3.0, verify_ms=[10 + 0.5 * n for n in range(8)])
# verify(n) = n x verify(1): no draft can ever pay (E(l) <= l + 1 tokens for l + 1 widths).
LINEAR = CostCurve(draft_ms=1.0, verify_ms=[10.0 * n for n in range(1, 9)])


def run(policy, acceptance_of, rounds: int, *, position: int = 0) -> list[int]:
    """Drive `policy` with synthetic rounds: `acceptance_of(round, proposed)` says how many were accepted."""
    lengths = []
    for i in range(rounds):
        length = policy.next_length(position=position)
        accepted = 0 if length == 0 else min(length, acceptance_of(i, length))
        policy.observe(proposed=length, accepted=accepted)
        lengths.append(length)
        position += accepted + 1
    return lengths


def test_expected_tokens_and_break_even_follow_the_formulas():
    assert expected_tokens([1.0, 0.5, 0.5], 3) == pytest.approx(1 + 1 + 0.5 + 0.25)
    q = break_even(GENTLE, 3)
    plain, three = rates(GENTLE, [q] * 3, 3)[0], rates(GENTLE, [q] * 3, 3)[3]
    assert three == pytest.approx(plain, rel=1e-6)
    assert break_even(LINEAR, 1) is None and break_even(LINEAR, 7) is None


def test_auto_settles_on_the_analytic_optimum():
    # positions 1..3 always accepted, 4 half of the time, 5 never: E(3) = 4, E(4) = 4.5, E(5..7) = 4.5
    true_q = [1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0]
    by_length = rates(GENTLE, true_q, 7)
    optimum = max(range(1, 8), key=lambda n: by_length[n])
    assert optimum == 4  # the fixture is what we think it is
    exact = AutoLength(GENTLE, 7, margin=0.0)
    settled = Counter(run(exact, lambda i, length: 3 + (i % 2), 300)[-100:])
    # the stale estimate past the optimum (position 5, never accepted) is tried again now and then (STALE_RELAX)
    assert settled[optimum] >= 90 and set(settled) <= {optimum, optimum + 1}
    policy = AutoLength(GENTLE, 7)  # the default margin keeps a length within 5% of the best one
    settled = Counter(run(policy, lambda i, length: 3 + (i % 2), 300)[-100:]).most_common(1)[0][0]
    assert by_length[settled] >= by_length[optimum] / 1.05
    assert not policy.parked and policy.parked_rounds == 0


def test_a_position_rejected_in_a_few_early_rounds_is_tried_again_once_the_shorter_rounds_accept():
    # The LM-draft pair's curve and first rounds (benchmarks/RESULTS.md section 28, its third prompt): three rounds
    # of 3 drafts rejected outright, one rejecting position 3, four of 1 and an exploration of 4 accepting 1 left
    # q(3) at 0.1, and the rounds of 2 that followed never sampled position 3 again (their full-acceptance streaks
    # too short to explore): locked at 2 drafts, 16 tok/s where mlx-lm's k=3 made 21. Afterwards position 3 is
    # always accepted once 2 are (q = 0.8, 0.75, 1.0): 3 drafts pay best by far.
    curve = CostCurve(draft_ms=0.0, draft_step_ms=9.7, verify_ms=[108, 112, 125, 125, 134, 136, 142, 142])
    early, cycle = [0, 0, 0, 2, 1, 1, 1, 1, 1], [3, 3, 1, 3, 0]

    def accepted(i, length):
        return min(length, early[i] if i < len(early) else cycle[i % len(cycle)])

    by_length = rates(curve, [0.8, 0.75, 1.0, 0.0, 0.0, 0.0], 6)
    assert max(range(1, 7), key=lambda n: by_length[n]) == 3 and by_length[3] > 1.15 * by_length[2]  # the fixture
    policy = AutoLength(curve, 6)
    lengths = run(policy, accepted, 120)
    assert lengths[:9] == [3, 3, 3, 3, 1, 1, 1, 1, 4]  # the measured start
    assert policy.acceptance[2] > 0.9
    assert sum(n >= 3 for n in lengths[-60:]) >= 55


def test_auto_parks_when_verify_2_already_costs_more_than_the_gain_and_never_probes_a_hopeless_curve():
    policy = AutoLength(LINEAR, 7)
    lengths = run(policy, lambda i, length: length, 200)  # even perfect acceptance cannot pay
    assert set(lengths) == {0}
    assert policy.parked_rounds == 200 and policy.summary() == {"lengths": {0: 200}, "parked_rounds": 200, "probes": 0, "explorations": 0}


def test_auto_parks_when_nothing_is_accepted_then_probes_rarely():
    policy = AutoLength(GENTLE, 7)
    lengths = run(policy, lambda i, length: 0, 600)
    assert lengths[-1] == 0 and policy.parked
    tail = lengths[100:]
    probes = [n for n in tail if n]
    assert probes and len(probes) < 0.05 * len(tail)  # backed off: a few percent of the rounds at most
    assert max(probes) == policy.probe_length


def test_auto_leaves_the_park_when_acceptance_returns():
    policy = AutoLength(GENTLE, 7)
    run(policy, lambda i, length: 0, 300)
    assert policy.parked
    lengths = run(policy, lambda i, length: length, 300)  # the text became predictable: all accepted
    # two drafting rounds in a row: a probe that left the park (one that did not is followed by parked rounds)
    first_active = next(i for i in range(len(lengths) - 1) if lengths[i] and lengths[i + 1])
    assert first_active < 150  # within one backed-off probe interval and a few probes
    assert lengths[-20:] == [7] * 20 and not policy.parked


def test_auto_does_not_flap_between_near_equal_lengths():
    rng = random.Random(0)

    def bernoulli(i, length):  # every position accepted with chance 0.8, independently
        return next((k for k in range(length) if rng.random() > 0.8), length)

    def switches(margin):
        rng.seed(0)
        lengths = run(AutoLength(GENTLE, 7, margin=margin), bernoulli, 600)
        return sum(a != b for a, b in itertools.pairwise(lengths))

    steady, jumpy = switches(0.05), switches(0.0)
    assert steady <= 12 and steady < jumpy


def test_auto_drafts_shorter_at_a_deeper_context_where_verifying_costs_more():
    deep = CostCurve(draft_ms=6.0, verify_ms=[40 + 8 * n for n in range(8)], context=4096)
    curve = CostCurve(draft_ms=3.0, verify_ms=[10 + 0.5 * n for n in range(8)], context=256, deep=deep)
    at_2k = curve.at(2176)
    assert at_2k.verify_ms[0] == pytest.approx(25) and at_2k.draft_ms == pytest.approx(4.5)
    assert curve.at(100) is curve
    q = 0.8
    shallow_start = AutoLength(curve, 7, prior=q).start_length(256)
    deep_start = AutoLength(curve, 7, prior=q).start_length(4096)
    assert shallow_start == 7 and 0 < deep_start < shallow_start


def test_a_two_depth_curve_survives_its_file(tmp_path):
    deep = CostCurve(draft_ms=6.0, verify_ms=[40, 48, 56], context=2048)
    curve = CostCurve(draft_ms=3.0, verify_ms=[10, 11, 12], context=256, deep=deep)
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(curve.to_json()))
    read = CostCurve.from_file(path)
    assert read.context == 256 and read.deep.context == 2048 and read.deep.verify_ms == (40, 48, 56)
    path.write_text(json.dumps({**curve.to_json(), "deep": {**deep.to_json(), "context": 100}}))
    with pytest.raises(ValueError, match="'deep' must be measured past context 256"):
        CostCurve.from_file(path)


def test_max_draft_tokens_auto_is_the_default_and_bad_values_name_the_choices():
    assert SpeculationOptions().max_draft_tokens == "auto" and SpeculationOptions().auto_length
    with pytest.raises(OptionError, match="'auto', an integer >= 1"):
        SpeculationOptions(max_draft_tokens="sometimes")
    assert isinstance(make_draft_length(None, 7, None), FixedLength)
    with pytest.raises(ValueError, match="needs speculation.cost_curve"):
        make_draft_length("auto", 7, None)


class Scripted(DraftLength):
    """A length policy that cycles through a script (0 = a round without drafts), from `start`."""

    def __init__(self, script, start=0, cap=2):
        self.script, self.i, self.cap = script, start, cap

    def next_length(self, *, position):
        self.i += 1
        return self.script[self.i % len(self.script)]

    def observe(self, *, proposed, accepted, confidence=None):
        pass


def test_greedy_output_is_the_same_whatever_lengths_auto_picks(tiny_spark_pair):
    pair = mlx_dspark.load(*tiny_spark_pair)
    prompt = "def add(a, b):"
    plain = mlx_dspark.generate(pair, prompt, max_tokens=40, speculative=False)
    for curve in (LINEAR, CostCurve.flat(max_width=8)):  # parked throughout / full blocks
        auto = mlx_dspark.generate(pair, prompt, max_tokens=40, cost_curve=curve)
        assert auto.tokens == plain.tokens
    assert set(mlx_dspark.generate(pair, prompt, max_tokens=40, cost_curve=LINEAR).proposal_lengths) == {0}
    target, draft = pair.target, pair.draft
    ids = pair.tokenizer.encode(prompt)
    from mlx_dspark.engine.proposers.dspark import DraftProposer

    steps = speculative_steps(
        target, DraftProposer(draft, target, greedy=True, temperature=1.0), ids, sampler=Sampler(),
        max_tokens=40, draft_length=Scripted([0, 3, 7, 1, 0, 0, 5, 2], cap=7),
    )
    tokens = list(itertools.chain.from_iterable(step.tokens for step in itertools.islice(steps, 40)))[:40]
    reference = list(itertools.chain.from_iterable(step.tokens for step in itertools.islice(plain_steps(target, ids, sampler=Sampler()), 40)))
    assert tokens == reference[: len(tokens)] and len(tokens) == 40


def test_sampled_distribution_is_unchanged_when_the_length_changes_between_rounds(target):  # noqa: F811
    sampler = Sampler(temperature=1.0)
    length = 3
    exact = exact_distribution(target, sampler, length)
    guide = marginals(exact)[1:]
    mx.random.seed(4321)
    outcomes: Counter = Counter()
    lengths: Counter = Counter()
    for run_index in range(RUNS):
        tokens = []
        policy = Scripted([2, 0, 1, 2, 1, 0], start=run_index)
        steps = speculative_steps(
            target, RandomDraftProposer(greedy=False, guide=guide), PROMPT, sampler=sampler, draft_length=policy
        )
        for step in steps:
            tokens.extend(step.tokens)
            lengths[step.proposed] += step.verified
            if len(tokens) >= length:
                break
        outcomes[tuple(tokens[:length])] += 1
    assert all(lengths[n] > 100 for n in (0, 1, 2))
    counts = to_array(outcomes, length)
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > MIN_P_VALUE
    for observed, expected in zip(marginals(counts), marginals(exact)):
        assert chi_square_p_value(observed, expected) > MIN_P_VALUE


def test_the_server_takes_max_draft_tokens_per_request_and_reports_what_the_policy_did(tiny_spark_pair):
    from tests.test_server import MESSAGES, call, pair_loader, running_server

    with running_server(pair_loader(tiny_spark_pair)) as srv:  # the defaults: auto
        status, _, auto = call(srv, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 12})
        status2, _, capped = call(srv, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 12, "max_draft_tokens": 2})
        status3, _, bad = call(srv, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_draft_tokens": "many"})
    assert status == status2 == 200 and status3 == 400 and bad["error"]["param"] == "max_draft_tokens"
    for body in (auto, capped):
        stats = body["dspark"]
        assert sum(stats["draft_lengths"].values()) == stats["rounds"]
        assert stats["rounds_parked"] == stats["draft_lengths"].get("0", 0)
    assert max(int(n) for n in capped["dspark"]["draft_lengths"]) <= 2
    assert auto["choices"][0]["message"]["content"] == capped["choices"][0]["message"]["content"]  # greedy: lossless


def test_calibrate_prints_the_curve_break_even_and_auto_s_start(tiny_spark_pair, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from mlx_dspark.cli.calibrate import app
    from mlx_dspark.engine.costs import probe as cost_probe

    monkeypatch.setenv(cost_probe.COST_DIR_ENV, str(tmp_path))
    target, draft = tiny_spark_pair
    result = CliRunner().invoke(app, ["--model", str(target), "--draft", str(draft), "--dtype", "float32", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["cache_file"].startswith(str(tmp_path)) and Path(data["cache_file"]).is_file()
    (row,) = data["depths"]  # the conftest's synthetic flat curve: one depth, drafts free
    assert row["auto_start_length"] == 7 and set(row["break_even_acceptance"]) == {str(n) for n in range(1, 8)}
    assert row["break_even_acceptance"]["1"] < 1e-6  # a free draft on a flat curve pays at any acceptance
    text = CliRunner().invoke(app, ["--model", str(target), "--draft", str(draft), "--dtype", "float32"]).output
    assert "auto starts at 7 drafts per round" in text and data["cache_file"] in text


def test_calibrate_with_a_missing_directory_says_so_in_one_line(tiny_spark_pair, tmp_path):
    from typer.testing import CliRunner

    from mlx_dspark.cli.calibrate import app

    target, draft = tiny_spark_pair
    for args, missing in ((["--model", str(tmp_path / "nope"), "--draft", str(draft)], tmp_path / "nope"),
                          (["--model", str(target), "--draft", str(tmp_path / "gone")], tmp_path / "gone")):  # fmt: skip
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output  # not an exception's traceback
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and str(missing) in errors[0] and "does not exist" in errors[0], result.output


def test_parked_rounds_batch_the_draft_context_and_a_prompt_cache_stays_whole(tiny_spark_pair):
    pair = mlx_dspark.load(*tiny_spark_pair)
    cache = mlx_dspark.make_prompt_cache(pair)
    prompt = "def add(a, b):"
    first = mlx_dspark.generate(pair, prompt, max_tokens=45, cost_curve=LINEAR, prompt_cache=cache)  # parked throughout
    assert set(first.proposal_lengths) == {0}
    assert all(ctx.offset == len(cache.tokens) for ctx in cache.draft_context)  # flushed when the generation ended
    follow_up = prompt + first.text + "\n"
    warm = mlx_dspark.generate(pair, follow_up, max_tokens=20, max_draft_tokens=7, prompt_cache=cache)
    cold = mlx_dspark.generate(pair, follow_up, max_tokens=20, max_draft_tokens=7)
    assert warm.cached_tokens > 0 and warm.tokens == cold.tokens
    assert warm.acceptance_lengths == cold.acceptance_lengths  # the resumed draft context proposes as a cold one


def test_auto_parked_by_its_prior_probes_at_once_and_drafts_when_the_draft_is_good():
    pessimistic = AutoLength(GENTLE, 7, prior=0.05)
    lengths = run(pessimistic, lambda i, length: length, 20)
    assert lengths[0] == pessimistic.probe_length and lengths[-5:] == [7] * 5


def test_auto_composes_with_the_confidence_schedule_and_stays_lossless(tiny_spark_pair):
    pair = mlx_dspark.load(*tiny_spark_pair)
    prompt = "def add(a, b):"
    plain = mlx_dspark.generate(pair, prompt, max_tokens=30, speculative=False)
    both = mlx_dspark.generate(pair, prompt, max_tokens=30, verify_schedule="confidence", cost_curve=GENTLE)
    assert both.tokens == plain.tokens
    assert max(both.proposal_lengths) <= 7


def test_the_first_use_curve_has_two_depths_and_a_target_alone_gets_one_too(tiny_spark_pair):
    pair = mlx_dspark.load(*tiny_spark_pair)
    curve = measure_cost_curve(pair.target, pair.draft, context=24, deep_context=48, repeats=1)
    wide = LOOKUP_MAX_TOKENS + 1  # the draft's widths 1..8, then up to the longest lookup block's (issue 52)
    assert (curve.context, curve.deep.context, curve.max_width, curve.deep.max_width) == (24, 48, wide, wide)
    alone = measure_cost_curve(pair.target, None, context=24, deep_context=None, repeats=1)  # lookup proposers
    assert alone.draft_ms == 0.0 and alone.max_width == wide and alone.deep is None


def test_calibrate_shows_the_packed_costs_and_the_batch_plan(tiny_spark_pair, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from mlx_dspark.cli.calibrate import app
    from mlx_dspark.engine.costs import probe as cost_probe

    monkeypatch.setenv(cost_probe.COST_DIR_ENV, str(tmp_path))
    target, draft = tiny_spark_pair
    args = ["--model", str(target), "--draft", str(draft), "--dtype", "float32", "--max-batch", "3"]
    data = json.loads(CliRunner().invoke(app, [*args, "--json"]).output)
    batch = data["batch"]
    assert Path(batch["cache_file"]).is_file() and batch["source"] == "flat (tests)"  # the conftest's synthetic costs
    # forwards that cost the same whatever their rows, free drafts: every request drafts its whole block
    assert batch["plans"]["0.5"] == {"1": [7], "2": [7, 7], "3": [7, 7, 7]}
    text = CliRunner().invoke(app, args).output
    assert "3 at once: 7 7 7" in text and "w requests of one row each" in text
    bad = CliRunner().invoke(app, ["--model", str(target), "--draft", str(draft), "--max-batch", "0"])
    assert bad.exit_code == 2 and "--max-batch must be >= 1" in bad.output
