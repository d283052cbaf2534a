"""The reduced-vocabulary draft head (models/heads/draft_vocab.py, FR-Spec) and its rankings (loading/rank_vocab.py).

Lossless by construction: greedy output equals plain greedy decoding, and with sampled drafting the
acceptance test uses exactly the distribution the draft drew from (its K-id softmax scattered onto
the full vocabulary), which a chi-square test against the target's exact distribution checks.
"""

from __future__ import annotations

import json
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

import mlx_dspark
from mlx_dspark.cli.rank_vocab import app as rank_app
from mlx_dspark.engine.round.decode import speculative_steps
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.loading.load import load
from mlx_dspark.loading.rank_vocab import RANK_FILE, count_tokens, ranking, read_ranked_ids
from mlx_dspark.models.heads.draft_vocab import DraftVocabulary
from tests.engine_helpers import greedy_reference, make_draft, make_target
from tests.test_lossless_sampling import PROMPT, RUNS, VOCAB, MIN_P_VALUE, chi_square_p_value, exact_distribution, marginals, to_array


def _restricted(draft, target, ids):
    draft.vocabulary = DraftVocabulary(ids, target=target, markov_head=getattr(draft, "markov_head", None))
    return draft


@pytest.mark.parametrize("family, markov", [("spark2_5", "vanilla"), ("qwen3", "gated"), ("qwen3", "rnn")])
def test_reduced_logits_are_the_full_logits_at_the_kept_ids(family, markov):
    target = make_target(family, seed=1)
    draft = make_draft(target, seed=2, markov_head_type=markov)
    ids = [5, 0, 17, 40, 3, 90]
    vocab = DraftVocabulary(ids, target=target, markov_head=draft.markov_head)
    hidden = mx.random.normal((1, 7, target.args.hidden_size))
    np.testing.assert_allclose(np.array(vocab.logits(hidden)), np.array(target.lm_head_logits(hidden))[..., ids], rtol=1e-5, atol=1e-5)
    features = mx.random.normal((1, draft.args.markov_rank))
    np.testing.assert_allclose(
        np.array(vocab.markov_bias(features)), np.array(draft.markov_head.markov_w2(features))[..., ids], rtol=1e-5, atol=1e-5
    )


def test_greedy_drafting_over_the_reduced_vocabulary_picks_the_argmax_over_the_kept_ids():
    target = make_target("qwen3", seed=3)
    draft = make_draft(target, seed=4)
    anchor = mx.array([7], dtype=mx.int32)
    ctx = draft.make_cache()
    features = mx.random.normal((1, 5, 2 * target.args.hidden_size))
    draft.append_context(features, ctx)
    full = draft.propose(anchor, ctx, target=target)
    ids = list(range(0, target.args.vocab_size, 2))  # the even ids only
    reduced = _restricted(draft, target, ids).propose(anchor, ctx, target=target)
    tokens = np.array(reduced.tokens)[0]
    assert all(t % 2 == 0 for t in tokens)  # proposals are target ids, from the kept set
    # keeping every id gives back the full-vocabulary proposal
    every = _restricted(draft, target, list(range(target.args.vocab_size))).propose(anchor, ctx, target=target)
    assert np.array(every.tokens).tolist() == np.array(full.tokens).tolist()


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
@pytest.mark.parametrize("size", [1, 12, 60])
def test_greedy_speculative_with_a_reduced_vocabulary_equals_plain_greedy(family, size):
    target = make_target(family, seed=5)
    draft = make_draft(target, seed=6)
    prompt = [3, 14, 15, 92, 65, 35, 8, 9, 79]
    reference = greedy_reference(target, prompt, 40)
    # rank the ids the target itself produces most first (a random draft over one id still gets accepted)
    frequent = [t for t, _ in Counter(reference).most_common()]
    ranked = list(dict.fromkeys(frequent + list(range(target.args.vocab_size))))[:size]
    _restricted(draft, target, ranked)
    out, accepted = [], 0
    for step in speculative_steps(target, DraftProposer(draft, target, greedy=True, temperature=1.0), prompt, sampler=Sampler()):
        out.extend(step.tokens)
        accepted += step.accepted
        if len(out) >= 40:
            break
    assert out[:40] == reference
    if size == 1:  # the one id is the target's most frequent token: some drafts must be accepted
        assert accepted > 0


def _sample_runs(target, sampler, proposer_factory, *, seed, runs=RUNS):
    mx.random.seed(seed)
    outcomes: Counter = Counter()
    accepted = 0
    for _ in range(runs):
        tokens = []
        for step in speculative_steps(target, proposer_factory(), PROMPT, sampler=sampler):
            tokens.extend(step.tokens)
            accepted += step.accepted
            if len(tokens) >= 3:
                break
        outcomes[tuple(tokens[:3])] += 1
    return to_array(outcomes, 3), accepted


@pytest.fixture(scope="module")
def small_pair():
    # small on purpose (two target layers, one draft layer): thousands of runs
    target = make_target("spark2_5", seed=5, vocab_size=VOCAB, layers=2, embedding_scale=0.5, window=4)
    draft = make_draft(target, seed=6, layers=1)
    return target, draft


def test_sampled_drafting_over_a_reduced_vocabulary_matches_the_exact_target_distribution(small_pair):
    target, draft = small_pair
    sampler = Sampler(temperature=1.0)
    exact = exact_distribution(target, sampler, 3)
    _restricted(draft, target, [6, 1, 2, 4, 0])  # 5 of 8 ids: some target tokens are never drafted
    counts, accepted = _sample_runs(
        target, sampler, lambda: DraftProposer(draft, target, greedy=False, temperature=1.0), seed=77
    )
    assert accepted > 0
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > MIN_P_VALUE
    for observed, expected in zip(marginals(counts), marginals(exact)):
        assert chi_square_p_value(observed, expected) > MIN_P_VALUE


def test_chi_square_catches_acceptance_against_the_full_vocabulary_softmax(small_pair):
    """The test above can fail: a draft distribution that is not the one drawn from (here the reduced
    softmax's mass under-stated, as a full-vocabulary softmax would state it) biases the output."""
    target, draft = small_pair
    sampler = Sampler(temperature=1.0)
    exact = exact_distribution(target, sampler, 3)
    ids = [6, 1]
    _restricted(draft, target, ids)

    class WrongDistribution(DraftProposer):
        def propose(self, anchor, *, position, num_tokens):
            proposal = super().propose(anchor, position=position, num_tokens=num_tokens)
            # as if normalised over the full vocabulary: most mass on ids the draw can never produce,
            # so the drawn token's probability is under-stated and it is accepted too often
            proposal.draft_probs = proposal.draft_probs * 0.2
            return proposal

    counts, _ = _sample_runs(target, sampler, lambda: WrongDistribution(draft, target, greedy=False, temperature=1.0), seed=78, runs=300)
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) < 1e-6


# -- rankings and loading ------------------------------------------------------------------------


def test_ranking_orders_by_count_then_id_and_covers_every_id():
    counts = np.array([0, 5, 2, 5, 0, 1])
    result = ranking(counts)
    assert result["ranked_ids"] == [1, 3, 2, 5, 0, 4]
    assert result["counts"] == [5, 5, 2, 1, 0, 0]
    assert result["vocab_size"] == 6 and result["tokens_counted"] == 13


def test_count_tokens_refuses_ids_outside_the_vocabulary(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("abc")
    assert count_tokens(lambda t: [0, 1, 1], [path], vocab_size=3).tolist() == [1, 2, 0]
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        count_tokens(lambda t: [0, 3], [path], vocab_size=3)


def test_rank_vocab_cli_and_load_with_draft_vocab(tiny_qwen3_pair, tmp_path):
    target_path, draft_path = tiny_qwen3_pair
    data = tmp_path / "corpus.txt"
    data.write_text("the cat sat on the mat. the cat sat. " * 20)
    out = tmp_path / "rank.json"
    other = tmp_path / "more.txt"
    other.write_text("a mat, a cat.")
    result = CliRunner().invoke(rank_app, ["--model", str(target_path), "--out", str(out), "--data", str(data), str(other)])
    assert result.exit_code == 0, result.output
    ranked = json.loads(out.read_text())
    vocab_size = json.loads((target_path / "config.json").read_text())["vocab_size"]
    assert ranked["vocab_size"] == vocab_size and sorted(ranked["ranked_ids"]) == list(range(vocab_size))
    assert ranked["counts"] == sorted(ranked["counts"], reverse=True) and ranked["counts"][0] > 0
    assert ranked["source"]["files"] == [str(data), str(other)]

    pair = load(target_path, draft_path, draft_vocab=16, draft_vocab_file=out)
    assert pair.draft.vocabulary.size == 16
    assert np.array(pair.draft.vocabulary.ids).tolist() == ranked["ranked_ids"][:16]
    plain = load(target_path)
    prompt = plain.tokenizer.encode("the cat sat on")
    expected = mlx_dspark.generate(plain, prompt, max_tokens=24, speculative=False).tokens
    assert mlx_dspark.generate(pair, prompt, max_tokens=24).tokens == expected


def test_draft_vocab_without_a_ranking_is_one_clear_error(tiny_qwen3_pair):
    target_path, draft_path = tiny_qwen3_pair
    with pytest.raises(ValueError, match=f"no {RANK_FILE} in .*--draft-vocab-file"):
        load(target_path, draft_path, draft_vocab=16)
    with pytest.raises(ValueError, match="draft_vocab_file needs draft_vocab"):
        load(target_path, draft_path, draft_vocab_file="x.json")
    with pytest.raises(ValueError, match="only applies with a draft"):
        load(target_path, draft_vocab=16)


def test_a_ranking_beside_the_draft_is_found(tiny_qwen3_pair, tmp_path):
    import shutil

    target_path, draft_path = tiny_qwen3_pair
    draft = tmp_path / "draft"
    shutil.copytree(draft_path, draft)
    vocab_size = json.loads((target_path / "config.json").read_text())["vocab_size"]
    (draft / RANK_FILE).write_text(json.dumps(ranking(np.arange(vocab_size)[::-1].copy())))
    pair = load(target_path, draft, draft_vocab=4)
    assert np.array(pair.draft.vocabulary.ids).tolist() == [0, 1, 2, 3]


def test_bad_rankings_name_the_file_and_field(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(ranking(np.array([3, 2, 1]))))
    assert read_ranked_ids(path, size=2, vocab_size=3) == [0, 1]
    with pytest.raises(ValueError, match="'vocab_size' is 3 but the target's vocabulary has 5"):
        read_ranked_ids(path, size=2, vocab_size=5)
    with pytest.raises(ValueError, match=r"draft_vocab must be an integer in \[1, 3\]"):
        read_ranked_ids(path, size=4, vocab_size=3)
    path.write_text(json.dumps({"format": "mlx_dspark.vocab_rank", "vocab_size": 3, "ranked_ids": [0, 0, 1]}))
    with pytest.raises(ValueError, match=f"{path}: field 'ranked_ids' repeats"):
        read_ranked_ids(path, size=2, vocab_size=3)
    path.write_text("{}")
    with pytest.raises(ValueError, match="field 'format'"):
        read_ranked_ids(path, size=2, vocab_size=3)


def test_reduced_rows_of_quantized_heads_are_the_quantized_logits_at_the_kept_ids():
    """The demo pair at 8 bits: a tied (QuantizedEmbedding) LM head and a QuantizedLinear markov_w2."""
    import mlx.nn as nn

    from mlx_dspark.cli.common import demo_pair

    demo = demo_pair()
    pair = load(demo.target, demo.draft, dtype="float32", quantize=8)
    target, draft = pair.target, pair.draft
    assert isinstance(target.embedding, nn.QuantizedEmbedding) and isinstance(draft.markov_head.markov_w2, nn.QuantizedLinear)
    ids = [9, 2, 330, 1610]
    vocab = DraftVocabulary(ids, target=target, markov_head=draft.markov_head)
    hidden = mx.random.normal((1, 7, target.args.hidden_size))
    np.testing.assert_allclose(np.array(vocab.logits(hidden)), np.array(target.lm_head_logits(hidden))[..., ids], rtol=1e-5, atol=1e-5)
    features = mx.random.normal((1, draft.args.markov_rank))
    np.testing.assert_allclose(
        np.array(vocab.markov_bias(features)), np.array(draft.markov_head.markov_w2(features))[..., ids], rtol=1e-5, atol=1e-5
    )
