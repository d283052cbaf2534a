"""Lookup drafts and grammar fast-forward (engine/proposers/lookup.py, engine/policy/proposal_choice.py): lossless in every mode.

Greedy: lookup off / on (beside the DSpark draft) / only (no draft), with and without a grammar's forced
runs, must give exactly the tokens of plain greedy decoding. Sampled: a lookup proposal is a deterministic
draft; thousands of short runs on a V = 8 target must fit the target's exact distribution (chi-square).
"""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.engine.costs.curve import CostCurve
from mlx_dspark.engine.policy.proposal_choice import Chooser, RoundCost, accepted_drafts
from mlx_dspark.engine.logits.constraints import Constraint, ToolCallShape
from mlx_dspark.engine.round.decode import speculative_steps
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.proposers.lookup import LOOKUP_MAX_TOKENS, ContextIndex, LookupProposer
from mlx_dspark.engine.policy.mask_choice import MaskChoice
from mlx_dspark.engine.logits.sample import Sampler
from tests.engine_helpers import greedy_reference, make_target, sampled_prefix
from tests.test_lossless_sampling import chi_square_p_value, marginals

# a prompt whose text repeats: lookup finds matches in it from the first round
REPEATING = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "count": {"type": "integer", "minimum": 0, "maximum": 99},
                   "kind": {"enum": ["alpha", "beta"]}},
    "required": ["name", "count", "kind"],
    "additionalProperties": False,
}


def test_index_continues_the_latest_match_and_repeats_past_the_end():
    index = ContextIndex([5, 6, 7, 8, 9, 5, 6, 7], ngram_sizes=(3, 2))
    match = index.continuation(max_tokens=4)
    assert match.tokens == [8, 9, 5, 6] and match.length == 3
    # a period-2 pattern: the overlapping copy goes on past the context's end
    assert ContextIndex([1, 2, 1, 2, 1, 2], ngram_sizes=(2,)).continuation(max_tokens=5).tokens == [1, 2, 1, 2, 1]
    # pending tokens take part in the match; no match proposes nothing
    assert index.continuation([8], max_tokens=2).tokens == [9, 5]
    assert ContextIndex([1, 2, 3, 4], ngram_sizes=(2,)).continuation(max_tokens=3).tokens == []
    index.extend([8])  # committed tokens are indexed: the suffix (7, 8) now matches
    assert index.continuation(max_tokens=2).tokens == [9, 5]
    with pytest.raises(ValueError, match="ngram_sizes"):
        ContextIndex([1], ngram_sizes=(0,))


def _naive_continuation(
    context: list[int], pending: list[int], sizes: tuple[int, ...], max_tokens: int
) -> tuple[list[int], int]:
    """The rule restated on one list: the longest suffix n-gram of context + pending at its latest earlier end
    in the context (pending tokens are not indexed), extended backwards (up to 16 tokens), then an overlapping copy."""
    seq = context + pending
    last = len(seq) - 1
    for n in sorted(sizes, reverse=True):
        if len(seq) <= n:
            continue
        ends = [e for e in range(n - 1, min(last, len(context))) if seq[e + 1 - n : e + 1] == seq[last + 1 - n :]]
        if not ends:
            continue
        end, length = ends[-1], n
        while length < 16 and end - length >= 0 and seq[end - length] == seq[last - length]:
            length += 1
        out = list(seq)
        for i in range(max_tokens):
            out.append(out[end + 1 + i])
        return out[len(seq):], max([b for b in (2, 3, 4, 8, 16) if b <= length] or [length])
    return [], 0


def test_index_continuation_equals_the_rule_on_one_list_with_pending_tokens():
    rng = np.random.default_rng(3)
    for trial in range(200):
        context = rng.integers(0, 4 if trial % 2 else 12, size=int(rng.integers(1, 60))).tolist()
        pending = rng.integers(0, 4, size=int(rng.integers(0, 4))).tolist()
        max_tokens = int(rng.integers(1, 40))
        match = ContextIndex(context, ngram_sizes=(8, 4, 2)).continuation(pending, max_tokens=max_tokens)
        assert (match.tokens, match.length) == _naive_continuation(context, pending, (8, 4, 2), max_tokens)


def test_chooser_prefers_a_long_confident_lookup_and_sizes_it_by_cost():
    chooser = Chooser(draft=None, index=ContextIndex(list(range(20)) * 3, ngram_sizes=(4,)), cost=RoundCost.default())
    proposal = chooser.propose(mx.array([19]), position=59, num_tokens=0, room=40)
    assert proposal is not None and proposal.source == "lookup" and not proposal.hooked
    assert proposal.tokens.shape[1] > 7  # longer than a draft block: the match is long (16+ tokens back)
    assert proposal.tokens[0].tolist() == list(range(proposal.tokens.shape[1]))
    assert chooser.propose(mx.array([19]), position=59, num_tokens=0, room=3).tokens.shape[1] <= 3  # the room holds
    assert accepted_drafts(0.5, 2) == pytest.approx(0.75)


def test_the_chooser_prices_a_lookup_block_by_its_width_on_the_measured_curve():
    # flat to the draft's widths, then compute-bound: each token past 8 costs a fifth of a forward
    steep = CostCurve(draft_ms=0.3, verify_ms=[1.0] * 8 + [1.0 + 0.2 * (w - 8) for w in range(9, LOOKUP_MAX_TOKENS + 2)])
    cut = CostCurve(draft_ms=0.3, verify_ms=steep.verify_ms[:8])  # what a probe of the draft's widths alone saw
    index = lambda: ContextIndex(list(range(40)) * 3, ngram_sizes=(4,))  # noqa: E731  (a 36-token match)
    widths = {}
    for name, curve in (("steep", steep), ("cut", cut)):
        chooser = Chooser(draft=None, index=index(), cost=RoundCost.from_curve(curve))
        widths[name] = chooser.propose(mx.array([39]), position=119, num_tokens=0, room=40).tokens.shape[1]
    assert widths["cut"] == LOOKUP_MAX_TOKENS  # extrapolated flat past 8: the longest block looks free
    assert widths["steep"] < LOOKUP_MAX_TOKENS // 2  # priced: a narrower block, more tokens per ms


@pytest.fixture(scope="module")
def model(tiny_spark_pair):
    target, draft = tiny_spark_pair
    return mlx_dspark.load(str(target), draft=str(draft))


@pytest.fixture(scope="module")
def target_only(tiny_spark_pair):
    return mlx_dspark.load(str(tiny_spark_pair[0]))


@pytest.mark.parametrize("prompt", [REPEATING, "The quick brown fox"])
def test_greedy_lookup_on_off_and_alone_equal_plain(model, target_only, prompt):
    plain = mlx_dspark.generate(model, prompt, max_tokens=60, speculative=False)
    for lookup in ("off", "on", "only"):
        result = mlx_dspark.generate(model, prompt, max_tokens=60, lookup=lookup)
        assert result.tokens == plain.tokens, lookup
    alone = mlx_dspark.generate(target_only, prompt, max_tokens=60, lookup="on")  # a target without a draft
    assert alone.tokens == plain.tokens


def test_lookup_alone_saves_target_forwards_on_a_looping_target():
    # a tied head over larger embeddings: the target repeats itself (runs of one token), as agents re-emit text
    target = make_target("spark2_5", seed=1, embedding_scale=0.3, layers=2)
    prompt = [5, 17, 33, 5, 17, 60, 2, 9, 5, 17]
    reference = greedy_reference(target, prompt, 64)
    long_blocks = 0
    for proposer in (Chooser(draft=None, index=ContextIndex(prompt)), LookupProposer(prompt, max_tokens=LOOKUP_MAX_TOKENS)):
        tokens, rounds = [], 0
        # the target's rotating windows roll back any verify exactly: blocks longer than a window's 8 spare rows
        cache = PromptCache(target, max_snapshots=0, max_rollback=LOOKUP_MAX_TOKENS)
        for step in speculative_steps(target, proposer, prompt, sampler=Sampler(), max_tokens=64, prompt_cache=cache):
            tokens.extend(step.tokens)
            rounds += step.verified
            assert step.proposed <= LOOKUP_MAX_TOKENS
            long_blocks += step.proposed > 8
            if len(tokens) >= 64:
                break
        assert tokens[:64] == reference
        assert rounds < 40, rounds  # lookup verified runs of the loop: fewer forwards than tokens
    assert long_blocks > 0  # blocks longer than 8 were verified (and rolled back where rejected)


def test_greedy_lookup_with_penalties_and_logprobs_equals_plain(model):
    knobs = dict(max_tokens=40, repetition_penalty=1.3, presence_penalty=0.5, logprobs=2)
    plain = mlx_dspark.generate(model, REPEATING, speculative=False, **knobs)
    for lookup in ("on", "only"):
        result = mlx_dspark.generate(model, REPEATING, lookup=lookup, **knobs)
        assert result.tokens == plain.tokens
        assert [round(lp.logprob, 4) for lp in result.logprobs] == [round(lp.logprob, 4) for lp in plain.logprobs]


@pytest.mark.parametrize("constraint", [
    Constraint.json_schema(SCHEMA),
    Constraint.tool_calls([ToolCallShape("<tool_call>\n", SCHEMA, "\n</tool_call>")], parallel=False),
], ids=["schema", "tool_call"])
def test_grammar_fast_forward_is_lossless_and_commits_forced_runs_in_one_forward(model, target_only, constraint):
    plain = mlx_dspark.generate(model, "Hello", constraint=constraint, max_tokens=80, speculative=False)
    for knobs in (dict(fast_forward=False), dict(), dict(mask_draft=False), dict(mask_draft="auto"), dict(lookup="on"),
                  dict(lookup="only"), dict(lookup="on", mask_draft="auto")):
        result = mlx_dspark.generate(model, "Hello", constraint=constraint, max_tokens=80, **knobs)
        assert result.tokens == plain.tokens, knobs
    # without a draft, the forced runs alone are verified: several tokens per target forward
    alone = mlx_dspark.generate(target_only, "Hello", constraint=constraint, max_tokens=80)
    assert alone.tokens == plain.tokens
    assert alone.rounds < len(alone.tokens) - 8, alone.acceptance_lengths
    text = alone.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    if alone.finish_reason == "stop":
        jsonschema.validate(json.loads(text), SCHEMA)


def test_lookup_option_is_checked(model):
    with pytest.raises(ValueError, match="lookup must be one of off, on, only"):
        mlx_dspark.generate(model, "Hi", lookup="yes")


# -- sampled lookup drafting: the exact distribution ------------------------------------------------

VOCAB = 8
PROMPT = [1, 5, 2, 1, 5, 2, 1, 5, 2, 1]  # lookup proposes from the first round
RUNS = 1000


def exact_distribution(target, sampler: Sampler, length: int) -> np.ndarray:
    joint, prefixes = np.ones([1]), [[]]
    for _ in range(length):
        logits, _ = target(mx.array([PROMPT + p for p in prefixes], dtype=mx.int32))
        probs = np.array(sampler.probs(logits[:, -1]), dtype=np.float64)
        joint = (joint.reshape(-1, 1) * probs).reshape(-1)
        prefixes = [p + [t] for p in prefixes for t in range(VOCAB)]
    return joint.reshape([VOCAB] * length)


def test_sampled_lookup_drafting_matches_the_exact_target_distribution():
    target = make_target("spark2_5", seed=11, vocab_size=VOCAB, layers=2, window=4, embedding_scale=0.5)
    sampler = Sampler(temperature=1.0)
    length = 3
    exact = exact_distribution(target, sampler, length)
    mx.random.seed(2024)
    counts, stats = np.zeros([VOCAB] * length), Counter()
    for _ in range(RUNS):
        proposer = Chooser(draft=None, index=ContextIndex(PROMPT, ngram_sizes=(2, 1)))
        counts[sampled_prefix(speculative_steps(target, proposer, PROMPT, sampler=sampler), length, stats)] += 1
    assert stats["accepted"] > 0 and stats["rejected"] > 0  # both paths exercised
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > 1e-4
    for observed, expected in zip(marginals(counts), marginals(exact)):
        assert chi_square_p_value(observed, expected) > 1e-4


def test_generate_cli_draft_lookup_and_lookup_flag(tiny_spark_pair):
    from typer.testing import CliRunner

    from mlx_dspark.cli.generate import app

    target, draft = tiny_spark_pair
    common = ["--model", str(target), "--prompt", REPEATING, "--no-chat-template", "--max-tokens", "16", "--json", "--compare"]
    for extra in (["--draft", "lookup"], ["--draft", str(draft), "--lookup", "on"]):
        out = CliRunner().invoke(app, common + extra)
        assert out.exit_code == 0, out.output
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["speculative"] is True and result["plain"]["identical"] is True, extra
    bad = CliRunner().invoke(app, common + ["--lookup", "maybe"])
    assert bad.exit_code == 2 and "--lookup" in bad.output


def test_auto_mask_choice_measures_both_modes_then_keeps_the_faster_and_explores():
    now = [0.0]
    choice = MaskChoice(explore_every=10, clock=lambda: now[0])
    seconds = {True: 0.01, False: 0.03}  # masked rounds take 10 ms, unmasked 30 ms, both commit 3 tokens
    modes = []
    choice.observe(1)  # the prefill's token: starts the clock
    for _ in range(30):
        modes.append(choice.masked)
        now[0] += seconds[choice.masked]
        choice.observe(3)
    assert modes[:6] == [True] * 3 + [False] * 3  # warm-up: each mode measured
    assert modes[6:].count(True) > 18 and False in modes[6:]  # then the faster, with an occasional re-try


def test_server_no_draft_with_lookup_named_serves_lookup_alone(tiny_spark_pair, monkeypatch):
    from typer.testing import CliRunner

    from mlx_dspark.cli.server import app
    from mlx_dspark.serve import app as serve_app

    served = []

    def make_server(loader, **options):
        served.append((loader.keywords["draft"], options["defaults"].speculation))
        raise ValueError("stop here")

    monkeypatch.setattr(serve_app, "make_server", make_server)
    target, draft = map(str, tiny_spark_pair)
    named = CliRunner().invoke(app, ["--model", target, "--draft", draft, "--no-draft", "--lookup", "on", "--port", "0"])
    assert "prompt-lookup drafts alone" in named.output
    CliRunner().invoke(app, ["--model", target, "--draft", draft, "--no-draft", "--port", "0"])
    (alone_draft, alone), (plain_draft, plain) = served
    assert alone_draft is None and alone.speculative and alone.lookup == "on"  # no draft loaded, lookup proposes
    assert plain_draft is None and not plain.speculative  # --no-draft by itself: the plain baseline
