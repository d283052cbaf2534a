"""Continuous batching (engine/batch/round.py) with the new draft heads (issue 35): a DFlash 2 draft's packed
block forward (its convolutions along each sequence's own block rows) is bitwise each sequence's own;
for DFlash 2, the target's own MTP layers and an EAGLE-3 draft, batched greedy rows of different prompts,
lengths and join rounds (a fixed length, a plain row, a penalised row) are token-identical to each request
decoded alone, and a seeded sampled row does not depend on its neighbours."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.engine.batch import propose as batch_propose
from mlx_dspark.engine.batch.round import BatchRow
from mlx_dspark.engine.batch.chains import chains_packable, propose_chains
from mlx_dspark.engine.batch.length import row_budget_cap
from mlx_dspark.engine.proposers.chain import ChainProposer
from mlx_dspark.engine.proposers import default_head
from mlx_dspark.engine.proposers.gemma4_assistant import AssistantProposer
from mlx_dspark.engine.options import GenerationOptions, SamplingOptions, SpeculationOptions
from mlx_dspark.engine.proposers.base import Proposal
from mlx_dspark.engine.round.request import head_proposer
from mlx_dspark.models.heads.dspark.dflash2 import DFlash2Draft
from mlx_dspark.models.heads.eagle3.model import Eagle3Draft
from mlx_dspark.models.packed.forward import packed_block_hidden, packing_problem
from mlx_dspark.testing.dflash2_tiny import write_dflash2_draft
from mlx_dspark.testing.eagle3_tiny import write_eagle3_draft
from mlx_dspark.testing.gemma4_assistant_tiny import write_assistant
from mlx_dspark.testing.mlx_lm_checkpoints import write_tiny_mlx_lm_target
from mlx_dspark.testing.mtp_deepseek_tiny import write_tiny_nextn_target
from mlx_dspark.testing.mtp_mimo_tiny import write_tiny_mimo_target
from mlx_dspark.testing.mtp_nemotron_h_tiny import write_tiny_nemotron_h_target
from mlx_dspark.testing.mtp_qwen3_next_tiny import write_tiny_qwen3_next_target
from mlx_dspark.testing.mtp_tiny import write_tiny_qwen3_5_mtp_target
from mlx_dspark.testing.tiny import write_tiny_draft
from tests.batch_helpers import drive_batch
from tests.test_server import call, running_server

PROMPTS = [list(range(5, 8)), list(range(20, 61)), [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3]


@pytest.fixture(scope="module")
def dflash2_pair(tiny_qwen3_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-dflash2")
    deepspec = write_tiny_draft(root / "deepspec", target_path=tiny_qwen3_target, seed=3)
    draft = write_dflash2_draft(deepspec, root / "dflash2", seed=4, kernel_size=3)
    return mlx_dspark.load(str(tiny_qwen3_target), draft=str(draft), dtype="float32")


def _batched(pair, requests, *, joins, cap=row_budget_cap(12)):
    out, rows, widths = drive_batch(pair, requests, joins=joins, draft_cap=cap, prefill_chunk=8)
    return out, widths, rows


def _greedy_rows_equal_their_solo_runs(pair, *, joins=(0, 1, 0, 2, 1), monkeypatch=None, packed=True):
    """`monkeypatch`: a chained head's rows verify their own reference continuation with one wrong token in
    most rounds (`_inject`); the random tiny MTP / EAGLE-3 heads alone are never accepted."""
    requests = [
        (PROMPTS[0], GenerationOptions(max_tokens=30)),
        (PROMPTS[1], GenerationOptions(max_tokens=14)),
        (PROMPTS[2], GenerationOptions(max_tokens=22, speculation=SpeculationOptions(max_draft_tokens=2))),
        (PROMPTS[1][:9], GenerationOptions(max_tokens=12, speculation=SpeculationOptions(speculative=False))),
        ([7, 7, 3, 11, 13] * 2, GenerationOptions(max_tokens=16, sampling=SamplingOptions(repetition_penalty=1.5))),  # hooked drafts
    ]
    solo = [mlx_dspark.generate(pair, prompt, options=options).tokens for prompt, options in requests]
    drafted: list[tuple[list[int], list[int]]] = []
    if monkeypatch is not None:
        _inject(monkeypatch, [p + s for (p, _), s in zip(requests, solo[:4])], pair.target.args.vocab_size, drafted)
        together = _count_packed_chains(monkeypatch)
    out, widths, rows = _batched(pair, requests, joins=list(joins))
    assert max(widths) >= 3, widths
    assert rows[0].proposed and any(row.accepted for row in rows.values()), "the rows draft, some drafts are accepted"
    if monkeypatch is not None:  # partial acceptances: each row rolled back its own caches by its own count
        assert any(0 < r.accepted < r.proposed for r in rows.values()) and len(drafted) > 10
        if packed:
            assert max(together) >= 3, f"the chained rows drafted together (one packed drafter forward per step): {together}"
        else:
            assert not together, "a Gemma 4 assistant's rows draft each over their own target caches"
        for committed, tokens in drafted:  # ... and its chain drafted what a fresh proposer drafts there
            assert tokens == _fresh_chain(pair, committed, len(tokens)), committed
    for i in range(len(requests)):
        assert out[i] == solo[i], f"request {i}"


def _inject(monkeypatch, sequences: list[list[int]], vocab: int, drafted: list) -> None:
    """A chained row's proposal (its real chain runs first: its speculative entries written, then trimmed)
    becomes the continuation of the sequence its committed tokens begin, one token wrong in most rounds.
    `drafted` collects (committed tokens, the real chain's drafts) of the unhooked rows (`sequences`)."""
    rng = random.Random(0)

    def revise(self, proposal, *, position, num_tokens):
        done = len(self.tokens)  # the committed sequence, anchor included
        full = next((s for s in sequences if s[:done] == self.tokens), None)
        if full is None:  # the penalised row: its drafts went through its penalties
            return proposal
        drafted.append((list(self.tokens), proposal.tokens[0].tolist()))
        tokens = (full[done : done + num_tokens] + [0] * num_tokens)[:num_tokens]
        if rng.random() < 0.7:
            k = rng.randrange(num_tokens)
            tokens[k] = (tokens[k] + 1) % vocab
        return Proposal(tokens=mx.array([tokens], dtype=mx.int32), hooked=proposal.hooked)

    monkeypatch.setattr(ChainProposer, "revise", revise, raising=False)
    monkeypatch.setattr(AssistantProposer, "revise", revise, raising=False)
    real_init = AssistantProposer.__init__

    def init(self, *args, prompt=(), **kwargs):  # the assistant reads no token history: kept here for `revise`
        real_init(self, *args, prompt=prompt, **kwargs)
        self.tokens = list(prompt)

    monkeypatch.setattr(AssistantProposer, "__init__", init)
    monkeypatch.setattr(AssistantProposer, "commit", lambda self, tokens: self.tokens.extend(tokens), raising=False)


def _count_packed_chains(monkeypatch) -> list[int]:
    """The number of rows of every packed chain proposal (engine/batch/chains.py) the batch makes."""
    together: list[int] = []
    real = batch_propose.propose_chains

    def counted(rows, lengths, hooks):
        together.append(len(rows))
        return real(rows, lengths, hooks)

    monkeypatch.setattr(batch_propose, "propose_chains", counted)
    return together


def _fresh_proposer(pair, committed: list[int], options=GenerationOptions()):
    """A fresh proposer of the pair's chained head after `committed` (prefilled alone) and what its
    `propose` takes besides (a Gemma 4 assistant: the prefill's target caches)."""
    proposer = head_proposer(pair, default_head(pair), committed[:-1], options)
    cache = pair.target.make_cache()
    _, features = pair.target(mx.array([committed[:-1]]), cache=cache, tap_ids=proposer.tap_ids)
    proposer.extend(features)
    if hasattr(proposer, "commit"):
        proposer.commit([committed[-1]])
    return proposer, ({"target_cache": cache} if proposer.takes_target_cache else {})


def _fresh_chain(pair, committed: list[int], num_tokens: int) -> list[int]:
    """The greedy chain a fresh proposer of the pair's chained head drafts after `committed`."""
    proposer, extra = _fresh_proposer(pair, committed)
    anchor = mx.array([committed[-1]])
    return proposer.propose(anchor, position=len(committed) - 1, num_tokens=num_tokens, **extra).tokens[0].tolist()


def _seeded_sampled_row_does_not_depend_on_its_neighbours(pair, monkeypatch=None):
    """`monkeypatch`: a chained head's rows draft a fixed 3 (the random heads alone park auto rows) and must
    have drafted together, the sampled row's draws in the neighbours' packed chain steps."""
    fixed = SpeculationOptions() if monkeypatch is None else SpeculationOptions(max_draft_tokens=3)
    sampled = (PROMPTS[1], GenerationOptions(max_tokens=18, sampling=SamplingOptions(temperature=0.9, seed=7), speculation=fixed))
    alone, *_ = _batched(pair, [sampled], joins=[0], cap=3)
    together = [] if monkeypatch is None else _count_packed_chains(monkeypatch)
    crowded, *_ = _batched(
        pair, [(PROMPTS[0], GenerationOptions(max_tokens=15, speculation=fixed)), sampled,
               (PROMPTS[2], GenerationOptions(max_tokens=9, speculation=fixed))],
        joins=[0, 1, 0], cap=3,
    )  # fmt: skip
    assert crowded[1] == alone[0]
    assert monkeypatch is None or max(together) == 3, together
    other = (sampled[0], GenerationOptions(max_tokens=18, sampling=SamplingOptions(temperature=0.9, seed=8)))
    assert _batched(pair, [other], joins=[0], cap=3)[0][0] != alone[0], "another seed draws another sample"


def test_dflash2_pair_is_packed(dflash2_pair):
    assert isinstance(dflash2_pair.draft, DFlash2Draft) and packing_problem(dflash2_pair) is None


def test_dflash2_packed_block_is_bitwise_each_sequences_own(dflash2_pair):
    """Contexts of different lengths (block positions differ); the convolutions see only each block's rows."""
    draft, target = dflash2_pair.draft, dflash2_pair.target
    width = len(draft.args.target_layer_ids) * target.args.hidden_size
    rng = np.random.default_rng(0)
    contexts = []
    for n in (5, 17, 9):
        ctx = draft.make_cache()
        draft.append_context(mx.array(rng.standard_normal((1, n, width)).astype(np.float32)), ctx)
        contexts.append(ctx)
    anchors = mx.array([3, 250, 41], dtype=mx.int32)
    block = packed_block_hidden(draft, anchors, contexts, target=target)
    for i, ctx in enumerate(contexts):
        assert mx.array_equal(block[i : i + 1], draft.block_hidden(anchors[i : i + 1], ctx, target=target)).item(), i
    together = draft.propose_from_block(anchors, block, target=target, greedy=True, temperature=1.0, num_tokens=draft.num_drafts)
    for i, ctx in enumerate(contexts):  # the selector walks each row's own chain
        assert together.tokens[i].tolist() == draft.propose(anchors[i : i + 1], ctx, target=target).tokens[0].tolist(), i


def test_dflash2_greedy_rows_equal_their_solo_runs(dflash2_pair):
    _greedy_rows_equal_their_solo_runs(dflash2_pair)


def test_dflash2_seeded_sampled_row_does_not_depend_on_its_neighbours(dflash2_pair):
    _seeded_sampled_row_does_not_depend_on_its_neighbours(dflash2_pair)


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    return mlx_dspark.load(str(write_tiny_qwen3_5_mtp_target(tmp_path_factory.mktemp("batch-mtp") / "target", seed=0)), draft="mtp")


@pytest.fixture(scope="module")
def eagle3_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-eagle3")
    llama = write_tiny_mlx_lm_target(root / "llama", family="llama", seed=0)
    return mlx_dspark.load(str(llama), draft=str(write_eagle3_draft(root / "draft", target_path=llama, seed=2)))


def test_mtp_greedy_rows_equal_their_solo_runs(mtp_pair, monkeypatch):
    assert mtp_pair.heads["mtp"] is not None and mtp_pair.draft is None and packing_problem(mtp_pair) is None
    _greedy_rows_equal_their_solo_runs(mtp_pair, monkeypatch=monkeypatch)


NEXT_N_TARGETS = {
    "mimo": write_tiny_mimo_target,
    "qwen3_next": write_tiny_qwen3_next_target,
    "nemotron_h": write_tiny_nemotron_h_target,  # its MTP block: attention + MoE layers
    "qwen3_5_moe": lambda path, seed: write_tiny_qwen3_5_mtp_target(path, seed=seed, family="qwen3_5_moe"),  # sparse MoE MLP
}


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe", *NEXT_N_TARGETS])
def nextn_pair(request, tmp_path_factory):
    """The next-n (DeepSeek-V3: its MLA attention runs per sequence in the packed verify; GLM), MiMo,
    Qwen3-Next, Nemotron-H and Qwen3.5-MoE MTP layers."""
    path = tmp_path_factory.mktemp(f"batch-{request.param}") / "target"
    write = NEXT_N_TARGETS.get(request.param)
    target = write(path, seed=0) if write else write_tiny_nextn_target(path, family=request.param, seed=0)
    return mlx_dspark.load(str(target), draft="mtp")


def test_nextn_and_mimo_mtp_greedy_rows_equal_their_solo_runs(nextn_pair, monkeypatch):
    assert nextn_pair.heads["mtp"] is not None and packing_problem(nextn_pair) is None
    _greedy_rows_equal_their_solo_runs(nextn_pair, monkeypatch=monkeypatch)


def test_mtp_seeded_sampled_row_does_not_depend_on_its_neighbours(mtp_pair, monkeypatch):
    _seeded_sampled_row_does_not_depend_on_its_neighbours(mtp_pair, monkeypatch)


def test_eagle3_greedy_rows_equal_their_solo_runs(eagle3_pair, monkeypatch):
    assert eagle3_pair.heads["eagle3"] is not None and packing_problem(eagle3_pair) is None
    _greedy_rows_equal_their_solo_runs(eagle3_pair, monkeypatch=monkeypatch)


def test_eagle3_seeded_sampled_row_does_not_depend_on_its_neighbours(eagle3_pair, monkeypatch):
    _seeded_sampled_row_does_not_depend_on_its_neighbours(eagle3_pair, monkeypatch)


def test_a_chained_row_refuses_the_confidence_schedule_in_one_line(mtp_pair):
    """Its proposals carry no confidences: refused when the row is built, never inside a shared round."""
    options = GenerationOptions(speculation=SpeculationOptions(verify_schedule="confidence"))
    with pytest.raises(ValueError, match=r"^verify_schedule 'confidence' needs a draft with a confidence head; the mtp head has none"):
        BatchRow(mtp_pair, PROMPTS[0], options)


def test_a_batching_server_runs_mtp_rows_together_each_equal_its_solo_run(tmp_path):
    """`--max-batch 3` with the target's own MTP layers: served batched (no refusal, no one-at-a-time
    fallback), concurrent greedy requests each the request's own generate."""
    target = write_tiny_qwen3_5_mtp_target(tmp_path / "target", seed=0)
    with running_server(lambda: mlx_dspark.load(str(target), draft="mtp"), defaults=GenerationOptions(max_tokens=8),
                        max_batch=3, batch_prefill_chunk=8) as srv:  # fmt: skip
        assert srv.worker.load_error is None and not srv.worker.one_at_a_time
        prompts = [("Once upon", 18), ("The quick brown fox jumps over the lazy dog.", 9), ("def f(x):", 14)]
        replies: dict[int, str] = {}
        gate = threading.Barrier(len(prompts))

        def run(i, prompt, n):
            gate.wait()
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
            replies[i] = call(srv, "POST", "/v1/completions", body)[2]["choices"][0]["text"]

        threads = [threading.Thread(target=run, args=(i, *p)) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert srv.worker.peak_active >= 2
        for i, (prompt, n) in enumerate(prompts):
            assert replies[i] == mlx_dspark.generate(srv.worker.model, prompt, max_tokens=n).text, prompt


def test_a_pair_with_several_heads_is_not_batched(mtp_pair):
    """The choice between heads (engine/policy/head_choice.py) is a single request's: one line naming the heads."""
    pair = SimpleNamespace(target=mtp_pair.target, draft=object(), heads={"draft": object(), "mtp": mtp_pair.heads["mtp"]})
    assert packing_problem(pair) == ("a pair with several draft heads (draft, mtp) chooses its head per round, "
                                     "which batched rows do not; load one head")


@pytest.mark.parametrize("head", ["mtp_pair", "eagle3_pair"])
def test_packed_chain_drafts_are_bitwise_each_rows_own(head, request):
    _packed_chain_drafts_are_bitwise_each_rows_own(request.getfixturevalue(head))


def test_next_n_and_mimo_packed_chain_drafts_are_bitwise_each_rows_own(nextn_pair):
    """Every MTP family (DeepSeek-V3's next-n layer: its MLA attention runs per row inside the packed step)."""
    _packed_chain_drafts_are_bitwise_each_rows_own(nextn_pair)


def _packed_chain_drafts_are_bitwise_each_rows_own(pair):
    """Rows at different cache lengths, chains of 3, 1 and 4 steps, a hook that ends one row's chain after
    two: the packed chain steps give each row the drafts and probabilities of its own proposal."""
    committed = [PROMPTS[1] + [5, 6], PROMPTS[0], PROMPTS[2] + PROMPTS[0]]
    lengths = [3, 1, 4]
    hooks = [None, None, lambda row, tokens: None if len(tokens) == 2 else row]
    rows = [SimpleNamespace(proposer=_fresh_proposer(pair, c)[0], position=len(c) - 1) for c in committed]
    assert chains_packable(rows)
    together = propose_chains(rows, lengths, hooks)
    for i, c in enumerate(committed):
        alone = _fresh_proposer(pair, c)[0].propose(mx.array([c[-1]]), position=len(c) - 1, num_tokens=lengths[i], logits_hook=hooks[i])
        assert together[i].tokens.shape == (1, 2 if i == 2 else lengths[i])
        assert mx.array_equal(together[i].tokens, alone.tokens).item(), i
        assert mx.array_equal(together[i].token_probs, alone.token_probs).item(), i
        assert rows[i].proposer.cache[0].offset == rows[i].proposer.entries, "trimmed back to the committed entries"


class _IntOffsetEagle3(Eagle3Draft):
    """An EAGLE-3 draft reading its cache's offset as an int outside its attention: its packed step fails."""

    def __call__(self, embeddings, hidden, cache=None):
        if cache:
            hidden = hidden + 0 * int(cache[0].offset)
        return super().__call__(embeddings, hidden, cache)


def test_a_drafter_whose_packed_step_fails_its_probe_drafts_per_row(tmp_path, monkeypatch):
    root = tmp_path / "eagle3"
    llama = write_tiny_mlx_lm_target(root / "llama", family="llama", seed=0)
    pair = mlx_dspark.load(str(llama), draft=str(write_eagle3_draft(root / "draft", target_path=llama, seed=2)))
    pair.heads["eagle3"].__class__ = _IntOffsetEagle3
    rows = [SimpleNamespace(proposer=_fresh_proposer(pair, c)[0], position=len(c) - 1) for c in PROMPTS]
    assert not chains_packable(rows)
    assert pair.heads["eagle3"]._dspark_chain_problem.startswith("the _IntOffsetEagle3 drafter: a packed chain step fails (ValueError: ")
    together = _count_packed_chains(monkeypatch)
    requests = [(p, GenerationOptions(max_tokens=10, speculation=SpeculationOptions(max_draft_tokens=3))) for p in PROMPTS]
    out, widths, _ = _batched(pair, requests, joins=[0, 0, 0])
    assert widths[0] == 3 and not together, "each row drafted alone"
    for i, (prompt, options) in enumerate(requests):
        assert out[i] == mlx_dspark.generate(pair, prompt, options=options).tokens, i


@pytest.fixture(scope="module")
def assistant_pair(tmp_path_factory):
    """A tiny gemma4_text target whose sliding window (6) wraps, and a Gemma 4 assistant over its caches."""
    root = tmp_path_factory.mktemp("batch-assistant")
    gemma = write_tiny_mlx_lm_target(root / "gemma4", family="gemma4_text", seed=0, sliding_window=6)
    return mlx_dspark.load(str(gemma), draft=str(write_assistant(root / "assistant", target_path=gemma, seed=1, table_scale=4.0)))


def test_assistant_greedy_rows_equal_their_solo_runs(assistant_pair, monkeypatch):
    """Each row's assistant reads its own target caches, packed-verified with the other rows and rolled back
    on their own (wrapped sliding windows included): its chains are those a fresh prefill gives."""
    assert assistant_pair.heads["assistant"] is not None and packing_problem(assistant_pair) is None
    _greedy_rows_equal_their_solo_runs(assistant_pair, monkeypatch=monkeypatch, packed=False)


def test_assistant_seeded_sampled_row_does_not_depend_on_its_neighbours(assistant_pair):
    _seeded_sampled_row_does_not_depend_on_its_neighbours(assistant_pair)
