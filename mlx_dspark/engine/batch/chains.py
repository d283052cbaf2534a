"""The chained rows of a batched round (heads of cost kind chain, over caches of their own) drafted together.

Each row keeps its own `ChainProposer` (its drafter cache holds its committed entries only, so its
rollback is its own) and first runs its waiting entries alone (`flush`: a different count per row). Then
every chain step k is ONE drafter forward for the rows still drafting (models/packed/chain.py: the rows'
norms, projections, MLP and head together, each row's attention over its own cache at its own length)
and one head call; each row then takes its draft from its own logits row: through its own logits hook
(penalties, bias, grammar mask; None ends that row's chain), argmax, or a draw with a key of the row's
own stream (`BatchRow.draw_key`), so a seeded sampled row does not depend on its neighbours. A row whose
length is reached drops out of the later steps. Every row's cache is trimmed back to its committed
entries afterwards, as `ChainProposer.propose` does.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from mlx_dspark.engine.proposers.chain import ChainProposer, chain_proposal, draw_token
from mlx_dspark.engine.proposers.base import Proposal
from mlx_dspark.models.packed.chain import chain_packing_problem, packed_chain_step


def chains_packable(rows: list[Any]) -> bool:
    """Whether these chained rows draft together: two or more, and the drafter's packed step passes its
    load-time probe (a drafter that fails it drafts per row, as before)."""
    if len(rows) < 2 or not isinstance(rows[0].proposer, ChainProposer):  # a Gemma 4 assistant: per row
        return False
    lead = rows[0].proposer
    lead.flush()
    if lead.chain.last is None:
        return False
    return chain_packing_problem(
        lead.module, lambda ids, hidden, caches: lead._step(ids, hidden, step=1, cache=caches),
        width=lead.chain.last.shape[-1], vocab=lead.target.args.vocab_size, make_cache=lead.module.make_cache,
    ) is None  # fmt: skip


def propose_chains(rows: list[Any], lengths: list[int], hooks: list[Callable | None]) -> list[Proposal]:
    """Row i's proposal of up to `lengths[i]` chained drafts after its anchor (see the module docstring)."""
    proposers = [row.proposer for row in rows]
    for row, proposer in zip(rows, proposers):
        proposer.flush()
        assert proposer.entries == row.position and proposer.chain.last is not None, (proposer.entries, row.position)
    lead = proposers[0]
    keys = [None if p.greedy else mx.random.split(row.draw_key(), max(n, 1)) for row, p, n in zip(rows, proposers, lengths)]
    drafts: list[tuple[list, list, list]] = [([], [], []) for _ in rows]  # tokens, token_probs, draft_probs
    active = [i for i, n in enumerate(lengths) if n > 0]
    hidden = mx.concatenate([proposers[i].chain.last for i in active], axis=0) if active else None  # (a, 1, C)
    for k in range(max(lengths, default=0)):
        if k:
            tokens = mx.concatenate([drafts[i][0][-1] for i in active])[:, None]  # (a, 1)
            hidden = _step(lead, [proposers[i] for i in active], tokens, hidden, k)
        logits = lead._logits(hidden, step=k)[:, -1].astype(mx.float32)  # (a, V)
        going = []
        for j, i in enumerate(active):
            row = logits[j : j + 1]
            if hooks[i] is not None:
                row = hooks[i](row, drafts[i][0])
                if row is None:  # the hook ends this row's chain here
                    continue
            proposer = proposers[i]
            draw_token(row, *drafts[i], greedy=proposer.greedy, temperature=proposer.temperature,
                       key=None if keys[i] is None else keys[i][k])  # fmt: skip
            if lengths[i] > k + 1:
                going.append(j)
        if not going:
            break
        if len(going) < len(active):
            hidden = hidden[mx.array(going, dtype=mx.int32)]
            active = [active[j] for j in going]
    for proposer in proposers:
        proposer.chain.drop_speculative()
    return [chain_proposal(*d, greedy=p.greedy) for d, p in zip(drafts, proposers)]


def _step(lead: Any, proposers: list[Any], tokens: mx.array, hidden: mx.array, k: int) -> mx.array:
    """Chain step k of the rows still drafting: one packed drafter forward (one row: its own step)."""
    if len(proposers) == 1:
        return proposers[0]._step(tokens, hidden, step=k)
    return packed_chain_step(
        lead.module, lambda caches: lead._step(tokens, hidden, step=k, cache=caches), [p.cache for p in proposers],
        make_cache=lead.module.make_cache,
    )  # fmt: skip
