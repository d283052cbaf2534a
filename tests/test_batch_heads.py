"""Continuous batching (engine/batch.py) with the new draft heads (issue 35): a DFlash 2 draft's packed
block forward (its convolutions along each sequence's own block rows) is bitwise each sequence's own,
and batched greedy rows of different prompts, lengths and join rounds are token-identical to each request
decoded alone; a seeded sampled row does not depend on its neighbours."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.engine.batch_length import row_budget_cap
from mlx_dspark.engine.options import GenerationOptions, SamplingOptions, SpeculationOptions
from mlx_dspark.models.dflash2 import DFlash2Draft
from mlx_dspark.models.packed import packed_block_hidden, packing_problem
from mlx_dspark.testing.dflash2_tiny import write_dflash2_draft
from mlx_dspark.testing.tiny import write_tiny_draft
from tests.batch_helpers import drive_batch

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


def _greedy_rows_equal_their_solo_runs(pair, *, joins=(0, 1, 0, 2, 1)):
    requests = [
        (PROMPTS[0], GenerationOptions(max_tokens=30)),
        (PROMPTS[1], GenerationOptions(max_tokens=14)),
        (PROMPTS[2], GenerationOptions(max_tokens=22, speculation=SpeculationOptions(max_draft_tokens=2))),
        (PROMPTS[1][:9], GenerationOptions(max_tokens=12, speculation=SpeculationOptions(speculative=False))),
        (PROMPTS[0], GenerationOptions(max_tokens=16, sampling=SamplingOptions(repetition_penalty=1.5))),  # hooked drafts
    ]
    out, widths, rows = _batched(pair, requests, joins=list(joins))
    assert max(widths) >= 3, widths
    assert rows[0].proposed and any(row.accepted for row in rows.values()), "the rows draft, some drafts are accepted"
    for i, (prompt, options) in enumerate(requests):
        assert out[i] == mlx_dspark.generate(pair, prompt, options=options).tokens, f"request {i}"


def _seeded_sampled_row_does_not_depend_on_its_neighbours(pair):
    sampled = (PROMPTS[1], GenerationOptions(max_tokens=18, sampling=SamplingOptions(temperature=0.9, seed=7)))
    alone, *_ = _batched(pair, [sampled], joins=[0], cap=3)
    crowded, *_ = _batched(
        pair, [(PROMPTS[0], GenerationOptions(max_tokens=15)), sampled, (PROMPTS[2], GenerationOptions(max_tokens=9))],
        joins=[0, 1, 0], cap=3,
    )  # fmt: skip
    assert crowded[1] == alone[0]
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
