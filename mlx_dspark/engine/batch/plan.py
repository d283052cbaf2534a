"""What every row of a batched round verifies: its block's source and its draft length, decided together.

`plan_round(rows, cap, cost, prefill_chunk)` (engine/batch/round.py's rows) returns each row's DSpark draft
length and, for the rows that propose through a `choose.Chooser` (lookup on, a grammar's forced runs),
their `Chooser.plan`. Without the machine's packed costs every row takes its own policy's length and
its Chooser decides over it. With them (engine/batch/length.py), the rows whose Chooser already prefers
a ready block (a lookup continuation, a forced run) over the longest DSpark block they may take are
decided first: their blocks, up to 32 tokens, go into the plan as rows the forward carries anyway (with
the tokens they are expected to commit), so a wide lookup block makes the other rows' drafts dearer;
then one plan of the `auto` rows' lengths (`plan_lengths`); then each remaining Chooser decides over its
planned length (a row planned at 0 may still take a lookup block, as a parked single request does).
A Chooser whose decision is a DSpark block changes nothing in it, so asking again is exact.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from mlx_dspark.engine.batch.length import BatchCost, plan_lengths
from mlx_dspark.engine.policy.proposal_choice import Plan


def _choose(row: Any, budget: int) -> Plan | None:
    """The row's Chooser decides over `budget` DSpark drafts (None: nothing it could propose)."""
    room = row.room()
    if not (budget or room):
        return None
    return row.chooser.plan(num_tokens=min(budget, room), room=room)


def plan_round(rows: Sequence[Any], cap: int, cost: BatchCost | None, prefill_chunk: int) -> tuple[list[int], dict[int, Plan]]:
    """Each row's DSpark draft length this round and its Chooser's plan (module docstring)."""
    choosing = [i for i, r in enumerate(rows) if r.chooser is not None and not r.prefilling]
    if cost is None:
        budgets = [r.draft_budget(cap) for r in rows]
        plans = {i: _choose(rows[i], budgets[i]) for i in choosing}
        return budgets, {i: p for i, p in plans.items() if p is not None}
    demands = [r.demand(cap, prefill_chunk) for r in rows]
    decided: dict[int, Plan] = {}
    for i in choosing:
        demand = demands[i]
        plan = _choose(rows[i], max(demand.cap, demand.floor))
        if plan is not None and plan.draft_size == 0:  # a ready block (or nothing): in the forward as it is
            width = 0 if plan.proposal is None else int(plan.proposal.tokens.shape[1])
            decided[i] = plan
            demands[i] = replace(demand, rows=1 + width, floor=0, cap=0, acceptance=(), expected=plan.expected)
    lengths = plan_lengths(cost, demands)
    for i, (row, demand) in enumerate(zip(rows, demands)):
        if i in decided:
            lengths[i] = 0
        elif row.planned and not row.prefilling:
            row.probes.record(lengths[i], probe=bool(demand.floor) and lengths[i] == demand.floor)
    plans = dict(decided)
    for i in choosing:
        if i not in decided:
            plan = _choose(rows[i], lengths[i])
            if plan is not None:
                plans[i] = plan
    return lengths, plans
