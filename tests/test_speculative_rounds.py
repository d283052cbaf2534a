"""The speculative round with a test-only oracle proposer: accept-all, reject-anywhere, rollback."""

from __future__ import annotations

import pytest

from mlx_dspark.engine.round.decode import speculative_steps
from mlx_dspark.engine.options import OptionError, SpeculationOptions
from mlx_dspark.engine.logits.sample import Sampler
from tests.engine_helpers import OracleProposer, greedy_reference, make_target

FAMILIES = ["spark2_5", "qwen3"]


def run_rounds(target, proposer, prompt, num_tokens, **kwargs):
    tokens, rounds = [], []
    for step in speculative_steps(target, proposer, prompt, sampler=Sampler(), **kwargs):
        tokens.extend(step.tokens)
        if step.verified:
            rounds.append(step)
        if len(tokens) >= num_tokens:
            break
    return tokens[:num_tokens], rounds


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    # window 16 so that the 40-token prompt and the long generation both cross it
    return make_target(request.param, seed=3)


def test_accept_all_commits_eight_tokens_per_round_and_matches_plain_greedy(target):
    prompt = list(range(5, 45))
    reference = greedy_reference(target, prompt, 120)
    proposer = OracleProposer(reference, len(prompt), target.args.vocab_size, errors=lambda r: ())
    tokens, rounds = run_rounds(target, proposer, prompt, 120, max_tokens=120)
    assert tokens == reference
    assert all(r.accepted == r.proposed == 7 for r in rounds[:-2])  # the last rounds are cut by max_tokens
    assert all(len(r.tokens) == 8 for r in rounds[:-2])


@pytest.mark.parametrize("position", range(1, 8))
def test_rejection_at_each_draft_position_rolls_back_and_stays_identical(target, position):
    prompt = [7, 3, 9, 1, 4]
    reference = greedy_reference(target, prompt, 68)  # room for the last round's proposal
    proposer = OracleProposer(reference, len(prompt), target.args.vocab_size, errors=lambda r: (position,))
    tokens, rounds = run_rounds(target, proposer, prompt, 60)
    assert tokens == reference[:60]
    # a rejection at draft position k accepts k - 1 drafts and commits k tokens
    assert all(r.accepted == position - 1 and len(r.tokens) == position for r in rounds)


def test_mixed_error_pattern_over_a_long_run_crosses_the_window_many_times(target):
    prompt = list(range(1, 30))
    reference = greedy_reference(target, prompt, 308)
    pattern = [(), (1,), (4,), (7,), (2, 5), (), (3,), (6,)]
    proposer = OracleProposer(reference, len(prompt), target.args.vocab_size, errors=lambda r: pattern[r % 8])
    tokens, rounds = run_rounds(target, proposer, prompt, 300)
    assert tokens == reference[:300]
    accepted = {r.accepted for r in rounds}
    assert {0, 1, 2, 3, 5, 6, 7} <= accepted


def test_max_tokens_shortens_the_last_proposal(target):
    prompt = [2, 4, 6]
    reference = greedy_reference(target, prompt, 20)
    proposer = OracleProposer(reference, len(prompt), target.args.vocab_size, errors=lambda r: ())
    tokens, rounds = run_rounds(target, proposer, prompt, 11, max_tokens=11)
    assert tokens == reference[:11]
    # 1 (prefill) + 8 + 2: the second round may only propose one draft token
    assert [r.proposed for r in rounds] == [7, 1]


class _RecordingOracle(OracleProposer):
    """The oracle, recording how many draft tokens each round asked for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[int] = []

    def propose(self, anchor, *, position, num_tokens):
        self.asked.append(num_tokens)
        return super().propose(anchor, position=position, num_tokens=num_tokens)


@pytest.mark.parametrize("max_draft_tokens", [1, 3, 7])
def test_max_draft_tokens_caps_every_round_and_stays_identical(target, max_draft_tokens):
    prompt = list(range(3, 23))
    reference = greedy_reference(target, prompt, 68)
    proposer = _RecordingOracle(reference, len(prompt), target.args.vocab_size, errors=lambda r: ())
    speculation = SpeculationOptions(max_draft_tokens=max_draft_tokens)
    tokens, rounds = run_rounds(target, proposer, prompt, 60, speculation=speculation)
    assert tokens == reference[:60]
    assert max(proposer.asked) == max_draft_tokens  # the draft is asked for no more than the cap
    assert all(r.proposed == max_draft_tokens for r in rounds)  # accept-all: every round proposes the cap
    assert all(len(r.tokens) == max_draft_tokens + 1 for r in rounds)


def test_max_draft_tokens_above_the_block_size_is_refused_by_name(target):
    prompt = [1, 2, 3]
    proposer = OracleProposer(greedy_reference(target, prompt, 8), len(prompt), target.args.vocab_size, errors=lambda r: ())
    with pytest.raises(OptionError, match="max_draft_tokens must be at most the draft's block size 7, got 8"):
        run_rounds(target, proposer, prompt, 4, speculation=SpeculationOptions(max_draft_tokens=8))
