"""Batched rows propose as single requests do (engine/batch/round.py over engine/policy/proposal_choice.py): lookup blocks and
a grammar's forced runs beside the DSpark block of the batch's one packed draft forward.

Greedy rows with lookup on / off / only and a JSON-schema row with fast-forward equal their solo runs
token for token while verifying lookup and forced blocks; a sampled row with lookup keeps the target's
exact distribution (chi-square over many seeded rows, run as batches); the server with --max-batch 2
verifies a repetitive prompt in fewer target forwards with lookup on than off.
"""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.cli.demo import demo_pair
from mlx_dspark.engine.batch.round import BatchRow, batch_round
from tests.batch_helpers import drive_batch
from mlx_dspark.engine.batch.length import BatchCost, row_budget_cap
from mlx_dspark.engine.policy.proposal_choice import Chooser, RoundCost
from mlx_dspark.engine.logits.constraints import Constraint
from mlx_dspark.engine.proposers.lookup import ContextIndex
from mlx_dspark.engine.options import GenerationOptions, SamplingOptions, SpeculationOptions
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.engine.costs.curve import CostCurve
from tests.engine_helpers import count_round, greedy_reference, make_target
from tests.test_lookup import PROMPT, REPEATING, SCHEMA, VOCAB, exact_distribution
from tests.test_lossless_sampling import chi_square_p_value, marginals
from tests.test_server import call, pair_loader, running_server

FLAT = CostCurve(draft_ms=1.0, verify_ms=(10.0, 10.5))  # a given curve: no measurement in the tests


@pytest.fixture(scope="module")
def pair():
    """The trained demo pair (qwen3, 6 small layers): it copies a repeating prompt, so lookup pays (the
    tiny random pairs never continue one)."""
    demo = demo_pair()
    return mlx_dspark.load(str(demo.target), draft=str(demo.draft))


def run_rows(model, requests, *, joins, cap=row_budget_cap(16), cost=None):
    """Batch rounds as a server drives them (requests join at the given rounds): each one's tokens and row
    (`row.forwards`: the rounds that gave it a step, the count `target_forwards` makes for a single request)."""
    out, rows, _ = drive_batch(model, requests, joins=joins, draft_cap=cap, cost=cost, prefill_chunk=16)
    return out, rows


def test_chooser_plan_then_finish_is_propose():
    """The split the batch uses: a lookup plan is ready without a draft; a draft plan asks for its block."""
    chooser = Chooser(draft=None, index=ContextIndex(list(range(20)) * 3, ngram_sizes=(4,)), cost=RoundCost.default())
    plan = chooser.plan(num_tokens=0, room=40)
    assert plan.draft_size == 0 and plan.proposal.source == "lookup"
    assert plan.proposal.tokens[0].tolist() == list(range(plan.proposal.tokens.shape[1]))
    assert chooser.chosen["lookup"] == 1


# packed forwards memory-bound up to 24 rows, a whole step per row past them: long lookup blocks crowd drafts out
KNEE = BatchCost(rows_ms={1: 10.0, 24: 12.0, 128: 77.0}, sequences_ms={2: 12.0, 4: 12.0}, draft_ms={1: 3.0, 4: 4.0})


@pytest.mark.parametrize("planned", [False, True], ids=["own-lengths", "batch-plan"])
def test_greedy_rows_with_lookup_and_fast_forward_equal_their_solo_runs(pair, planned):
    tokenizer = pair.tokenizer
    repeating = tokenizer.encode(REPEATING)
    quiet = SpeculationOptions(cost_curve=FLAT)
    requests = [
        (repeating, GenerationOptions(max_tokens=60, speculation=quiet)),
        (repeating, GenerationOptions(max_tokens=40, speculation=SpeculationOptions(lookup="off", cost_curve=FLAT))),
        (tokenizer.encode("Hello"), GenerationOptions(max_tokens=60, speculation=quiet, constraint=Constraint.json_schema(SCHEMA))),
        (repeating, GenerationOptions(max_tokens=50, speculation=SpeculationOptions(lookup="only", cost_curve=FLAT))),
        (repeating[:30], GenerationOptions(max_tokens=30, speculation=SpeculationOptions(max_draft_tokens=3, cost_curve=FLAT),
                                           sampling=SamplingOptions(repetition_penalty=1.2))),
    ]  # fmt: skip
    out, rows = run_rows(pair, requests, joins=[0, 0, 1, 2, 3], **(dict(cap=None, cost=KNEE) if planned else {}))
    for i, (prompt, options) in enumerate(requests):
        solo = mlx_dspark.generate(pair, prompt, options=options)
        assert out[i] == solo.tokens, f"request {i}"
    assert rows[1].chooser is None  # lookup off, no grammar: the DSpark block alone, as before
    assert rows[0].chooser.chosen["lookup"] > 0 and rows[3].chooser.chosen["lookup"] > 0, (rows[0].chooser.chosen, rows[3].chooser.chosen)
    assert rows[3].proposer is None and rows[3].chooser.draft is None  # lookup only: no draft forward for it
    assert rows[2].chooser.forced_tokens > 0  # the schema's forced runs were verified
    assert rows[0].accepted > 0 and rows[3].accepted > 0


@pytest.mark.parametrize("kind", ["lookup", "schema"])
def test_a_row_alone_takes_as_many_target_forwards_as_its_solo_run(pair, kind):
    """Alone in the batch (the cap of width 1 is the block), a row proposes what the single request does:
    lookup blocks, forced runs, masked drafts (the row's draft hook) -> the same forwards, the same tokens."""
    speculation = SpeculationOptions(cost_curve=FLAT)
    if kind == "lookup":
        request = (pair.tokenizer.encode(REPEATING), GenerationOptions(max_tokens=60, speculation=speculation))
    else:
        request = (pair.tokenizer.encode("Hello"),
                   GenerationOptions(max_tokens=60, speculation=speculation, constraint=Constraint.json_schema(SCHEMA)))
    out, rows = run_rows(pair, [request], joins=[0])
    solo = mlx_dspark.generate(pair, request[0], options=request[1])
    assert out[0] == solo.tokens
    assert rows[0].forwards == solo.target_forwards < len(solo.tokens), (rows[0].forwards, solo.target_forwards)


def test_lookup_rows_on_a_sliding_target_verify_and_roll_back_long_blocks():
    """A target that loops (tied head, larger embeddings) with sliding-window layers, no draft: lookup
    blocks past 8 tokens are verified in the packed forward and rolled back within the rows' own caches
    (BatchRow's caches roll back 32), beside a plain row; both equal the target's own greedy decoding."""
    target = make_target("spark2_5", seed=1, embedding_scale=0.3, layers=2)
    model = SimpleNamespace(target=target, draft=None, heads={})
    prompts = [[5, 17, 33, 5, 17, 60, 2, 9, 5, 17], [7, 3, 7, 3, 40, 41]]
    options = [GenerationOptions(max_tokens=64, speculation=SpeculationOptions(cost_curve=FLAT)),
               GenerationOptions(max_tokens=30, speculation=SpeculationOptions(speculative=False))]
    rows = [BatchRow(model, p, o) for p, o in zip(prompts, options)]
    tokens, proposed = [[], []], []
    while len(tokens[0]) < 64 or len(tokens[1]) < 30:
        active = [i for i, n in enumerate((64, 30)) if len(tokens[i]) < n]
        batch_round(model, [rows[i] for i in active], draft_cap=0)
        for i in active:
            while rows[i].rounds:
                step = rows[i].rounds.popleft()
                tokens[i].extend(step.tokens)
                if i == 0 and step.verified:
                    proposed.append(step.proposed)
    assert tokens[0][:64] == greedy_reference(target, prompts[0], 64)
    assert tokens[1][:30] == greedy_reference(target, prompts[1], 30)
    assert max(proposed) > 8 and len(proposed) < 40, proposed  # long lookup blocks: fewer forwards than tokens


def test_sampled_rows_with_lookup_keep_the_exact_target_distribution():
    """Many seeded sampled rows with lookup on (no draft: every block a lookup block), in batches of 50."""
    target = make_target("spark2_5", seed=11, vocab_size=VOCAB, layers=2, window=4, embedding_scale=0.5)
    model = SimpleNamespace(target=target, draft=None, heads={})
    length, runs, width = 3, 1000, 50
    exact = exact_distribution(target, Sampler(temperature=1.0), length)
    counts, stats = np.zeros([VOCAB] * length), Counter()
    for start in range(0, runs, width):
        options = [GenerationOptions(max_tokens=8, sampling=SamplingOptions(temperature=1.0, seed=start + k),
                                     speculation=SpeculationOptions(cost_curve=FLAT)) for k in range(width)]  # fmt: skip
        rows = [BatchRow(model, PROMPT, o) for o in options]
        tokens = [[] for _ in rows]
        while any(len(t) < length for t in tokens):
            active = [i for i, t in enumerate(tokens) if len(t) < length]
            batch_round(model, [rows[i] for i in active], draft_cap=0)
            for i in active:
                while rows[i].rounds:
                    step = rows[i].rounds.popleft()
                    tokens[i].extend(step.tokens)
                    count_round(stats, step)
        for t in tokens:
            counts[tuple(t[:length])] += 1
    assert stats["accepted"] > 0 and stats["rejected"] > 0, stats  # both paths of the acceptance exercised
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > 1e-4
    for observed, expected in zip(marginals(counts), marginals(exact)):
        assert chi_square_p_value(observed, expected) > 1e-4


def test_server_batch_verifies_a_repeating_prompt_in_fewer_forwards_with_lookup():
    """--max-batch 2, two concurrent requests on a repeating prompt: the same texts, fewer batch rounds
    (one packed target forward each) with lookup on than off."""
    demo = demo_pair()
    prompt = REPEATING * 2
    texts, rounds = {}, {}
    for lookup in ("off", "on"):
        defaults = GenerationOptions(max_tokens=48, speculation=SpeculationOptions(lookup=lookup, cost_curve=FLAT))
        with running_server(pair_loader((demo.target, demo.draft)), defaults=defaults, max_batch=2) as srv:
            replies: list = [None, None]

            def ask(i, srv=srv, replies=replies):
                replies[i] = call(srv, "POST", "/v1/completions", {"prompt": prompt[i:], "temperature": 0})

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert all(r is not None and r[0] == 200 for r in replies), replies
            assert srv.worker.peak_active == 2
            texts[lookup] = [r[2]["choices"][0]["text"] for r in replies]
            rounds[lookup] = srv.worker.rounds
    assert texts["on"] == texts["off"]
    assert rounds["on"] < 0.7 * rounds["off"], rounds
