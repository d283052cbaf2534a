"""The proposals of a batched round's drafting rows (engine/batch/round.py's `BatchRow`s, `lengths[i]` drafts each).

A block draft's rows (DSpark, DFlash, DFlash 2) share one packed draft block forward
(`models/packed.packed_block_hidden`); their heads run together for the greedy rows without a logits hook,
per row otherwise. A chained head's rows each keep their own
drafter cache; their chain steps run as one packed drafter forward per step (engine/batch/chains.py: the MTP
layers, an EAGLE-3 draft, a draft model), or, where the head packs no chains (a Gemma 4 assistant) or the
drafter's packed step fails its probe, each row runs its own k steps as a single request does. A row's proposer may then `revise` what it proposed (a benchmark's controlled
acceptance).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from mlx_dspark.engine.batch.chains import chains_packable, propose_chains
from mlx_dspark.engine.proposers.base import Proposal
from mlx_dspark.models.packed.forward import packed_block_hidden


def _row_proposal(proposal: Proposal, i: int) -> Proposal:
    def take(a):
        return None if a is None else a[i : i + 1]

    return Proposal(tokens=proposal.tokens[i : i + 1], draft_probs=take(proposal.draft_probs),
                    token_probs=take(proposal.token_probs), confidence=take(proposal.confidence), hooked=False)  # fmt: skip


def propose_rows(model: Any, rows: list[Any], lengths: list[int]) -> list[Proposal]:
    """The drafting rows' proposals: a chained head's rows together, one packed drafter forward per chain
    step (engine/batch/chains.py), or each from its own proposer (`_chained`) where the head packs no chains
    or the drafter's packed step fails its probe; the block draft's rows from one packed draft block forward (`_blocks`). Then a
    proposer's own `revise`."""
    hooks = [r.processor.draft_hook() for r in rows]
    proposals: list[Proposal | None] = [None] * len(rows)
    blocks = [i for i, r in enumerate(rows) if not r.chained]
    if blocks:
        made = _blocks(model, [rows[i] for i in blocks], [lengths[i] for i in blocks], [hooks[i] for i in blocks])
        for i, proposal in zip(blocks, made):
            proposals[i] = proposal
    chains = [i for i, r in enumerate(rows) if r.chained]
    if chains_packable([rows[i] for i in chains]):
        made = propose_chains([rows[i] for i in chains], [lengths[i] for i in chains], [hooks[i] for i in chains])
        for i, proposal in zip(chains, made):
            proposals[i] = proposal
    else:
        for i in chains:
            proposals[i] = _chained(rows[i], lengths[i], hooks[i])
    for i, row in enumerate(rows):
        proposals[i] = row.proposer.revise(proposals[i], position=row.position, num_tokens=lengths[i])
        proposals[i].hooked = hooks[i] is not None and proposals[i].hooked
    return proposals


def _chained(row: Any, length: int, hook: Callable | None) -> Proposal:
    """A chained head's row drafts its `length` steps
    by itself, as a single request does (chain_propose.py: only committed entries stay in its drafter cache,
    so each row's rollback is its own; the assistant writes no cache); a sampled row from its own generator."""
    if not row.proposer.greedy:
        row.reseed()
    anchor = mx.array([row.anchor], dtype=mx.int32)
    extra = {} if hook is None else {"logits_hook": hook}
    if row.proposer.takes_target_cache:  # the row's own target caches, at its committed positions (rolled back last round)
        extra["target_cache"] = row.prompt_cache.target_cache
    return row.proposer.propose(anchor, position=row.position, num_tokens=length, **extra)


def _blocks(model: Any, rows: list[Any], lengths: list[int], hooks: list[Callable | None]) -> list[Proposal]:
    """One packed draft block forward for the rows; heads together for greedy rows, per row for sampled
    ones and for rows whose logits processing changes the draft's logits (penalties, bias, the grammar's
    mask: the row's `draft_hook`, as a single request drafts; `hooked` proposals)."""
    anchors = mx.array([r.anchor for r in rows], dtype=mx.int32)
    block = packed_block_hidden(model.draft, anchors, [r.proposer.context for r in rows], target=model.target)
    proposals: list[Proposal | None] = [None] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.proposer.greedy and hooks[i] is None]
    if greedy:
        index = mx.array(greedy, dtype=mx.int32)
        together = model.draft.propose_from_block(
            anchors[index], block[index], target=model.target, greedy=True, temperature=1.0,
            num_tokens=max(lengths[i] for i in greedy),
        )  # fmt: skip
        for j, i in enumerate(greedy):
            proposals[i] = _row_proposal(together, j)
    for i, row in enumerate(rows):
        if proposals[i] is None:
            if not row.proposer.greedy:
                row.reseed()
            proposals[i] = _row_proposal(model.draft.propose_from_block(
                anchors[i : i + 1], block[i : i + 1], target=model.target, greedy=row.proposer.greedy,
                temperature=row.proposer.temperature, num_tokens=lengths[i], logits_hook=hooks[i],
            ), 0)  # fmt: skip
            proposals[i].hooked = hooks[i] is not None
    return proposals
