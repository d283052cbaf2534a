"""Continuous batching with speculation (engine/batch/round.py): every row equals its request run alone.

Rows of different prompt lengths and max_tokens join the batch at different rounds (so newcomers'
prefill chunks share forwards with running verify blocks), plain and speculative rows share forwards,
and a seeded sampled row does not depend on its neighbours. The bundled BLAS computes a packed row
bitwise as the row's own forward (models/packed/forward.py), so greedy rows are compared token for token.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_dspark
from mlx_dspark.engine.batch.round import BatchRow, batch_round
from tests.batch_helpers import drive_batch
from mlx_dspark.engine.batch.length import PROBE_EVERY, PROBE_LENGTH, BatchCost, row_budget_cap
from mlx_dspark.engine.logits.constraints import Constraint
from mlx_dspark.engine.options import GenerationOptions, SamplingOptions, SpeculationOptions
from mlx_dspark.engine.costs.curve import CostCurve
from mlx_dspark.models.packed.forward import packed_block_hidden, packed_target_forward


@pytest.fixture(scope="module", params=["qwen3", "spark2_5"])
def pair(request):
    name = "tiny_qwen3_pair" if request.param == "qwen3" else "tiny_spark_pair"
    target, draft = request.getfixturevalue(name)
    return mlx_dspark.load(str(target), draft=str(draft))


def run_batch(pair, requests, *, joins, cap=row_budget_cap(12), chunk=8):
    """Drive batch rounds as a server does; requests join at the given rounds. Returns each one's tokens."""
    out, _, widths = drive_batch(pair, requests, joins=joins, draft_cap=cap, prefill_chunk=chunk)
    return out, widths


PROMPTS = [list(range(5, 8)), list(range(20, 61)), [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3, list(range(100, 117))]


def test_packed_forward_rows_are_bitwise_their_own_forward(pair):
    target, draft = pair.target, pair.draft
    taps = tuple(draft.args.target_layer_ids)
    solo, caches = [], []
    for prompt in PROMPTS[:3]:
        cache = target.make_cache()
        logits, features = target(mx.array(prompt)[None], cache=cache, tap_ids=taps)
        solo.append((logits[0], features[0]))
        caches.append(target.make_cache())
    tokens = [t for p in PROMPTS[:3] for t in p]
    logits, features = packed_target_forward(target, tokens, caches, [len(p) for p in PROMPTS[:3]], tap_ids=taps)
    start = 0
    for (solo_logits, solo_features), prompt in zip(solo, PROMPTS[:3]):
        assert mx.array_equal(logits[start : start + len(prompt)], solo_logits).item()
        assert mx.array_equal(features[start : start + len(prompt)], solo_features).item()
        start += len(prompt)
    contexts = []
    for _, solo_features in solo:
        ctx = draft.make_cache()
        draft.append_context(solo_features[None], ctx)
        contexts.append(ctx)
    anchors = mx.array([3, 4, 5], dtype=mx.int32)
    block = packed_block_hidden(draft, anchors, contexts, target=target)
    for i, ctx in enumerate(contexts):
        assert mx.array_equal(block[i : i + 1], draft.block_hidden(anchors[i : i + 1], ctx, target=target)).item()


def test_greedy_rows_equal_their_solo_runs_with_joins_and_plain_rows(pair):
    requests = [
        (PROMPTS[0], GenerationOptions(max_tokens=30)),
        (PROMPTS[1], GenerationOptions(max_tokens=12)),
        (PROMPTS[2], GenerationOptions(max_tokens=25, speculation=SpeculationOptions(speculative=False))),
        (PROMPTS[3], GenerationOptions(max_tokens=1)),
        (PROMPTS[1], GenerationOptions(max_tokens=20, speculation=SpeculationOptions(max_draft_tokens=2))),
    ]
    out, widths = run_batch(pair, requests, joins=[0, 0, 1, 3, 2])
    assert max(widths) >= 4, widths
    for i, (prompt, options) in enumerate(requests):
        solo = mlx_dspark.generate(pair, prompt, options=options)
        assert out[i] == solo.tokens, f"request {i}"


def test_penalised_and_constrained_greedy_rows_equal_their_solo_runs(pair):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    requests = [
        (PROMPTS[1], GenerationOptions(max_tokens=16, logprobs=2, sampling=SamplingOptions(repetition_penalty=1.3))),
        (PROMPTS[0], GenerationOptions(max_tokens=24, constraint=Constraint.json_schema(schema))),
        (PROMPTS[2], GenerationOptions(max_tokens=10)),
    ]
    out, _ = run_batch(pair, requests, joins=[0, 1, 0])
    for i, (prompt, options) in enumerate(requests):
        assert out[i] == mlx_dspark.generate(pair, prompt, options=options).tokens, f"request {i}"


def test_rows_with_their_own_cuts_equal_their_solo_runs(pair):
    """p_min, a confidence threshold and the confidence schedule cut each row's own proposal."""
    curve = CostCurve(draft_ms=2.0, verify_ms=(10, 11, 12, 14, 20, 30, 40, 50))
    requests = [
        (PROMPTS[1], GenerationOptions(max_tokens=18, speculation=SpeculationOptions(verify_schedule="confidence", cost_curve=curve))),
        (PROMPTS[0], GenerationOptions(max_tokens=15, speculation=SpeculationOptions(p_min=0.3))),
        (PROMPTS[2], GenerationOptions(max_tokens=12, speculation=SpeculationOptions(confidence_threshold=0.5))),
    ]
    out, _ = run_batch(pair, requests, joins=[0, 0, 1])
    for i, (prompt, options) in enumerate(requests):
        assert out[i] == mlx_dspark.generate(pair, prompt, options=options).tokens, f"request {i}"


def test_seeded_sampled_row_does_not_depend_on_its_neighbours(pair):
    sampled = (PROMPTS[1], GenerationOptions(max_tokens=20, sampling=SamplingOptions(temperature=0.9, seed=7)))
    alone, _ = run_batch(pair, [sampled], joins=[0], cap=3)
    crowded, _ = run_batch(
        pair, [(PROMPTS[0], GenerationOptions(max_tokens=15)), sampled, (PROMPTS[2], GenerationOptions(max_tokens=9))],
        joins=[0, 1, 0], cap=3,
    )  # fmt: skip
    assert crowded[1] == alone[0]
    other, _ = run_batch(pair, [(sampled[0], GenerationOptions(max_tokens=20, sampling=SamplingOptions(temperature=0.9, seed=8)))],
                         joins=[0], cap=3)  # fmt: skip
    assert other[0] != alone[0], "another seed draws another sample"


def test_a_fixed_draft_cap_follows_the_batch_width():
    budget = row_budget_cap(16, block_size=7)
    assert [budget(w) for w in (1, 2, 4, 8, 16)] == [7, 7, 3, 1, 1]
    # (lengths from measured costs: tests/test_batch_length.py::test_the_plan_follows_the_batch_width)


def test_each_row_takes_its_length_from_its_own_auto_policy(pair):
    """A row's drafts come from its own draft-length policy within the width's cap: on a curve where
    every verify row costs a whole step (verify(n) = n x verify(1)) auto parks that row (it shares the
    forward as a plain row), a fixed row keeps drafting, and both equal their solo runs."""
    linear = CostCurve(draft_ms=1.0, verify_ms=[10.0 * n for n in range(1, 9)])
    parked = GenerationOptions(max_tokens=24, speculation=SpeculationOptions(cost_curve=linear))
    fixed = GenerationOptions(max_tokens=24, speculation=SpeculationOptions(max_draft_tokens=4))
    requests = [(PROMPTS[1], parked), (PROMPTS[1], fixed)]
    rows = [BatchRow(pair, prompt, options) for prompt, options in requests]
    while any(row.emitted < row.options.max_tokens for row in rows):
        batch_round(pair, rows, draft_cap=row_budget_cap(16))
    assert rows[0].proposed == 0 and rows[0].length.summary()["parked_rounds"] > 0
    assert rows[1].proposed > 0
    for row, (prompt, options) in zip(rows, requests):
        tokens = [t for r in row.rounds for t in r.tokens][: options.max_tokens]
        assert tokens == mlx_dspark.generate(pair, prompt, options=options).tokens


def test_auto_rows_take_their_lengths_from_the_batch_plan(pair):
    """With the machine's packed costs given, the auto rows' lengths are the batch's plan: rows that cost
    nothing draft every round, rows that cost a whole step each park (probing now and
    then); a fixed row keeps its own length; every row equals its solo run."""
    block = pair.draft.num_drafts
    free = BatchCost(rows_ms={1: 10.0, 8: 10.0, 128: 10.0}, sequences_ms={2: 10.0, 4: 10.0}, draft_ms={1: 0.0, 4: 0.0})
    linear = BatchCost(rows_ms={1: 10.0, 128: 1280.0}, sequences_ms={2: 20.0, 4: 40.0}, draft_ms={1: 1.0, 4: 1.0})
    draft_only = SpeculationOptions(lookup="off")  # the DSpark block alone: no lookup blocks beside the plan's
    requests = [(PROMPTS[1], GenerationOptions(max_tokens=22, speculation=draft_only)),
                (PROMPTS[0], GenerationOptions(max_tokens=18, speculation=draft_only)),
                (PROMPTS[2], GenerationOptions(max_tokens=12, speculation=SpeculationOptions(max_draft_tokens=3, lookup="off")))]  # fmt: skip
    for cost in (free, linear):
        rows = [BatchRow(pair, prompt, options) for prompt, options in requests]
        while any(row.emitted < row.options.max_tokens for row in rows):
            batch_round(pair, [r for r in rows if r.emitted < r.options.max_tokens], cost=cost)
        for row, (prompt, options) in zip(rows, requests):
            rounds = list(row.rounds)
            tokens = [t for r in rounds for t in r.tokens][: options.max_tokens]
            assert tokens == mlx_dspark.generate(pair, prompt, options=options).tokens
            lengths = [r.proposed for r in rounds[1:]]  # after the prompt's round
            if row.planned and cost is free:
                # (drafts whose expected gain is below float precision, a^k < 1e-16, are not added)
                assert max(lengths) == block and min(lengths[:-2]) >= 1, lengths
            elif row.planned:
                drafted = [n for n in lengths if n]
                assert row.probes.counts["parked_rounds"] > 0 and len(drafted) <= len(lengths) // PROBE_EVERY + 1, lengths
                assert drafted and max(drafted) <= PROBE_LENGTH, lengths  # probes only (shorter: max_tokens)
            else:
                emitted = [sum(len(r.tokens) for r in rounds[: k + 1]) for k in range(len(rounds) - 1)]
                assert lengths == [min(3, options.max_tokens - e - 1) for e in emitted]  # its own fixed length


def test_a_row_asking_for_tree_rounds_runs_chain_rounds_and_says_so(pair):
    options = GenerationOptions(max_tokens=16, speculation=SpeculationOptions(tree_nodes=6, lookup="off"))
    with pytest.warns(UserWarning, match=r"tree_nodes 6: chain rounds instead of tree rounds \(a batched row") as said:
        out, _ = run_batch(pair, [(PROMPTS[0], options)], joins=[0])
    assert len([w for w in said if "chain rounds instead" in str(w.message)]) == 1
    assert out[0] == mlx_dspark.generate(pair, PROMPTS[0], max_tokens=16, speculative=False).tokens
