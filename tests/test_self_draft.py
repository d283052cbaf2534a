"""Self-speculation (`draft="self"`, `"self:N"`, issue 51.2): the target's own first N layers, final norm and
head draft over the target's own caches, which every proposal leaves as it found them.

Greedy: identical to mlx-lm's own generate on a plain-KV target (llama) and a GatedDeltaNet hybrid (qwen3_5),
with the real early-exit drafts and with the reference continuation injected (one wrong token in most
rounds: partial acceptances of every length over the real proposal's cache writes and restores). Sampled: the
draft's own distribution q, a χ² fit to the exact target distribution. `self:N` parsing and its refusals.
"""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark
from mlx_dspark.bench.controlled import reference_block
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.engine.proposers.base import Proposal, Proposer
from mlx_dspark.engine.proposers.self_draft import SelfDraftProposer
from mlx_dspark.loading.load import split_draft
from mlx_dspark.models.caches.rollback import layer_state
from mlx_dspark.models.heads.self_draft.model import SelfDraft, choose_layers, ideal_rate
from mlx_dspark.testing.mlx_lm_checkpoints import write_tiny_mlx_lm_target
from tests.engine_helpers import make_target
from tests.test_lossless_sampling import (
    MIN_P_VALUE, SAMPLERS, VOCAB, chi_square_p_value, exact_distribution, marginals, sample_runs, to_array,
)  # fmt: skip
from tests.test_mlx_lm_targets import PROMPT, mlx_lm_greedy

TOKENS = 120


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def target_dir(request, tmp_path_factory) -> Path:
    return write_tiny_mlx_lm_target(tmp_path_factory.mktemp(request.param) / "target", family=request.param, seed=0)


def partial_rounds(result) -> int:
    return sum(a - 1 < p for a, p in zip(result.acceptance_lengths, result.proposal_lengths))


def test_greedy_self_speculation_is_mlx_lms_generate_at_every_depth(target_dir):
    reference = mlx_lm_greedy(target_dir, PROMPT, TOKENS)
    results = {}
    for draft in ("self:1", "self:3", "self"):
        loaded = prepare_model(mlx_dspark.load(str(target_dir), draft=draft), RunSettings(ignore_eos=True))
        results[draft] = mlx_dspark.generate(loaded, PROMPT, max_tokens=TOKENS, max_draft_tokens=4, lookup="off")
        assert results[draft].tokens == reference, draft
        assert sum(results[draft].proposal_lengths) > 0, draft
    # the deepest exit of these random targets agrees often enough for accepted and rejected drafts alike
    deep = results["self:3"]
    assert 0 < partial_rounds(deep) < deep.rounds and deep.mean_acceptance_length > 1.0


class InjectingSelfDraft(Proposer):
    """The real self-draft proposal runs (its writes to the target's caches, their restore), then its tokens are
    replaced by the reference continuation with one wrong token in most rounds."""

    takes_target_cache = True

    def __init__(self, inner: SelfDraftProposer, reference: list[int], *, prompt_len: int, vocab_size: int):
        self.inner, self.reference, self.prompt_len, self.vocab_size = inner, reference, prompt_len, vocab_size
        self.block_size, self.rng = inner.block_size, random.Random(0)

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int, target_cache=None) -> Proposal:
        before = [layer_state(c) for c in target_cache]
        real = self.inner.propose(anchor, position=position, num_tokens=num_tokens, target_cache=target_cache)
        after = [layer_state(c) for c in target_cache]
        assert [s.state if isinstance(s.state, int) else len(s.arrays()) for s in before] == [
            s.state if isinstance(s.state, int) else len(s.arrays()) for s in after]  # offsets back where they were
        wrong = self.rng.randrange(num_tokens) if self.rng.random() < 0.85 else None
        return Proposal(tokens=reference_block(real, self.reference, start=position - self.prompt_len + 1,
                                               num_tokens=num_tokens, wrong=wrong, vocab_size=self.vocab_size))  # fmt: skip


def test_partial_acceptances_over_the_real_self_draft_are_mlx_lms_generate(target_dir):
    reference = mlx_lm_greedy(target_dir, PROMPT, TOKENS + 8)
    loaded = prepare_model(mlx_dspark.load(str(target_dir), draft="self:2"), RunSettings(ignore_eos=True))
    inner = SelfDraftProposer(loaded.target, num_layers=2, greedy=True, temperature=1.0, block_size=5)
    proposer = InjectingSelfDraft(inner, reference, prompt_len=len(PROMPT), vocab_size=loaded.target.args.vocab_size)
    result = mlx_dspark.generate(loaded, PROMPT, max_tokens=TOKENS, proposer=proposer)
    assert result.tokens == reference[:TOKENS]
    assert partial_rounds(result) >= 0.6 * result.rounds and result.mean_acceptance_length > 2.0


def test_sampled_self_speculation_keeps_the_exact_target_distribution():
    target = make_target("qwen3", seed=5, vocab_size=VOCAB, layers=4, embedding_scale=0.5)
    sampler = SAMPLERS["temperature_top_k"]
    exact = exact_distribution(target, sampler, 3)
    outcomes = sample_runs(target, sampler, lambda: SelfDraftProposer(target, num_layers=2, greedy=False,
                                                                      temperature=sampler.temperature, block_size=2),
                           length=3, seed=4321)  # fmt: skip
    counts, stats = to_array(outcomes, 3), outcomes.stats
    assert 0 < stats["accepted"] and 0 < stats["all_accepted"] < stats["rounds"]
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > MIN_P_VALUE
    for observed, expected in zip(marginals(counts), marginals(exact)):
        assert chi_square_p_value(observed, expected) > MIN_P_VALUE


def test_self_n_is_read_from_draft_and_bad_values_are_refused_in_one_line(tmp_path):
    assert split_draft("self") == ([], {"self": None})
    assert split_draft("self:8") == ([], {"self": "8"})
    assert split_draft("mtp,self:2") == ([], {"mtp": None, "self": "2"})
    assert split_draft("owner/name:FILE.gguf") == (["owner/name:FILE.gguf"], {})
    with pytest.raises(ValueError, match="'mtp'.*takes no ':' argument"):
        split_draft("mtp:2")
    target = write_tiny_mlx_lm_target(tmp_path / "target", family="llama", seed=0)  # 4 layers
    for bad, message in (("self:4", r"self:4 is out of range: this target has 4 layers, give N in 1..3"),
                         ("self:0", r"self:0 is out of range"), ("self:x", r"self:x is not self:N"),
                         ("self:", r"self: is not self:N"), ("self:-1", r"self:-1 is not self:N")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            mlx_dspark.load(str(target), draft=bad)
    assert mlx_dspark.load(str(target), draft="self:3").heads["self"].requested == 3


def test_self_alone_chooses_the_depth_of_the_best_measured_rate(tmp_path):
    target = mlx_dspark.load(str(write_tiny_mlx_lm_target(tmp_path / "t", family="llama", seed=0))).target
    choice = choose_layers(target)
    assert set(choice.agreement) == {1, 2, 3} and all(0 <= a <= 1 for a in choice.agreement.values())
    assert choice.step_cost[1] < choice.step_cost[2] < choice.step_cost[3] < 1
    assert choice.rate[choice.num_layers] == max(choice.rate.values())
    assert choice.pays == (choice.rate[choice.num_layers] > 1)
    head = SelfDraft()
    assert head.layers_for(target) == choice.num_layers and head.choice == choice
    assert ideal_rate(1.0, 0.0) == 9.0 and ideal_rate(0.0, 0.5) == pytest.approx(1 / 1.5)


def test_each_self_depth_has_a_cost_curve_of_its_own(tmp_path):
    from mlx_dspark.engine.costs.probe import cost_curve_path

    target = str(write_tiny_mlx_lm_target(tmp_path / "target", family="llama", seed=0))
    paths = {d: cost_curve_path(mlx_dspark.load(target, draft=d), tmp_path, head="self") for d in ("self", "self:1", "self:2")}
    assert len(set(paths.values())) == 3


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_batched_self_draft_rows_equal_their_solo_runs(family, tmp_path):
    """Each row drafts over its own target caches (packed-verified with the others, rolled back on their own)."""
    from mlx_dspark.models.packed.forward import packing_problem
    from tests.test_batch_heads import _greedy_rows_equal_their_solo_runs

    pair = mlx_dspark.load(str(write_tiny_mlx_lm_target(tmp_path / family, family=family, seed=0)), draft="self:3")
    assert packing_problem(pair) is None
    _greedy_rows_equal_their_solo_runs(pair)
