"""Sampled tree acceptance (issue 37): recursive rejection over siblings, against a NumPy restatement and the
exact target distribution, for a chain, a wide and a deep-and-wide tree.

The target is a Markov table over a tiny vocabulary (the distribution after a token depends on that token),
so every tree row's distribution is known and the joint of the first tokens is exact. Trials run batched
(one call of `accept_tree_sampled` for thousands of them). Then tree rounds on a tiny target: the first tokens'
distribution, and the caches after every sampled round.
"""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.engine.tree.grow import Tree
from mlx_dspark.engine.tree.accept import accept_tree_sampled
from mlx_dspark.engine.tree.rounds import tree_steps
from tests.test_lossless_sampling import PROMPT, chi_square_p_value, exact_distribution

VOCAB = 5
TRIALS = 20000
MIN_P_VALUE = 1e-4  # fixed seeds: deterministic; this sets the strictness

SHAPES = {
    "chain": Tree(tokens=[1, 2, 3], parents=[0, 1, 2], depths=[1, 2, 3], path_probs=[1.0] * 3),
    "wide": Tree(tokens=[0, 1, 2], parents=[0, 0, 0], depths=[1, 1, 1], path_probs=[1.0] * 3),
    "deep_and_wide": Tree(
        tokens=[1, 3, 2, 0, 1, 4, 2], parents=[0, 0, 1, 1, 2, 3, 3], depths=[1, 1, 2, 2, 2, 3, 3], path_probs=[1.0] * 7
    ),
}


def markov_table(seed: int = 0) -> np.ndarray:
    """(V, V): row t is the target's distribution after token t; peaked enough that trees get accepted."""
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.full(VOCAB, 0.6), size=VOCAB)


def row_probs(tree: Tree, table: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """(N, 1 + B, V): the target's distribution at every row, per trial's anchor."""
    nodes = np.broadcast_to(table[tree.tokens], (len(anchors), tree.size, VOCAB))
    return np.concatenate([table[anchors][:, None], nodes], axis=1)


def restated_outcomes(tree: Tree, probs: np.ndarray, *, residual: bool = True) -> dict[tuple, float]:
    """NumPy restatement, as exact probabilities of each (accepted node rows, bonus token) outcome of one round.

    At a row with target distribution p, its children (point-mass drafts q = one-hot) are tried in row
    order: child c accepted with min(1, p(c) / q(c)); after a rejection p <- normalize(max(p - q, 0)); the
    bonus is drawn from the p left after the last child. `residual=False` keeps p after rejections (wrong).
    """
    outcomes: dict[tuple, float] = {}

    def visit(row: int, path: tuple, mass: float) -> None:
        p = probs[row].astype(np.float64)
        for child in [i + 1 for i, parent in enumerate(tree.parents) if parent == row]:
            q = np.eye(VOCAB)[tree.tokens[child - 1]]
            accept = min(1.0, p[tree.tokens[child - 1]] / q[tree.tokens[child - 1]])
            visit(child, path + (child,), mass * accept)
            mass *= 1 - accept
            if residual:
                left = np.maximum(p - q, 0.0)
                p = left / left.sum()
        for token in range(VOCAB):
            if mass * p[token] > 0:
                outcomes[(path, token)] = outcomes.get((path, token), 0.0) + mass * p[token]

    visit(0, (), 1.0)
    return outcomes


def sampled_outcomes(tree: Tree, probs: np.ndarray, seed: int) -> Counter:
    """(accepted node rows, bonus) per trial from one batched call of `accept_tree_sampled`."""
    mx.random.seed(seed)
    acceptance = accept_tree_sampled(
        node_tokens=mx.array(tree.tokens), parents=mx.array(tree.parents), depths=mx.array(tree.depths),
        ancestors=tree.ancestors(), target_probs=mx.array(probs, dtype=mx.float32), max_depth=tree.max_depth,
    )  # fmt: skip
    accepted, rows, tokens = (np.array(a) for a in (acceptance.accepted, acceptance.rows, acceptance.tokens))
    for a, r, t in zip(accepted, rows, tokens):
        assert list(t[:a]) == [tree.tokens[row - 1] for row in r[1 : a + 1]]  # the committed nodes are the path's
    return Counter((tuple(int(x) for x in r[1 : a + 1]), int(t[a])) for a, r, t in zip(accepted, rows, tokens))


def p_value(counts: Counter, exact: dict[tuple, float]) -> float:
    keys = sorted(set(exact) | set(counts))
    return chi_square_p_value(np.array([counts.get(k, 0) for k in keys], float), np.array([exact.get(k, 0.0) for k in keys]))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sampled_tree_acceptance_draws_each_path_and_bonus_as_the_numpy_restatement_says(shape):
    tree, table = SHAPES[shape], markov_table()
    probs = row_probs(tree, table, np.full(TRIALS, 4))
    exact = restated_outcomes(tree, probs[0])
    counts = sampled_outcomes(tree, probs, seed=11)
    assert p_value(counts, exact) > MIN_P_VALUE
    # the expected accepted length is the sum over nodes of the target's probability of the node's path
    path_mass = [table[4][tree.tokens[0]]]
    for i in range(1, tree.size):
        parent = tree.parents[i]
        path_mass.append((path_mass[parent - 1] if parent else 1.0) * probs[0, parent, tree.tokens[i]])
    mean = sum(len(path) * n for (path, _), n in counts.items()) / TRIALS
    assert mean == pytest.approx(sum(path_mass), abs=4 * math.sqrt(tree.max_depth**2 / TRIALS))
    assert mean > 0.3  # the trees do get accepted


@pytest.mark.parametrize("shape", ["wide", "deep_and_wide"])
def test_the_check_above_fails_for_a_rejection_rule_without_the_residual(shape):
    tree = SHAPES[shape]
    probs = row_probs(tree, markov_table(), np.full(TRIALS, 4))
    counts = sampled_outcomes(tree, probs, seed=11)
    assert p_value(counts, restated_outcomes(tree, probs[0], residual=False)) < 1e-6


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sampled_tree_rounds_commit_the_first_three_tokens_with_the_targets_joint_distribution(shape):
    """Rounds of the same tree shape after each trial's last token, until three tokens are committed."""
    tree, table = SHAPES[shape], markov_table(seed=1)
    mx.random.seed(5)
    anchors = np.full(TRIALS, 2)
    committed = [[] for _ in range(TRIALS)]
    accepted_total = 0
    for _ in range(3):  # a round commits at least one token
        acceptance = accept_tree_sampled(
            node_tokens=mx.array(tree.tokens), parents=mx.array(tree.parents), depths=mx.array(tree.depths),
            ancestors=tree.ancestors(), target_probs=mx.array(row_probs(tree, table, anchors), dtype=mx.float32),
            max_depth=tree.max_depth,
        )  # fmt: skip
        accepted, tokens = np.array(acceptance.accepted), np.array(acceptance.tokens)
        accepted_total += int(accepted.sum())
        for n in range(TRIALS):
            committed[n].extend(int(t) for t in tokens[n, : accepted[n] + 1])
        anchors = tokens[np.arange(TRIALS), accepted]
    joint = table[2][:, None, None] * table[:, :, None] * table[None, :, :]  # P(x1) P(x2 | x1) P(x3 | x2)
    counts = np.zeros((VOCAB,) * 3)
    for tokens in committed:
        counts[tuple(tokens[:3])] += 1
    assert accepted_total > 0.3 * TRIALS  # drafts were accepted (and rejected: the rounds went on)
    assert chi_square_p_value(counts.reshape(-1), joint.reshape(-1)) > MIN_P_VALUE
    for k in range(3):  # each position's marginal as well
        axes = tuple(a for a in range(3) if a != k)
        assert chi_square_p_value(counts.sum(axis=axes), joint.sum(axis=axes)) > MIN_P_VALUE


def test_a_tree_without_nodes_draws_the_bonus_from_the_anchors_distribution():
    tree = Tree(tokens=[], parents=[], depths=[], path_probs=[])
    probs = row_probs(tree, markov_table(), np.full(TRIALS, 0))
    counts = sampled_outcomes(tree, probs, seed=3)
    assert p_value(counts, restated_outcomes(tree, probs[0])) > MIN_P_VALUE


# -- sampled tree rounds on a real target ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    from tests.engine_helpers import make_draft, make_target

    target = make_target("qwen3", seed=5, vocab_size=8, layers=2, embedding_scale=0.5)
    return target, make_draft(target, seed=6, layers=1, markov_head_type="gated")


ROUND_SAMPLER = Sampler(temperature=1.0, top_k=6)


def test_sampled_tree_rounds_of_a_dspark_draft_give_the_targets_distribution_of_the_first_tokens(pair):
    target, draft = pair
    exact = exact_distribution(target, ROUND_SAMPLER, 2)
    mx.random.seed(21)
    counts, accepted, rounds = np.zeros((8, 8)), 0, 0
    for _ in range(400):
        proposer = DraftProposer(draft, target, greedy=True, temperature=1.0)
        tokens = []
        for step in tree_steps(target, proposer, PROMPT, num_nodes=5, max_depth=3, sampler=ROUND_SAMPLER):
            tokens.extend(step.tokens)
            accepted += step.accepted
            rounds += step.verified
            if len(tokens) >= 2:
                break
        counts[tuple(tokens[:2])] += 1
    assert accepted > 0.2 * rounds  # the trees were accepted in part
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > MIN_P_VALUE


def test_after_each_sampled_tree_round_every_cache_holds_what_a_cold_prefill_of_the_committed_tokens_leaves(pair):
    target, draft = pair
    proposer = DraftProposer(draft, target, greedy=True, temperature=1.0)
    prompt_cache = PromptCache(target, max_snapshots=0)
    mx.random.seed(8)
    committed, accepted = [], 0
    for step in tree_steps(target, proposer, PROMPT, num_nodes=10, max_depth=4, sampler=ROUND_SAMPLER, prompt_cache=prompt_cache):
        committed.extend(step.tokens)
        accepted += step.accepted
        held = PROMPT + committed[:-1]  # the newest token is the next anchor, not in the caches yet
        cold = target.make_cache()
        target(mx.array(held)[None], cache=cold)
        for cache, fresh in zip(prompt_cache.target_cache, cold):
            assert cache.offset == fresh.offset == len(held)
            assert mx.allclose(cache.keys[..., : cache.offset, :], fresh.keys[..., : fresh.offset, :], atol=1e-4).item()
            assert mx.allclose(cache.values[..., : cache.offset, :], fresh.values[..., : fresh.offset, :], atol=1e-4).item()
        if len(committed) >= 50:
            break
    assert accepted >= 10  # paths of accepted nodes were committed, not only bonus tokens
