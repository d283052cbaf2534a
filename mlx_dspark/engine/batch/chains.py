"""The chained rows of a batched round (heads of cost kind chain, over state of their own) drafted together.

Each row keeps its own proposer (its drafter cache holds its committed entries only, so its rollback is
its own) of a head that packs its chains (`Proposer.packs_chains`: the target's MTP layers, an EAGLE-3
draft, a draft model). Each row first starts its chain alone (`begin_chain`: its waiting entries, or a
draft model's unread tokens; a different count per row). Then every chain step k is ONE drafter forward
for the rows still drafting (`chain_step`: models/packed/chain.py or models/packed/lm_steps.py, the rows'
norms, projections, MLP and head together, each row's attention over its own cache at its own length)
and one head call (`chain_logits`); each row then takes its draft from its own logits row: through its
own logits hook (penalties, bias, grammar mask; None ends that row's chain), argmax, or a draw with a key
of the row's own stream (`BatchRow.draw_key`), so a seeded sampled row does not depend on its neighbours
(a row alone in the batch takes the same path, so its draws do not depend on whether it is). A row whose
length is reached drops out of the later steps. Every row's state goes back to its committed entries
afterwards (`end_chain`), as the head's own `propose` does.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from mlx_dspark.engine.proposers.base import Proposal
from mlx_dspark.engine.proposers.chain import chain_proposal, draw_token


def chains_packable(rows: list[Any]) -> bool:
    """Whether these chained rows draft together: their head packs its chains and its drafter's packed step
    passes its load-time probe (a drafter that fails it drafts per row, as before)."""
    if not rows or not all(row.proposer.packs_chains for row in rows):  # a Gemma 4 assistant: per row
        return False
    return rows[0].proposer.chain_packing_problem() is None


def propose_chains(rows: list[Any], lengths: list[int], hooks: list[Callable | None]) -> list[Proposal]:
    """Row i's proposal of up to `lengths[i]` chained drafts after its anchor (see the module docstring)."""
    proposers = [row.proposer for row in rows]
    firsts = [p.begin_chain(position=row.position) for row, p in zip(rows, proposers)]  # (1, 1, C) each
    lead = proposers[0]
    keys = [None if p.greedy else mx.random.split(row.draw_key(), max(n, 1)) for row, p, n in zip(rows, proposers, lengths)]
    drafts: list[tuple[list, list, list]] = [([], [], []) for _ in rows]  # tokens, token_probs, draft_probs
    active = [i for i, n in enumerate(lengths) if n > 0]
    outputs = mx.concatenate([firsts[i] for i in active], axis=0) if active else None  # (a, 1, C)
    for k in range(max(lengths, default=0)):
        if k:
            tokens = mx.concatenate([drafts[i][0][-1] for i in active])[:, None]  # (a, 1)
            outputs = lead.chain_step([proposers[i] for i in active], tokens, outputs, k)
        logits = lead.chain_logits(outputs, k)[:, -1].astype(mx.float32)  # (a, V)
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
            outputs = outputs[mx.array(going, dtype=mx.int32)]
            active = [active[j] for j in going]
    for proposer in proposers:
        proposer.end_chain()
    return [chain_proposal(*d, greedy=p.greedy) for d, p in zip(drafts, proposers)]
