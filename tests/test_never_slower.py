"""Never slower (issue 39): parked rounds are plain decoding's pipelined steps, probes stay inside a
budget, and `auto` explores past a frontier that keeps being accepted. Synthetic curves, nothing timed."""

from __future__ import annotations

import itertools
import random

import mlx.core as mx

import mlx_dspark
from mlx_dspark.engine.round import decode
from mlx_dspark.engine.round.decode import plain_steps, speculative_steps
from mlx_dspark.engine.policy.draft_length import AutoLength
from mlx_dspark.engine.options import SpeculationOptions
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.engine.costs.curve import CostCurve

# Verify widths nearly free (OpenBLAS here, a GPU): a long block pays as soon as it is accepted.
CHEAP_WIDTH = CostCurve(draft_ms=2.0, verify_ms=[4.0, 4.6, 5.6, 6.6, 7.6, 8.6, 9.6, 10.6])
# A draft block dearer than a target step: parks on unpredictable text, probes cost ~2.5 steps.
DEAR_DRAFT = CostCurve(draft_ms=6.0, verify_ms=[4.0, 4.1, 4.2, 4.3, 4.4, 4.5, 4.6, 4.7])
HOPELESS = CostCurve(draft_ms=1.0, verify_ms=[10.0 * n for n in range(1, 9)])


def drive(policy: AutoLength, accepted_of, rounds: int) -> list[int]:
    lengths = []
    for i in range(rounds):
        length = policy.next_length(position=0)
        policy.observe(proposed=length, accepted=0 if length == 0 else min(length, accepted_of(i, length)))
        lengths.append(length)
    return lengths


def test_a_length_stuck_short_reaches_the_full_block_once_its_frontier_keeps_being_accepted():
    rng = random.Random(0)
    policy = AutoLength(CHEAP_WIDTH, 7)
    # position 1 always accepted, position 2 one time in ten: length 1 is right, 2..7 go unobserved
    early = drive(policy, lambda i, n: 1 if rng.random() > 0.1 else 2, 200)
    assert early[-20:].count(1) >= 15
    assert sum(n > 1 for n in early[50:]) <= 0.25 * 150  # exploring costs a little width, now and then
    later = drive(policy, lambda i, n: n, 40)  # the text turns predictable: every position accepted
    assert 7 in later[:20] and later[-10:] == [7] * 10, later


def test_a_fresh_policy_with_a_perfect_frontier_reaches_the_full_block_within_a_few_rounds():
    for curve in (CHEAP_WIDTH, DEAR_DRAFT):
        lengths = drive(AutoLength(curve, 7), lambda i, n: n, 12)
        assert lengths.index(7) <= 6 and lengths[-3:] == [7] * 3, (curve, lengths)


def test_nothing_accepted_parks_and_the_probes_spend_at_most_their_budget():
    for curve in (CHEAP_WIDTH, DEAR_DRAFT):
        policy = AutoLength(curve, 7)
        lengths = drive(policy, lambda i, n: 0, 2000)
        assert lengths[-1] == 0 and policy.parked
        probes = policy.summary()["probes"]
        probe_steps = curve.round_ms(policy.probe_length) / curve.verify_ms[0]
        # at most one free probe (a park by the prior), the others paid from 2% of the parked rounds: what
        # each cost beyond the one token it committed (nothing accepted)
        assert probes >= 2 and (probes - 1) * (probe_steps - 1) <= 0.02 * policy.parked_rounds + 1e-9
        assert sum(1 for n in lengths[-1000:] if n) == sum(1 for n in lengths[-1000:] if n == policy.probe_length)


class CountingProposer(DraftProposer):
    proposals = 0

    def propose(self, *args, **kwargs):
        self.proposals += 1
        return super().propose(*args, **kwargs)


def test_parked_rounds_run_as_plain_steps_one_token_forward_each_no_acceptance(tiny_spark_pair, monkeypatch):
    pair = mlx_dspark.load(*tiny_spark_pair)
    target, ids = pair.target, pair.tokenizer.encode("def add(a, b):")

    def no_acceptance(**kwargs):
        raise AssertionError("a parked round ran the acceptance of a verify round")

    monkeypatch.setattr(decode, "accept_greedy", no_acceptance)
    proposer = CountingProposer(pair.draft, target, greedy=True, temperature=1.0)
    steps = speculative_steps(
        target, proposer, ids, sampler=Sampler(), speculation=SpeculationOptions(max_draft_tokens="auto", cost_curve=HOPELESS),
    )
    rounds = list(itertools.islice(steps, 60))
    tokens = [t for r in rounds for t in r.tokens]
    reference = [r.tokens[0] for r in itertools.islice(plain_steps(target, ids, sampler=Sampler()), 60)]
    assert tokens == reference
    assert proposer.proposals == 0
    assert all(len(r.tokens) == 1 and r.proposed == 0 for r in rounds)
    assert all(c.offset == 0 for c in proposer.context)  # the park batches the draft context, the prompt's rows too
    proposer.flush()
    # every yielded token: like plain decoding, the step after the last yield is queued, its token in the caches
    assert all(c.offset == len(ids) + 60 for c in proposer.context)


def test_a_long_park_computes_the_draft_context_of_the_window_only(tiny_spark_pair):
    pair = mlx_dspark.load(*tiny_spark_pair)
    proposer = DraftProposer(pair.draft, pair.target, greedy=True, temperature=1.0)
    keep = pair.draft.context_rows(proposer.context)
    if keep is None:  # a full-attention draft needs every position: nothing is dropped
        return
    features = mx.zeros((1, 1, pair.draft.fc.weight.shape[1]))
    for _ in range(keep + 40):
        proposer.extend_later(features)
    assert sum(f.shape[1] for f in proposer._pending) == keep
    proposer.flush()
    assert all(c.offset == keep + 40 for c in proposer.context)


def test_a_never_checked_curve_gets_one_probe_at_the_start_not_a_check_and_a_free_look():
    # a curve no generation has checked gets a probe at once; it is also the look a park by the prior
    # gets (two probes cost ~2.5 plain steps each of a 256-token answer: over 1%, seen as x0.96)
    demo_here = CostCurve(draft_ms=6.4, verify_ms=[4.5, 5.7, 6.7, 7.4, 8.5, 9.0, 10.1, 10.9])  # parks by the prior
    policy = AutoLength(demo_here, 7, heal=True)
    lengths = drive(policy, lambda i, n: 0, 250)
    assert lengths[0] == policy.probe_length and sum(1 for n in lengths if n) == 1, lengths[:40]


def test_a_catch_up_and_the_rounds_the_policy_does_not_observe_are_not_timed_as_the_draft_block(monkeypatch):
    from mlx_dspark.engine.policy import draft_length

    clock = [0.0]
    monkeypatch.setattr(draft_length.time, "perf_counter", lambda: clock[0])
    policy = AutoLength(DEAR_DRAFT, 7, heal=True)
    seen = []
    monkeypatch.setattr(policy.healer, "observe", lambda *, proposed, ms: seen.append((proposed, round(ms, 6))))
    policy.next_length(position=0)
    clock[0] += 0.050  # a probe whose draft context caught up on 40 ms of waiting rows, then ran 10 ms
    policy.untimed(40.0)
    policy.observe(proposed=2, accepted=0)
    clock[0] += 0.100  # a lookup block the policy does not observe
    policy.restart_clock()
    clock[0] += 0.011
    policy.observe(proposed=2, accepted=0)
    assert seen == [(2, 10.0), (2, 11.0)]


def test_probes_are_charged_what_they_really_took_not_what_the_curve_predicts(monkeypatch):
    demo_here = CostCurve(draft_ms=6.4, verify_ms=[4.5, 5.7, 6.7, 7.4, 8.5, 9.0, 10.1, 10.9])
    policy = AutoLength(demo_here, 7, heal=True)
    _timed_drive(policy, monkeypatch, 2000)  # plain steps of 4.5 ms; every probe 27 ms (6 steps: its catch-up 9 ms, untimed)
    charged = policy.summary()["probes"] - 1  # the first is the free look
    # each charged what it took beyond the one token it committed: 5 plain steps, not the curve's 3.1
    assert charged >= 1 and charged * 5.0 <= 0.02 * policy.parked_rounds + 1e-9, (charged, policy.parked_rounds)
    assert (charged + 1) * 5.0 > 0.02 * policy.parked_rounds - 5.0  # and no fewer than that pays for


def _cached(tmp_path, curve: CostCurve, **extra) -> CostCurve:
    """`curve` as the cost cache holds it (checked by an earlier run: no check probe), with `extra` keys."""
    import dataclasses
    import json

    path = tmp_path / "curve.json"
    path.write_text(json.dumps({**dataclasses.replace(curve, checked=3).to_json(), **extra}))
    return dataclasses.replace(CostCurve.from_file(path), cache_path=path)


_CLOCK: dict = {}  # monkeypatch (one per test) -> its simulated clock


def _timed_drive(policy: AutoLength, monkeypatch, rounds: int, *, accepted: int = 0) -> list[int]:
    """Plain steps of 4.5 ms; a probe 27 ms (6 steps, its catch-up 9 ms of them). The clock goes on from
    where an earlier drive of the same test left it."""
    from mlx_dspark.engine.policy import draft_length

    clock = _CLOCK.setdefault(monkeypatch, [0.0])
    monkeypatch.setattr(draft_length.time, "perf_counter", lambda: clock[0])
    lengths = []
    for _ in range(rounds):
        length = policy.next_length(position=0)
        if length:
            clock[0] += 0.018
            policy.untimed(9.0)
            clock[0] += 0.009
        else:
            clock[0] += 0.0045
        policy.observe(proposed=length, accepted=min(length, accepted))
        lengths.append(length)
    return lengths


def test_a_pair_whose_draft_failed_last_time_takes_no_free_look_and_pays_its_probes_at_their_measured_cost(
    tmp_path, monkeypatch
):
    demo_here = CostCurve(draft_ms=6.4, verify_ms=[4.5, 5.7, 6.7, 7.4, 8.5, 9.0, 10.1, 10.9])  # parks by the prior
    curve = _cached(tmp_path, demo_here)
    first = AutoLength(curve, 7, heal=True)
    assert first.memory is None
    lengths = _timed_drive(first, monkeypatch, 250)
    assert sum(1 for n in lengths if n) == 1  # the free look of a park by the prior
    first.finish()
    second = AutoLength(curve, 7, heal=True)
    assert second.memory is not None and second.memory.acceptance[0] < 0.35 and 5.0 < second.memory.probe_steps < 7.0
    # 250 parked steps earn 5 plain steps of probing: less than the 6 a probe cost last time
    assert sum(1 for n in _timed_drive(second, monkeypatch, 250) if n) == 0
    lengths = _timed_drive(second, monkeypatch, 1000)  # a long park still probes, within the budget
    assert 1 <= sum(1 for n in lengths if n) and sum(1 for n in lengths if n) * 6.0 <= 0.02 * 1250


def test_a_pair_whose_draft_paid_last_time_drafts_from_the_first_round_and_a_bad_memory_is_ignored(tmp_path):
    demo_here = CostCurve(draft_ms=6.4, verify_ms=[4.5, 5.7, 6.7, 7.4, 8.5, 9.0, 10.1, 10.9])
    good = _cached(tmp_path, demo_here, acceptance_seen={"acceptance": [0.95, 0.9, 0.9], "probe_steps": 6.0})
    policy = AutoLength(good, 7, heal=True)
    assert policy.acceptance == [0.95, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    assert policy.next_length(position=0) >= 3
    # a memory near paying (x0.82 of plain here) still gets its free look at the start; a far one none
    near = AutoLength(_cached(tmp_path, demo_here, acceptance_seen={"acceptance": [0.7]}), 7, heal=True)
    far = AutoLength(_cached(tmp_path, demo_here, acceptance_seen={"acceptance": [0.3]}), 7, heal=True)
    assert [near.next_length(position=0) for _ in range(3)] == [near.probe_length, 0, 0]
    assert [far.next_length(position=0) for _ in range(3)] == [0, 0, 0]
    for bad in ({"acceptance": [1.5]}, {"acceptance": "high"}, [0.9], {"acceptance": []}):
        curve = _cached(tmp_path, demo_here, acceptance_seen=bad)
        assert AutoLength(curve, 7, heal=True).memory is None
    # a policy that is not healing (a curve the user gave) neither reads nor writes one
    assert AutoLength(good, 7).memory is None


def test_a_generation_leaves_its_acceptance_beside_the_cached_curve(tiny_spark_pair, monkeypatch, tmp_path):
    import json

    from mlx_dspark.engine.costs import heal as cost_heal

    from mlx_dspark.engine.costs import probe as cost_probe

    monkeypatch.setattr(cost_heal, "ENABLED", True)  # the cached curve heals, and so remembers
    # in a cost cache of its own: the healed curve must not reach later tests of this worker (their flat one)
    monkeypatch.setenv(cost_probe.COST_DIR_ENV, str(tmp_path))
    pair = mlx_dspark.load(*tiny_spark_pair)
    ids = pair.tokenizer.encode("def add(a, b):")
    plain = mlx_dspark.generate(pair, ids, max_tokens=24, speculative=False).tokens
    assert mlx_dspark.generate(pair, ids, max_tokens=24, lookup="off").tokens == plain
    saved = json.loads(cost_probe.cost_curve_path(pair).read_text())["acceptance_seen"]
    assert len(saved["acceptance"]) == 7 and all(0.0 <= q <= 1.0 for q in saved["acceptance"])


def test_a_probe_that_accepted_a_run_gets_a_second_free_look_soon_and_a_failed_one_does_not():
    # the first look after a prompt is one sample: accepting 2 of its drafts is worth a second look, free
    demo_here = CostCurve(draft_ms=6.4, verify_ms=[4.5, 5.7, 6.7, 7.4, 8.5, 9.0, 10.1, 10.9])  # 2 of 7 do not pay
    lengths = drive(AutoLength(demo_here, 7), lambda i, n: 2, 40)
    looks = [i for i, n in enumerate(lengths) if n]
    assert len(looks) == 3 and looks[1] - looks[0] <= 9 and looks[2] - looks[1] <= 9, lengths  # two confirming looks, no more
    lengths = drive(AutoLength(demo_here, 7), lambda i, n: 0, 40)
    assert sum(1 for n in lengths if n) == 1, lengths  # nothing accepted: the park settles, the budget decides


def test_parked_after_drafting_that_paid_the_first_look_comes_soon_and_free():
    # the text turned unpredictable after drafting paid: the draft parks, and looks again 8 rounds on
    # (the probe budget of the parked rounds alone would wait ~150 rounds); once that look fails, the budget decides
    demo_here = CostCurve(draft_ms=6.4, verify_ms=[4.5, 5.7, 6.7, 7.4, 8.5, 9.0, 10.1, 10.9])
    policy = AutoLength(demo_here, 7)
    drive(policy, lambda i, n: n, 30)  # everything accepted: drafting
    assert not policy.parked
    lengths = drive(policy, lambda i, n: 0, 120)
    parked_at = lengths.index(0)
    looks = [i for i, n in enumerate(lengths) if n and i > parked_at]
    assert looks and looks[0] - parked_at <= 10 and len(looks) == 1, lengths
