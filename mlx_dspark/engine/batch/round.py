"""Continuous batching with speculation: one round advances every active request by one target forward.

A `BatchRow` is one request: its own prompt cache (target caches and draft context), sampler, logits
processor, proposer state and RNG. `batch_round(model, rows, ...)` runs, for all rows at once:
1. **Propose**: the rows that draft get one packed draft block forward (`models/packed/forward.py`); the heads
   run per row for sampled drafting (each row's own seed) and together for greedy drafting. Each row's
   draft length: with this machine's packed costs (`cost`, engine/batch/length.py), the `auto` rows'
   lengths are planned together for the most tokens per millisecond of the whole round (a row may be
   parked: a plain row in the forward); fixed-length and seeded sampled rows take their own policy's;
   all within the caller's `draft_cap(width)` when given, and cut per row by its `max_tokens` and its
   p_min / confidence threshold / confidence-schedule cuts (one host read each).
   A row with lookup on or a grammar's forced runs to verify proposes as a single request does, through
   its own `choose.Chooser`: `Chooser.plan` picks a lookup / forced block (no draft forward; up to 32
   tokens, within the row's room) or the DSpark block of the row's draft length, which then comes from
   the same packed draft forward and `Chooser.finish` completes (forced run in front, lookup tail).
   A chained head's rows keep their own drafter caches and run each chain
   step as one packed drafter forward (engine/batch/chains.py); a Gemma 4 assistant's row drafts its k
   steps by itself over its own target caches (engine/batch/propose.py).
2. **Verify**: one packed target forward over every row's segment: `[anchor, x1..xl]` for a drafting
   row, `[anchor]` for a plain or parked one, and the next chunk (at most `prefill_chunk` tokens) of a
   newcomer's prompt, so running streams keep flowing while it prefills.
3. **Accept** per row (greedy or sampled, on the row's processed logits), then **one host read** for the
   whole batch; each row trims its own caches (`trim_caches`) and gives its draft the features of its
   committed positions: ragged acceptance, no padding.
Each row's `Round`s queue in `row.rounds`; `row.steps()` yields them to `api.stream_rounds`, which
applies stop tokens, stop strings and max_tokens exactly as for a single request.

Greedy rows are token-identical to the same request run alone (each packed row computes bitwise what
its own forward computes on a BLAS whose rows are independent; see models/packed/forward.py). A seeded sampled
row draws from a generator of its own (re-seeded per round from its seed), so its output does not
depend on the other rows; it reproduces at the same draft lengths, not the draws of `stream_generate`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from mlx_dspark.engine.round.accept import accept_greedy, accept_sampled
from mlx_dspark.engine.batch.length import BatchCost, Probes, RowDemand
from mlx_dspark.engine.batch.plan import plan_round
from mlx_dspark.engine.batch.propose import propose_rows
from mlx_dspark.engine.policy.proposal_choice import Chooser
from mlx_dspark.engine.costs.probe import cost_curve_for
from mlx_dspark.engine.proposers import default_head
from mlx_dspark.engine.round.decode import Round, _admitted
from mlx_dspark.engine.policy.draft_length import AutoLength, DraftLength, make_draft_length
from mlx_dspark.engine.logits.grammar import GrammarState
from mlx_dspark.engine.logits.processing import LogitsProcessor
from mlx_dspark.engine.proposers.lookup import LOOKUP_MAX_TOKENS
from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.proposers.base import CHAIN, Proposal
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.costs.curve import require_confidence_head
from mlx_dspark.engine.round.request import _chosen, head_proposer, make_processor
from mlx_dspark.engine.tree.fallback import say_chain_rounds
from mlx_dspark.models.caches.kv import rollback_limit, trim_caches
from mlx_dspark.models.target.finite import check_finite_logits
from mlx_dspark.models.packed.forward import packed_target_forward

PREFILL_CHUNK = 128  # prompt tokens a newcomer adds to one round


class BatchRow:
    """One request in the batch; see the module docstring. Build it, then run `batch_round`s until the
    consumer of `steps()` has what it wants (the batch never stops a row by itself: stops are the api's)."""

    def __init__(
        self,
        model: Any,
        prompt_ids: Sequence[int],
        options: GenerationOptions,
        *,
        prompt_cache: PromptCache | None = None,
        grammar: GrammarState | None = None,
        cancel: threading.Event | None = None,
        proposer: DraftProposer | None = None,
    ) -> None:
        """`proposer` replaces the row's DraftProposer over the loaded draft (a benchmark's controlled
        one): it must draft with `model.draft` over `prompt_cache.draft_context`, and may define
        `revise(proposal, position=, num_tokens=)` to rewrite what the batch's draft proposed."""
        vocab = model.target.args.vocab_size
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        self.prompt = list(prompt_ids)
        self.options = options
        self.sampler = options.sampling
        self.speculation = options.speculation
        if self.speculation.tree_nodes:  # tree rounds are a single request's (tree_steps.py): this row runs chains
            say_chain_rounds(self.speculation.tree_nodes, ["a batched row: tree rounds verify one request at a time"])
            self.speculation = dataclasses.replace(self.speculation, tree_nodes=0)
        self.cancel = cancel
        self.processor = make_processor(model, self.prompt, options, grammar) or LogitsProcessor.passthrough()
        lookup = self.speculation.lookup if self.speculation.speculative else "off"
        # as make_steps: caches that roll back a whole lookup block when the row makes its own
        rollback = LOOKUP_MAX_TOKENS if lookup != "off" else None
        self.prompt_cache = prompt_cache or PromptCache(model.target, model.draft, max_snapshots=0, max_rollback=rollback)
        self.proposer: DraftProposer | None = None if lookup == "only" else proposer
        self.max_draft = 0
        if proposer is not None and proposer.context is not self.prompt_cache.draft_context:
            raise ValueError("the proposer must draft over the row's prompt cache: DraftProposer(..., context=prompt_cache.draft_context)")
        head = default_head(model)  # the pair's one head (models/packed.packing_problem refuses several)
        if proposer is None and self.speculation.speculative and lookup != "only" and model.heads.get(head) is not None:
            self.proposer = head_proposer(model, head, self.prompt, options, self.prompt_cache)
        # drafts k chained steps of its own (batch_propose.py); a Gemma 4 assistant over the row's target caches
        self.chained = self.proposer is not None and self.proposer.cost_kind == CHAIN
        # this machine's single-request curve (measured once and cached), read once for the row's length
        # policy, its Chooser and its confidence schedule
        speculation = self.speculation
        curve = speculation.cost_curve
        if curve is None and speculation.speculative and (speculation.auto_length or speculation.verify_schedule == "confidence"):
            # a batch round's time is the batch's, not this row's: it must not heal the single-request curve
            curve = dataclasses.replace(cost_curve_for(model, head=head), cache_path=None)
        self.length: DraftLength | None = None  # the row's own length policy (auto: its acceptance, the curve)
        if self.proposer is not None:
            self.max_draft = speculation.draft_length(self.proposer.block_size)
            self.length = make_draft_length(speculation.max_draft_tokens, self.max_draft, curve)
        # The batch plans this row's lengths with the others' (batch_length.plan_lengths) when its policy
        # is auto, unless it is a seeded sampled row: its draws then follow its own lengths alone, so its
        # reply does not depend on what else the batch runs.
        self.planned = isinstance(self.length, AutoLength) and (self.sampler.greedy or self.sampler.seed is None)
        self.probes = Probes()
        # lookup blocks and forced runs as a single request proposes them (steps._chosen, choose.py): the
        # Chooser decides per round, its DSpark blocks come from the batch's packed draft forward
        self.chooser: Chooser | None = None
        if self.speculation.speculative:
            chosen = _chosen(self.proposer, self.prompt, dataclasses.replace(speculation, cost_curve=curve), grammar)
            self.chooser = chosen if isinstance(chosen, Chooser) else None
        self.schedule = None  # the cost curve a confidence-scheduled row cuts its proposals with
        if self.chained and self.speculation.verify_schedule == "confidence":  # refused here, not in a shared round
            raise ValueError(f"verify_schedule 'confidence' needs a draft with a confidence head; the {head} head has none: "
                             "use verify_schedule 'fixed'")  # fmt: skip
        if self.proposer is not None and self.speculation.verify_schedule == "confidence":
            require_confidence_head(self.proposer.draft, source=getattr(model, "draft_path", None) or "the draft")
            self.schedule = curve
        if self.proposer is not None and not self.chained:
            if self.speculation.confidence_threshold > 0:  # as make_steps: a threshold needs a confidence head
                require_confidence_head(self.proposer.draft, source=getattr(model, "draft_path", None) or "the draft",
                                        need=f"confidence_threshold {self.speculation.confidence_threshold}", fix="set it to 0")  # fmt: skip
        # A sampled row draws from its own stream (fresh entropy without a seed), never another row's.
        self._seeds = None if self.sampler.greedy else np.random.default_rng(self.sampler.seed)
        self.rounds: deque[Round] = deque()
        self.prefilled = self.prompt_cache.resume(model.target, self.prompt, proposer=self.proposer)
        self._stops = self.prompt_cache.prefill_stops(self.prefilled, len(self.prompt))
        self.lease = self.prompt_cache.lease
        self.anchor: int | None = None  # the last committed token (not yet in the caches)
        self.emitted = 0
        self.proposed = 0  # draft tokens verified, over all rounds
        self.accepted = 0

    @property
    def prefilling(self) -> bool:
        return self.anchor is None

    @property
    def position(self) -> int:
        """The anchor's position (the caches hold the positions before it)."""
        return len(self.prompt) + self.emitted - 1

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens per verified draft token so far (0 before any)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    def steps(self) -> Iterator[Round]:
        """The rounds as `batch_round` produces them (for `api.stream_rounds`); pull only after a round."""
        while True:
            if not self.rounds:
                raise RuntimeError("no round is ready for this row: run batch_round before pulling its steps")
            yield self.rounds.popleft()

    def reseed(self) -> None:
        """Before building this row's random draws: re-seed MLX's generator from the row's own stream."""
        if self._seeds is not None:
            mx.random.seed(int(self._seeds.integers(2**32)))

    def draw_key(self) -> mx.array:
        """A key from this row's own stream, for draws built in one graph with other rows' (batch_chain.py)."""
        return mx.random.key(int(self._seeds.integers(2**32)))

    def room(self) -> int:
        """The most tokens this round's block may hold: what max_tokens leaves and the caches roll back."""
        left = self.options.max_tokens - self.emitted - 1
        return max(0, min(rollback_limit(self.prompt_cache.target_cache), left))

    def draft_budget(self, cap: int) -> int:
        """This round's drafts: the row's policy (auto: 0 while parked) within the batch width's cap."""
        if self.proposer is None or self.anchor is None:
            return 0
        return max(0, min(self.length.next_length(position=self.position), cap, self.room()))

    def _prefill_end(self, prefill_chunk: int) -> int:
        return min(self.prefilled + prefill_chunk, next(s for s in self._stops if s > self.prefilled))

    def demand(self, cap: int, prefill_chunk: int) -> RowDemand:
        """What this row brings to the round's plan (batch_length.RowDemand)."""
        if self.prefilling:
            end = self._prefill_end(prefill_chunk)
            return RowDemand(rows=end - self.prefilled, tokens=end == len(self.prompt))
        if self.proposer is None:
            return RowDemand()
        if not self.planned:  # its own policy's length, as the plan's floor
            length = self.draft_budget(cap)
            return RowDemand(floor=length, acceptance=self.length.acceptance if self.length.acceptance is not None else [self.acceptance or 0.6] * length)
        room = min(cap, self.room())
        return RowDemand(floor=min(self.probes.floor(), room), acceptance=self.length.acceptance, cap=room)


@dataclass
class _Plan:
    """One row's part of a round: its segment of the packed forward, then its lazy outcome."""

    row: BatchRow
    segment: mx.array  # (n,) the row's input rows: a prompt chunk, or [anchor, x1..xl]
    end: int | None = None  # a prefill chunk: the prompt position it reaches
    draft: mx.array | None = None  # a verify: the admitted draft tokens (l,)
    draft_probs: mx.array | None = None
    accepted: mx.array | None = None  # () accepted draft tokens
    candidates: mx.array | None = None  # committed candidates; the first accepted + 1 are committed
    logprobs: tuple = ()
    features: mx.array | None = None  # (1, n, F) the row's tapped features (rows with a draft)
    first_logits: mx.array | None = None  # the prompt's last logits (1, V), checked once
    source: str = "draft"  # the block's: "draft" (or none), "lookup" / "forced" (a Chooser's)

    @property
    def prefill(self) -> bool:
        return self.end is not None


def _plan(row: BatchRow, proposal: Proposal | None, budget: int, prefill_chunk: int) -> _Plan:
    """`budget`: the row's draft tokens this round; a Chooser's block comes sized by it (its width)."""
    if row.prefilling:
        end = row._prefill_end(prefill_chunk)
        return _Plan(row, mx.array(row.prompt[row.prefilled : end], dtype=mx.int32), end=end)
    row.prompt_cache.claim(row.lease)
    speculation = row.speculation
    if row.chooser is not None:
        budget = 0 if proposal is None else proposal.tokens.shape[1]
    tokens, probs = _admitted(
        proposal, budget, p_min=speculation.p_min, threshold=speculation.confidence_threshold, schedule=row.schedule
    )
    tokens, probs = row.processor.admit(tokens, probs, hooked=proposal is not None and proposal.hooked)
    return _Plan(row, mx.concatenate([mx.array([row.anchor], dtype=mx.int32), tokens]), draft=tokens, draft_probs=probs,
                 source="draft" if proposal is None else proposal.source)


def _head_rows(plans: list[_Plan]) -> list[int]:
    """The packed rows whose logits the round needs: every verify row, the last row of a prompt's last chunk."""
    rows, start = [], 0
    for plan in plans:
        n = plan.segment.shape[0]
        if not plan.prefill:
            rows.extend(range(start, start + n))
        elif plan.end == len(plan.row.prompt):
            rows.append(start + n - 1)
        start += n
    return rows


def _accept(plan: _Plan, logits: mx.array) -> None:
    """The row's outcome from its logits (lazy): the prompt's first token, a plain draw, or an acceptance."""
    row = plan.row
    if plan.prefill:
        plan.first_logits = logits
        processed = row.processor.target_logits(logits, mx.zeros((0,), mx.int32))
        row.reseed()
        plan.candidates = row.sampler.sample(processed[0]).astype(mx.int32).reshape(1)
        plan.accepted = mx.array(0, mx.int32)
        plan.logprobs = row.processor.logprob_arrays(processed, plan.candidates)
        return
    processed = row.processor.target_logits(logits, plan.draft)
    row.reseed()
    if row.proposer is None and row.chooser is None:  # plain decoding: the target's own draw
        plan.candidates = row.sampler.sample(processed).astype(mx.int32)
        plan.accepted = mx.array(0, mx.int32)
    elif row.sampler.greedy:
        acceptance = accept_greedy(draft_tokens=plan.draft, target_logits=processed)
        plan.accepted, plan.candidates = acceptance.accepted, acceptance.tokens
    else:
        probs = row.sampler.probs(processed)
        acceptance = accept_sampled(draft_tokens=plan.draft, draft_probs=plan.draft_probs, target_probs=probs)
        plan.accepted, plan.candidates = acceptance.accepted, acceptance.tokens
    plan.logprobs = row.processor.logprob_arrays(processed, plan.candidates)


def _commit_tokens(row: BatchRow, tokens: list[int]) -> None:
    """The committed tokens to what reads them: the logits processor, the Chooser (it passes them on to its
    draft) or else the proposer (a chained head pairs its cache entries with them)."""
    row.processor.commit(tokens)
    reader = row.chooser if row.chooser is not None else row.proposer
    if reader is not None:
        reader.commit(tokens)


def _commit(plan: _Plan) -> None:
    """After the host read: record, roll back, advance this row, and queue its Round."""
    row = plan.row
    if plan.prefill:
        row.prompt_cache.record(row.prompt[row.prefilled : plan.end])
        row.prefilled = plan.end
        if plan.end < len(row.prompt):
            if plan.end in row._stops:  # where the prompt cache keeps a snapshot (near the prompt's end)
                row.prompt_cache.snapshot()
            return
        check_finite_logits(plan.first_logits, step="the first step (the end of the prompt)")
        first = int(plan.candidates.item())
        row.anchor, row.emitted = first, 1
        _commit_tokens(row, [first])
        row.rounds.append(Round(tokens=[first], logprobs=row.processor.read_logprobs(plan.logprobs, [first])))
        return
    accepted, num_draft = int(plan.accepted.item()), int(plan.draft.shape[0])
    committed = plan.candidates.reshape(-1)[: accepted + 1].tolist()
    _commit_tokens(row, committed)
    trim_caches(row.prompt_cache.target_cache, num_draft - accepted)  # the row's own rollback
    if row.proposer is not None:
        if plan.source == "draft":  # as decode.py: lookup / forced blocks say nothing of the draft
            row.length.observe(proposed=num_draft, accepted=accepted)
        else:  # as decode.py: the row's next draft round is timed from here
            row.length.restart_clock()
        if plan.features is not None:  # a proposer without tapped layers (self-speculation, a draft model) takes no features
            row.proposer.extend(plan.features[:, : accepted + 1])
    if row.proposer is not None or row.chooser is not None:
        row.proposed += num_draft
        row.accepted += accepted
    row.prompt_cache.record([row.anchor, *committed[:-1]])  # the bonus, the new anchor, is not in the caches
    row.anchor = committed[-1]
    row.emitted += accepted + 1
    row.rounds.append(Round(
        tokens=committed, proposed=num_draft, accepted=accepted,
        verified=row.proposer is not None or row.chooser is not None,
        logprobs=row.processor.read_logprobs(plan.logprobs, committed),
        source=plan.source if num_draft else None,
    ))  # fmt: skip


def batch_round(
    model: Any,
    rows: Sequence[BatchRow],
    *,
    draft_cap: Callable[[int], int] | int | None = None,
    cost: BatchCost | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
) -> None:
    """Advance every row by one target forward (see the module docstring); each row gets at most one Round.
    `cost`: this machine's packed costs (batch_length.batch_cost_for): auto rows' lengths are planned
    together; `draft_cap(width)`: a cap on every row's drafts at a batch width (None: the rows' own caps)."""
    if not rows:
        return
    cap = 1 << 30 if draft_cap is None else draft_cap(len(rows)) if callable(draft_cap) else int(draft_cap)
    budgets, chosen = plan_round(rows, cap, cost, prefill_chunk)
    # a row with a Chooser drafts only when its plan asks for a DSpark block (never past its room)
    sizes = [chosen[i].draft_size if i in chosen else 0 if r.chooser else n for i, (r, n) in enumerate(zip(rows, budgets))]
    drafting = [i for i, n in enumerate(sizes) if n > 0]
    proposals: dict[int, Proposal | None] = {i: plan.proposal for i, plan in chosen.items()}
    if drafting:
        made = propose_rows(model, [rows[i] for i in drafting], [sizes[i] for i in drafting])
        for i, proposal in zip(drafting, made):  # a Chooser's block: forced run in front, a lookup tail
            proposals[i] = rows[i].chooser.finish(chosen[i], proposal, hooked=proposal.hooked) if i in chosen else proposal
        # the draft runs while the host builds the verify graph
        mx.async_eval([p.tokens for p in proposals.values() if p is not None])
    plans = [_plan(row, proposals.get(i), budgets[i], prefill_chunk) for i, row in enumerate(rows)]
    lengths = [int(p.segment.shape[0]) for p in plans]
    # every drafting row's proposer taps the same layers (one head per pair in a batch)
    tap_ids = next((tuple(r.proposer.tap_ids) for r in rows if r.proposer is not None), ())
    logits, features = packed_target_forward(
        model.target, mx.concatenate([p.segment for p in plans]), [r.prompt_cache.target_cache for r in rows], lengths,
        tap_ids=tap_ids, head_rows=_head_rows(plans),
    )  # fmt: skip
    pending, row_start, head_start = [], 0, 0
    for plan, n in zip(plans, lengths):
        if features is not None and plan.row.proposer is not None:
            plan.features = features[row_start : row_start + n][None]
            if plan.prefill:
                plan.row.proposer.extend(plan.features)
        row_start += n
        if plan.prefill and plan.end < len(plan.row.prompt):
            continue  # a middle chunk: no logits, nothing drawn
        heads = 1 if plan.prefill else n
        _accept(plan, logits[head_start : head_start + heads])
        head_start += heads
        pending.extend([plan.accepted, plan.candidates, *plan.logprobs])
    mx.eval(*pending, *(() if features is None else (features,)))  # the round's one host read
    for plan in plans:
        _commit(plan)
