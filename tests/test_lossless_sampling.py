"""Lossless sampling: the speculative loop's tokens follow the target's own distribution exactly.

A tiny-vocabulary target (V = 8) lets us compute the exact distribution of the first generated tokens
by enumeration; thousands of short speculative runs (fixed seed) must fit it by a chi-square test.
Every configuration covers accepted drafts, rejections (residual draws) and the all-accepted bonus.
"""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.engine.round.decode import plain_steps, speculative_steps
from mlx_dspark.engine.proposers.base import Proposal, Proposer
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.engine.proposers.dspark import DraftProposer
from tests.engine_helpers import make_draft, make_target

VOCAB = 8
PROMPT = [1, 5, 2, 7, 3]
RUNS = 1000
MIN_P_VALUE = 1e-4  # the fixed seeds make the test deterministic; this only sets the strictness


class RandomDraftProposer(Proposer):
    """Draws each draft token from a fixed random distribution per position (or its argmax)."""

    tap_ids = (0,)
    block_size = 2  # short blocks make the all-accepted bonus path frequent

    def __init__(self, *, greedy: bool, guide: np.ndarray, seed: int = 0):
        # guide: (block_size, V) rough guesses of the target (its marginals), mixed with noise, so
        # drafts are accepted often but not always
        rng = np.random.default_rng(seed)
        noise = rng.dirichlet(np.ones(VOCAB) * 0.7, size=self.block_size)
        self.dists = (0.6 * guide + 0.4 * noise).astype(np.float32)
        self.greedy = greedy

    def extend(self, features: mx.array) -> None:
        pass

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int) -> Proposal:
        dists = mx.array(self.dists[:num_tokens])
        if self.greedy:
            return Proposal(tokens=mx.argmax(dists, axis=-1)[None].astype(mx.int32))
        tokens = mx.random.categorical(mx.log(dists), axis=-1)
        return Proposal(tokens=tokens[None].astype(mx.int32), draft_probs=dists[None])


def exact_distribution(target, sampler: Sampler, length: int) -> np.ndarray:
    """Joint distribution of the first `length` generated tokens, shape (V,) * length."""
    joint = np.ones([1])
    prefixes = [[]]
    for _ in range(length):
        batch = mx.array([PROMPT + p for p in prefixes], dtype=mx.int32)
        logits, _ = target(batch)
        probs = np.array(sampler.probs(logits[:, -1]), dtype=np.float64)  # (N, V)
        joint = (joint.reshape(-1, 1) * probs).reshape(-1)
        prefixes = [p + [t] for p in prefixes for t in range(VOCAB)]
    return joint.reshape([VOCAB] * length)


def chi_square_p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 draws are pooled into one."""
    if counts[expected_probs <= 0].sum() > 0:
        return 0.0  # a token the target can never produce (e.g. outside top-p) was produced
    n = counts.sum()
    expected = expected_probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    if dof == 0:
        return 1.0  # a single possible outcome, which is all that was observed
    # Wilson-Hilferty approximation of the chi-square upper tail
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def sample_runs(target, sampler, proposer_factory, *, length: int, seed: int) -> Counter:
    mx.random.seed(seed)
    outcomes: Counter = Counter()
    stats = Counter()
    for _ in range(RUNS):
        tokens = []
        proposer = proposer_factory()
        steps = speculative_steps(target, proposer, PROMPT, sampler=sampler) if proposer else plain_steps(
            target, PROMPT, sampler=sampler
        )
        for step in steps:
            tokens.extend(step.tokens)
            if step.verified:
                stats["rounds"] += 1
                stats["accepted"] += step.accepted
                stats["all_accepted"] += step.accepted == step.proposed
            if len(tokens) >= length:
                break
        outcomes[tuple(tokens[:length])] += 1
    outcomes.stats = stats  # type: ignore[attr-defined]
    return outcomes


def marginals(joint: np.ndarray) -> np.ndarray:
    """(length, V): the distribution of each generated position."""
    axes = range(joint.ndim)
    return np.stack([joint.sum(axis=tuple(a for a in axes if a != k)) for k in axes])


def to_array(outcomes: Counter, length: int) -> np.ndarray:
    counts = np.zeros([VOCAB] * length)
    for key, n in outcomes.items():
        counts[key] += n
    return counts


@pytest.fixture(scope="module")
def target():
    return make_target("spark2_5", seed=12, vocab_size=VOCAB, layers=2, window=4, embedding_scale=0.5)


SAMPLERS = {
    "temperature": Sampler(temperature=1.0),
    "temperature_top_p": Sampler(temperature=1.0, top_p=0.7),
    "temperature_top_k": Sampler(temperature=1.3, top_k=4),
}


@pytest.mark.parametrize("sampler_name", sorted(SAMPLERS))
@pytest.mark.parametrize("drafting", ["sample", "greedy"])
def test_speculative_sampling_matches_the_exact_target_distribution(target, sampler_name, drafting):
    sampler = SAMPLERS[sampler_name]
    length = 3
    exact = exact_distribution(target, sampler, length)
    guide = marginals(exact)[1:]
    outcomes = sample_runs(
        target, sampler, lambda: RandomDraftProposer(greedy=drafting == "greedy", guide=guide), length=length, seed=1234
    )
    counts = to_array(outcomes, length)
    stats = outcomes.stats
    # the runs exercised acceptance, rejection and the all-accepted bonus
    assert 0 < stats["accepted"] and stats["all_accepted"] > 0 and stats["all_accepted"] < stats["rounds"]
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > MIN_P_VALUE
    for observed, expected in zip(marginals(counts), marginals(exact)):  # each position as well
        assert chi_square_p_value(observed, expected) > MIN_P_VALUE


def test_chi_square_detects_a_wrong_distribution(target):
    """The test above can fail: a biased acceptance rule (always accept) is caught."""
    sampler = SAMPLERS["temperature"]
    exact = exact_distribution(target, sampler, 3)
    guide = marginals(exact)[1:]

    class AlwaysAccepted(RandomDraftProposer):
        # proposing with claimed probability ~0 makes every draft token accepted: biased output
        def propose(self, anchor, *, position, num_tokens):
            proposal = super().propose(anchor, position=position, num_tokens=num_tokens)
            proposal.draft_probs = mx.full(proposal.draft_probs.shape, 1e-9)
            return proposal

    outcomes = sample_runs(target, sampler, lambda: AlwaysAccepted(greedy=False, guide=guide), length=3, seed=99)
    assert chi_square_p_value(to_array(outcomes, 3).reshape(-1), exact.reshape(-1)) < 1e-6


def test_plain_sampling_matches_the_exact_target_distribution(target):
    sampler = SAMPLERS["temperature_top_p"]
    exact = exact_distribution(target, sampler, 2)
    outcomes = sample_runs(target, sampler, lambda: None, length=2, seed=7)
    assert chi_square_p_value(to_array(outcomes, 2).reshape(-1), exact.reshape(-1)) > MIN_P_VALUE


@pytest.mark.parametrize("family, drafting", [("spark2_5", "sample"), ("qwen3", "greedy")])
def test_real_dspark_draft_sampling_matches_the_exact_target_distribution(family, drafting):
    """The real draft model of each family in the loop (its draft_probs, its windowed context)."""
    window = {"window": 4} if family == "spark2_5" else {}
    target = make_target(family, seed=5, vocab_size=VOCAB, layers=4, embedding_scale=0.5, **window)
    draft = make_draft(target, seed=6, markov_head_type="gated" if family == "qwen3" else "vanilla")
    sampler = SAMPLERS["temperature_top_k"]
    exact = exact_distribution(target, sampler, 3)
    outcomes = sample_runs(
        target,
        sampler,
        lambda: DraftProposer(draft, target, greedy=drafting == "greedy", temperature=sampler.temperature),
        length=3,
        seed=4321,
    )
    counts = to_array(outcomes, 3)
    assert outcomes.stats["accepted"] > 0
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > MIN_P_VALUE
    for observed, expected in zip(marginals(counts), marginals(exact)):
        assert chi_square_p_value(observed, expected) > MIN_P_VALUE


def test_p_min_with_sampled_drafting_matches_the_exact_target_distribution(target):
    """A p_min cut decided on the sampled token itself would bias the output; the draft decides it
    on the most likely token's probability, before the draw, so the cut stays lossless."""
    from mlx_dspark.engine.options import SpeculationOptions

    draft = make_draft(target, seed=6, markov_head_type="vanilla")
    sampler = SAMPLERS["temperature"]
    exact = exact_distribution(target, sampler, 3)
    mx.random.seed(2024)
    outcomes: Counter = Counter()
    cut = 0
    for _ in range(RUNS):
        proposer = DraftProposer(draft, target, greedy=False, temperature=sampler.temperature)
        steps = speculative_steps(target, proposer, PROMPT, sampler=sampler, speculation=SpeculationOptions(p_min=0.3, max_draft_tokens=None))
        tokens: list[int] = []
        for step in steps:
            tokens.extend(step.tokens)
            cut += step.verified and step.proposed < proposer.block_size
            if len(tokens) >= 3:
                break
        outcomes[tuple(tokens[:3])] += 1
    assert cut > RUNS // 10  # the cut really happens
    assert chi_square_p_value(to_array(outcomes, 3).reshape(-1), exact.reshape(-1)) > MIN_P_VALUE
