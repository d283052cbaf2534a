"""Penalties, logit_bias and grammar masks in the round: lossless against the processed target.

- the processor's rows equal a direct numpy computation of the penalties on each row's own history;
- greedy speculative == plain greedy with penalties and bias (the real draft takes the processing too);
- sampled output follows the processed target distribution exactly (chi-square, V = 8), in both drafting
  modes, with penalties and with a grammar mask (masked draft, and unmasked draft whose cut keeps the
  rejected draft row, so the residual stays exact).
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.engine.round.decode import speculative_steps
from mlx_dspark.engine.logits.processing import LogitsProcessor
from mlx_dspark.engine.options import OptionError, SamplingOptions
from mlx_dspark.engine.proposers.dspark import DraftProposer
from tests.engine_helpers import make_draft, make_target
from tests.test_lossless_sampling import MIN_P_VALUE, PROMPT, RUNS, VOCAB, chi_square_p_value, marginals

PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.7, penalty_last_n=4)


def reference_processed(logits: np.ndarray, history: list[int], options: SamplingOptions) -> np.ndarray:
    """llama.cpp / mlx-lm penalties written out directly on one row."""
    out = logits.astype(np.float64).copy()
    for token, bias in options.logit_bias:
        out[token] += bias
    window = history[-options.penalty_last_n :] if options.penalty_last_n else []
    counts = np.bincount(window, minlength=out.shape[0]) if window else np.zeros(out.shape[0])
    present = counts > 0
    rp = options.repetition_penalty
    out = np.where(present, np.where(out < 0, out * rp, out / rp), out)
    return out - options.presence_penalty * present - options.frequency_penalty * counts


def test_processed_rows_equal_the_direct_computation_on_each_rows_history():
    options = SamplingOptions(temperature=1.0, logit_bias={3: 2.5, "5": -1.0}, **PENALTIES)
    history = [1, 3, 3, 6, 2, 3]
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, VOCAB)).astype(np.float32)
    drafts = [3, 7, 7]
    processor = LogitsProcessor(vocab_size=VOCAB, history=history, sampling=options)
    rows = np.array(processor.target_logits(mx.array(logits), mx.array(drafts, dtype=mx.int32)))
    for j in range(4):  # verify row j sees history + drafts[:j]
        expected = reference_processed(logits[j], history + drafts[:j], options)
        np.testing.assert_allclose(rows[j], expected, rtol=1e-5, atol=1e-5)
    # plain decoding's row after one pending token sees history + [token]
    row = np.array(processor.target_logits(mx.array(logits[:1]), mx.array([7], dtype=mx.int32)))
    np.testing.assert_allclose(row[0], reference_processed(logits[0], history + [7], options), rtol=1e-5, atol=1e-5)


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    with pytest.raises(OptionError, match="logit_bias"):
        LogitsProcessor(vocab_size=VOCAB, history=[1], sampling=SamplingOptions(logit_bias={VOCAB: 1.0}))
    with pytest.raises(OptionError, match="logit_bias"):
        SamplingOptions(logit_bias={"x": 1.0})
    with pytest.raises(OptionError, match="presence_penalty"):
        SamplingOptions(presence_penalty=3.0)
    with pytest.raises(OptionError, match="repetition_penalty"):
        SamplingOptions(repetition_penalty=0.0)


@pytest.fixture(scope="module")
def pair(tiny_spark_pair):
    target, draft = tiny_spark_pair
    return mlx_dspark.load(str(target), draft=str(draft))


@pytest.mark.parametrize("prompt", ["Hello", "def add(a, b):", "1 2 3 4"])
def test_greedy_speculative_equals_plain_with_penalties_and_bias(pair, prompt):
    knobs = dict(PENALTIES, penalty_last_n=16, logit_bias={40: 3.0, 41: -5.0})
    plain = mlx_dspark.generate(pair, prompt, max_tokens=40, speculative=False, **knobs)
    spec = mlx_dspark.generate(pair, prompt, max_tokens=40, **knobs)
    assert spec.tokens == plain.tokens
    assert spec.rounds > 0
    unpenalized = mlx_dspark.generate(pair, prompt, max_tokens=40, speculative=False)
    assert unpenalized.tokens != plain.tokens  # the penalties do change the output (so the check can fail)


# -- chi-square on a V = 8 target -----------------------------------------------------------------


class ParityGrammar:
    """A toy grammar over 8 tokens: token t may follow token s only if (s + t) % 3 != 0; never 0 first."""

    eos_ids = ()

    def __init__(self) -> None:
        self.last: int | None = None

    def allowed(self, prefix) -> np.ndarray:
        last = prefix[-1] if prefix else self.last
        return np.array([(last is None and t != 0) or (last is not None and (last + t) % 3 != 0) for t in range(VOCAB)])

    def mask(self, prefix) -> np.ndarray:
        bits = self.allowed(list(prefix))
        return np.array([sum(1 << t for t in range(VOCAB) if bits[t])], dtype=np.int32)

    def masks(self, draft) -> np.ndarray:
        return np.stack([self.mask(list(draft[:j])) for j in range(len(draft) + 1)])

    def valid_prefix(self, tokens) -> int:
        for i, token in enumerate(tokens):
            if not self.allowed(list(tokens[:i]))[token]:
                return i
        return len(tokens)

    def ends_after(self, prefix) -> bool:
        return False

    def commit(self, tokens) -> None:
        if tokens:
            self.last = int(tokens[-1])


def exact_processed_distribution(target, sampler: SamplingOptions, length: int, grammar: bool) -> np.ndarray:
    joint = np.ones([1])
    prefixes: list[list[int]] = [[]]
    for _ in range(length):
        logits, _ = target(mx.array([PROMPT + p for p in prefixes], dtype=mx.int32))
        rows = []
        for prefix, row in zip(prefixes, np.array(logits[:, -1], dtype=np.float64)):
            processed = reference_processed(row, PROMPT + prefix, sampler)
            if grammar:
                processed = np.where(ParityGrammar().allowed(prefix), processed, -np.inf)
            rows.append(processed)
        probs = np.array(sampler.probs(mx.array(np.array(rows, dtype=np.float32))), dtype=np.float64)
        joint = (joint.reshape(-1, 1) * probs).reshape(-1)
        prefixes = [p + [t] for p in prefixes for t in range(VOCAB)]
    return joint.reshape([VOCAB] * length)


@pytest.fixture(scope="module")
def small():
    target = make_target("spark2_5", seed=11, vocab_size=VOCAB, layers=2, window=4, embedding_scale=0.5)
    return target, make_draft(target, seed=6, markov_head_type="vanilla")


@pytest.mark.parametrize(
    "drafting, grammar, mask_draft",
    [("sample", False, True), ("greedy", False, True), ("sample", True, True), ("greedy", True, True), ("sample", True, False)],
)
def test_sampled_output_follows_the_processed_target_distribution(small, drafting, grammar, mask_draft):
    target, draft = small
    sampler = SamplingOptions(temperature=1.0, logit_bias={2: 1.0}, **PENALTIES)
    length = 2
    exact = exact_processed_distribution(target, sampler, length, grammar)
    mx.random.seed(777)
    outcomes: Counter = Counter()
    accepted = cut = 0
    for _ in range(RUNS // 2):
        processor = LogitsProcessor(
            vocab_size=VOCAB, history=PROMPT, sampling=sampler, grammar=ParityGrammar() if grammar else None, mask_draft=mask_draft
        )
        proposer = DraftProposer(draft, target, greedy=drafting == "greedy", temperature=1.0)
        tokens: list[int] = []
        for step in speculative_steps(target, proposer, PROMPT, sampler=sampler, processor=processor):
            tokens.extend(step.tokens)
            accepted += step.accepted
            cut += step.verified and step.proposed < proposer.block_size
            if len(tokens) >= length:
                break
        outcomes[tuple(tokens[:length])] += 1
    counts = np.zeros([VOCAB] * length)
    for key, n in outcomes.items():
        counts[key] += n
    assert accepted > 0
    if grammar and not mask_draft:
        assert cut > 0  # the unmasked draft proposed forbidden tokens, and the cut was exercised
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > MIN_P_VALUE
    for observed, expected in zip(marginals(counts), marginals(exact)):
        assert chi_square_p_value(observed, expected) > MIN_P_VALUE
    if not grammar and drafting == "sample":  # the check can fail: the unprocessed target does not fit
        unprocessed = exact_processed_distribution(target, SamplingOptions(temperature=1.0), length, False)
        assert chi_square_p_value(counts.reshape(-1), unprocessed.reshape(-1)) < 1e-6
