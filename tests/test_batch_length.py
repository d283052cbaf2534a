"""The draft lengths of a batched round (engine/batch/length.py): the joint plan over this machine's
packed-forward costs, the probes of parked rows, the cost's measurement and its cache."""

import itertools
import json
import random

import pytest

import mlx_dspark
from mlx_dspark.engine.batch.length import (
    MAX_PROBE_EVERY,
    PROBE_EVERY,
    PROBE_LENGTH,
    BatchCost,
    Probes,
    RowDemand,
    batch_cost_for,
    batch_cost_path,
    measure_batch_cost,
    measured_widths,
    plan_lengths,
)
from mlx_dspark.engine.policy.draft_length import expected_tokens

WIDTHS = (1, 2, 4, 8)


def cost_from(verify, draft=lambda width: 2.0, widths=WIDTHS, split=0.0) -> BatchCost:
    """A BatchCost from `verify(total_rows)` for one sequence, `split` ms per extra sequence, `draft(width)`."""
    rows = sorted({*range(1, 9), 16, 32, 64, 128, *(w * 8 for w in widths)})
    return BatchCost(rows_ms={n: float(verify(n)) for n in rows},
                     sequences_ms={w: float(verify(w)) + split * (w - 1) for w in widths if w > 1},
                     draft_ms={w: float(draft(w)) for w in widths})  # fmt: skip


def knee(rows: float) -> float:
    """Memory-bound up to 16 rows (each row 2% of a step), compute-bound after (each row a whole 10 ms / 16)."""
    return 10.0 + 0.2 * min(rows, 16) + 0.625 * max(0.0, rows - 16)


def rate(cost: BatchCost, demands, lengths) -> float:
    tokens = sum(expected_tokens(d.acceptance, n) for d, n in zip(demands, lengths))
    rows = sum(d.rows + n for d, n in zip(demands, lengths))
    return tokens / (cost.draft(sum(1 for n in lengths if n)) + cost.verify(len(demands), rows))


def test_the_plan_is_within_a_few_percent_of_the_best_lengths():
    """Against every combination of lengths on small batches with random acceptances and costs."""
    rng = random.Random(0)
    worst = 1.0
    for _ in range(150):
        base, slope, bend = rng.uniform(5, 20), rng.uniform(0, 3), rng.choice([4, 8, 16, 64])
        d1, share = rng.uniform(0.5, 8), rng.uniform(0, 1)
        cost = cost_from(lambda r: base + 0.1 * slope * min(r, bend) + slope * max(0, r - bend),
                         draft=lambda w: d1 * (1 + share * (w - 1)), widths=(1, 2, 4), split=rng.uniform(0, 2))  # fmt: skip
        demands = [RowDemand(acceptance=[rng.random() for _ in range(4)], cap=rng.randint(0, 4)) for _ in range(rng.choice([1, 2, 3]))]
        best = max(itertools.product(*[range(d.cap + 1) for d in demands]), key=lambda ls: rate(cost, demands, ls))
        worst = min(worst, rate(cost, demands, plan_lengths(cost, demands)) / rate(cost, demands, best))
    assert worst >= 0.97, worst


def test_the_plan_follows_the_batch_width():
    """Free rows: every row drafts its cap; rows that cost a whole step each: nobody drafts; a knee:
    the wider the batch, the shorter each row's drafts."""
    rows = lambda n, q=0.8: [RowDemand(acceptance=[q] * 7, cap=7) for _ in range(n)]  # noqa: E731
    assert plan_lengths(cost_from(lambda r: 10.0), rows(4)) == [7] * 4
    assert plan_lengths(cost_from(lambda r: 10.0 * r), rows(4)) == [0] * 4
    per_row = [sum(plan_lengths(cost_from(knee), rows(w))) / w for w in WIDTHS]
    assert per_row == sorted(per_row, reverse=True) and per_row[0] >= 5 and per_row[-1] <= 2, per_row


def test_rows_that_are_accepted_more_draft_more():
    cost = cost_from(knee)
    lengths = plan_lengths(cost, [RowDemand(acceptance=[q] * 7, cap=7) for q in (0.95, 0.6, 0.3)])
    assert lengths[0] > lengths[1] > lengths[2], lengths


def test_floors_caps_and_a_prefill_chunk_in_the_forward():
    cost = cost_from(lambda rows: 10.0 + 10.0 * max(0, rows - 65))  # rows free up to 65, a whole step each after
    alone = plan_lengths(cost, [RowDemand(acceptance=[0.8] * 7, cap=7)])
    # a newcomer's 64-row prompt chunk fills the free rows: no draft pays beside it
    beside = plan_lengths(cost, [RowDemand(acceptance=[0.8] * 7, cap=7), RowDemand(rows=64, tokens=False)])
    assert beside[0] < alone[0] and beside[1] == 0
    cost = cost_from(knee)
    fixed = plan_lengths(cost, [RowDemand(floor=5, acceptance=[0.1] * 5), RowDemand(acceptance=[0.8] * 7, cap=2)])
    assert fixed[0] == 5 and fixed[1] <= 2
    assert plan_lengths(cost, [RowDemand(acceptance=[0.99] * 7, cap=0), RowDemand()]) == [0, 0]


def test_a_parked_row_probes_with_back_off():
    probes = Probes()
    due = []
    for _ in range(PROBE_EVERY + 2 * PROBE_EVERY + 1):
        floor = probes.floor()
        due.append(floor)
        probes.record(floor, probe=bool(floor))  # the plan parks it except for the probes
    assert due.index(PROBE_LENGTH) == PROBE_EVERY - 1 and due.count(PROBE_LENGTH) == 2
    assert probes.interval == 4 * PROBE_EVERY and probes.counts["probes"] == 2
    probes.record(3, probe=False)  # the plan drafts it again: back to the first interval
    assert probes.interval == PROBE_EVERY and probes.parked == 0
    for _ in range(20):
        probes.record(PROBE_LENGTH, probe=True)
    assert probes.interval == MAX_PROBE_EVERY


def test_batch_cost_interpolates_and_reads_back(tmp_path):
    cost = cost_from(knee, split=0.5)
    assert cost.verify(1, 20) == pytest.approx(knee(20))  # between measured row counts
    assert cost.verify(4, 20) == pytest.approx(knee(20) + 3 * 0.5)  # + splitting the attention over 4 sequences
    assert cost.verify(3, 20) == pytest.approx(knee(20) + 2 * 0.5)
    assert cost.draft(0) == 0.0 and cost.draft(3) == 2.0 and cost.max_width == 8
    assert BatchCost.from_json(json.loads(json.dumps(cost.to_json()))) == cost
    with pytest.raises(ValueError, match=r"costs\.json: expected rows_ms, sequences_ms and draft_ms"):
        BatchCost.from_json({"rows_ms": [1, 2]}, where="costs.json")


def test_measured_once_then_read_from_the_cache(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    pair = mlx_dspark.load(str(target), draft=str(draft))
    assert measured_widths(3) == [1, 2, 3] and measured_widths(8) == [1, 2, 4, 8]
    calls = []

    def measure(target, draft, *, max_batch):
        calls.append(max_batch)
        return measure_batch_cost(target, draft, max_batch=max_batch, context=24, repeats=1)

    first = batch_cost_for(pair, 3, cache_dir=tmp_path, measure=measure)
    again = batch_cost_for(pair, 3, cache_dir=tmp_path, measure=measure)
    assert calls == [3] and again == first and batch_cost_path(pair, 3, tmp_path).is_file()
    assert first.bytes_per_token > 0  # the caches' size per token of context, for the batch's memory budget
    path = batch_cost_path(pair, 3, tmp_path)
    old = json.loads(path.read_text())
    del old["bytes_per_token"]  # a file from before the caches' size was measured
    path.write_text(json.dumps(old))
    assert batch_cost_for(pair, 3, cache_dir=tmp_path, measure=measure).bytes_per_token > 0 and calls == [3, 3]
    assert sorted(first.sequences_ms) == [2, 3] and sorted(first.draft_ms) == [1, 2, 3]
    block = pair.draft.num_drafts
    assert sorted(first.rows_ms) == [*range(1, block + 2), 16, 32, 64, 128]
    times = [first.rows_ms[n] for n in sorted(first.rows_ms)]
    assert times == sorted(times) and times[0] > 0  # made monotone; a wider forward never costs less


def test_measured_on_a_hybrid_target_whose_recurrent_state_is_restored(tmp_path):
    """qwen3_5 through mlx-lm: the measurement's forwards roll back (one-row ones by a restored copy)."""
    from mlx_dspark.testing.mlx_lm_checkpoints import write_draft_for, write_tiny_mlx_lm_target

    target = write_tiny_mlx_lm_target(tmp_path / "target", family="qwen3_5")
    pair = mlx_dspark.load(str(target), draft=str(write_draft_for(tmp_path / "draft", target_path=target)))
    cost = measure_batch_cost(pair.target, pair.draft, max_batch=2, context=16, repeats=1)
    assert sorted(cost.sequences_ms) == [2] and 128 in cost.rows_ms and all(v > 0 for v in cost.rows_ms.values())


def test_a_lookup_block_in_the_forward_makes_the_other_rows_drafts_dearer():
    cost = cost_from(knee)  # memory-bound up to 16 rows
    auto = RowDemand(acceptance=[0.8] * 7, cap=7)
    assert plan_lengths(cost, [auto, RowDemand()]) == [7, 0]
    beside = plan_lengths(cost, [auto, RowDemand(rows=33, expected=20.0)])  # a 32-token lookup block
    assert beside[0] < 7 and beside[1] == 0, beside  # (here: the draft forward no longer pays at all)


class _Row:
    """What plan_round reads of a batch row (engine/batch.BatchRow), with a scripted Chooser."""

    def __init__(self, demand, chooser=None):
        self._demand, self.chooser, self.prefilling, self.planned = demand, chooser, False, chooser is None
        self.probes = Probes()

    def demand(self, cap, prefill_chunk):
        return self._demand

    def room(self):
        return 32


class _LookupChooser:
    """Prefers its 32-token lookup block to any DSpark block."""

    def __init__(self):
        self.asked = []

    def plan(self, *, num_tokens, room):
        import mlx.core as mx

        from mlx_dspark.engine.policy.proposal_choice import Plan
        from mlx_dspark.engine.proposers.base import Proposal

        self.asked.append(num_tokens)
        return Plan(proposal=Proposal(tokens=mx.zeros((1, 32), mx.int32)), expected=20.0)


def test_plan_round_counts_a_row_s_lookup_block_before_planning_the_drafts():
    from mlx_dspark.engine.batch.plan import plan_round

    auto = _Row(RowDemand(acceptance=[0.8] * 7, cap=7))
    lookup = _Row(RowDemand(floor=0, acceptance=[0.8] * 7, cap=7), chooser=_LookupChooser())
    lengths, plans = plan_round([auto, lookup], 1 << 30, cost_from(knee), 8)
    assert set(plans) == {1} and plans[1].proposal.tokens.shape == (1, 32) and lookup.chooser.asked == [7]
    assert lengths == plan_lengths(cost_from(knee), [auto._demand, RowDemand(rows=33, expected=20.0)]) and lengths[0] < 7
