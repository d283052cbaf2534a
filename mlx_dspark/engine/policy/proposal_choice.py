"""The round's proposal when lookup or a grammar's forced tokens are in play: the better of two blocks.

Each round `Chooser.propose` builds, without a host read of its own:
- the **forced run** f(1..m): the tokens the grammar admits as the only continuation of the committed
  tokens (llguidance's fast-forward tokens, its canonical tokenisation; `GrammarState.forced`);
- **lookup** (`lookup.ContextIndex`): f followed by what came after the longest matched suffix of the
  context + f, as long as the expected rate says (up to `max_lookup` tokens, more than a draft block);
- the **DSpark block** x(1..K), K = `num_tokens` (the cap the caller's draft-length policy sets; 0 =
  parked: no draft forward): under a masked draft the forced positions are drafted for free (the
  logits hook knows them without reading the drawn token), otherwise they are put in front.
and verifies the DSpark block unless lookup's has the larger expected tokens per cost (parking the
draft is the caller's draft-length policy's decision; without a draft, lookup proposes when it pays): E = 1 + m + sum_k p^k over its unforced
tokens, p the per-token acceptance each source has shown (decayed counts; lookup per match length), cost = (draft block if DSpark) + verify forward of 1 + width tokens (`RoundCost`). The width
never passes `room` (max_tokens left, and what the target caches can roll back).
`propose` = `plan` (the decision, before any draft forward) + the draft's block + `finish` (the forced
run in front, a lookup tail); continuous batching (batch.py) calls the two halves around its one packed
draft forward for all rows.

Both blocks are ordinary drafts: forced and lookup tokens are deterministic (one-hot draft
distributions), so greedy and sampled acceptance stay lossless; a forced token the target's mask
admits alone is accepted with certainty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx

from mlx_dspark.engine.logits.grammar import GrammarState
from mlx_dspark.engine.policy.draft_length import expected_tokens
from mlx_dspark.engine.proposers.lookup import DEFAULT_NGRAM_SIZES, LOOKUP_MAX_TOKENS, ContextIndex
from mlx_dspark.engine.proposers.base import Proposal, Proposer, round_inputs
from mlx_dspark.engine.costs.curve import CostCurve

DECAY = 0.6  # per observation: acceptance drifts with the text (code, then prose, then JSON)
RELAX = 0.95  # per round a source sits out
CHAIN_MATCH = 8  # a lookup match at least this long makes reading the DSpark block worth its host read


@dataclass(frozen=True)
class RoundCost:
    """Relative cost of a round: a draft block and verify forwards of n tokens (widths past the curve
    extrapolated linearly from its last two points)."""

    draft: float
    verify: tuple[float, ...]  # verify[n - 1]: a forward of n tokens
    draft_step: float = 0.0  # a chained head's cost per draft (one forward each), 0 for a block draft

    @classmethod
    def from_curve(cls, curve: CostCurve) -> "RoundCost":
        return cls(draft=curve.draft_ms, verify=curve.verify_ms, draft_step=curve.draft_step_ms)

    def draft_cost(self, drafts: int) -> float:
        """A proposal of `drafts` tokens from the draft: its block, or its chain of that many steps."""
        return self.draft + drafts * self.draft_step

    @classmethod
    def default(cls) -> "RoundCost":
        """Without a measured curve: a verify forward's cost grows slowly with its width (memory-bound
        decoding), a draft block costs about a third of a target forward."""
        return cls(draft=0.3, verify=(1.0, 1.04))

    def verify_cost(self, width: int) -> float:
        if width <= len(self.verify):
            return self.verify[width - 1]
        slope = self.verify[-1] - self.verify[-2] if len(self.verify) > 1 else 0.0
        return self.verify[-1] + max(slope, 0.0) * (width - len(self.verify))


@dataclass
class SourceRate:
    """Decayed counts of accepted and rejected draft tokens of one source; p with a weak prior."""

    hits: float = 1.0
    misses: float = 1.0

    @property
    def rate(self) -> float:
        return self.hits / (self.hits + self.misses)

    def observe(self, proposed: int, accepted: int) -> None:
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (1 if accepted < proposed else 0)

    def relax(self) -> None:
        """A round without this source: drift back toward the prior, so a source once bad is tried again."""
        self.hits = RELAX * self.hits + (1 - RELAX)
        self.misses = RELAX * self.misses + (1 - RELAX)


def accepted_drafts(rate: float, length: int) -> float:
    """Expected accepted drafts of a block of `length`, each accepted with probability `rate` given the ones
    before: draft_length.expected_tokens without the round's bonus token."""
    return expected_tokens([rate] * length, length) - 1.0


@dataclass
class _Pending:
    source: str  # "draft" or "lookup" (or "forced" alone)
    forced: int
    proposed: int  # unforced tokens proposed
    ngram: int = 0  # the lookup match length
    chained: int = 0  # lookup tokens after a DSpark block


@dataclass(frozen=True)
class Plan:
    """`Chooser.plan`'s decision: `proposal` ready (lookup / forced; None: nothing to verify) when
    `draft_size` is 0, else a DSpark block of `draft_size` tokens is needed (`Chooser.finish`)."""

    proposal: Proposal | None = None
    draft_size: int = 0
    forced: tuple[int, ...] = ()  # the grammar's forced run, put in front of the block
    room: int = 0
    strong: bool = False  # a long lookup match: worth reading the block for a lookup tail
    expected: float = 1.0  # a ready block: the tokens its round is expected to commit


@dataclass
class Chooser(Proposer):
    """A Proposer (propose.py) over an optional DSpark draft and an optional lookup index."""

    draft: Proposer | None
    index: ContextIndex | None
    grammar: GrammarState | None = None
    cost: RoundCost = field(default_factory=RoundCost.default)
    max_lookup: int = LOOKUP_MAX_TOKENS
    takes_logits_hook = True  # handed on to the draft when it takes one
    takes_room = True

    def __post_init__(self) -> None:
        self.tap_ids = tuple(self.draft.tap_ids) if self.draft is not None else ()
        self.block_size = int(self.draft.block_size) if self.draft is not None else self.max_lookup
        draft = self.draft if self.draft is not None else Proposer()  # lookup alone: nothing of a draft's
        self.context = draft.context  # the prompt cache checks the draft context
        self.chains = tuple(draft.chains)  # and holds a chained draft's state
        self.resumable = draft.resumable
        self.takes_target_cache = draft.takes_target_cache  # handed on to the draft
        self.draft_rate = SourceRate()
        self.lookup_rates: dict[int, SourceRate] = {}
        self.chosen: dict[str, int] = {"draft": 0, "lookup": 0, "forced": 0, "none": 0}  # rounds, for benchmarks
        self.forced_tokens = 0  # forced-run tokens proposed, in front of any block
        self._pending: _Pending | None = None

    @classmethod
    def build(cls, *, draft: Proposer | None, context: Sequence[int], lookup: bool, grammar: GrammarState | None,
              cost: RoundCost | None = None, max_lookup: int = LOOKUP_MAX_TOKENS,
              ngram_sizes: Sequence[int] = DEFAULT_NGRAM_SIZES) -> "Chooser":
        index = ContextIndex(context, ngram_sizes=ngram_sizes) if lookup else None
        return cls(draft=draft, index=index, grammar=grammar, cost=cost or RoundCost.default(), max_lookup=max_lookup)

    # -- the protocol -----------------------------------------------------------------------------

    def extend(self, features: mx.array | None) -> None:
        if self.draft is not None and features is not None:
            self.draft.extend(features)

    def extend_later(self, features: mx.array | None) -> None:
        """A round with the draft parked: its context appends wait and go in together (propose.py)."""
        if self.draft is not None and features is not None:
            self.draft.extend_later(features)

    def flush(self) -> None:
        if self.draft is not None:
            self.draft.flush()

    def start_at(self, position: int) -> None:
        if self.draft is not None:
            self.draft.start_at(position)

    def take_catch_up_ms(self) -> float:
        """The draft's catch-up time since the last call (propose.DraftProposer.take_catch_up_ms)."""
        return 0.0 if self.draft is None else self.draft.take_catch_up_ms()

    def commit(self, tokens: Sequence[int]) -> None:
        """The committed tokens of a round (accepted drafts, then the bonus): index them, learn the rates;
        a draft that reads them (a chained head) takes them too."""
        if self.draft is not None:
            self.draft.commit(tokens)
        if self.index is not None:
            self.index.extend(tokens)
        pending, self._pending = self._pending, None
        if pending is None:
            return
        observed = None
        accepted = len(tokens) - 1 - pending.forced  # beyond the forced run
        # accepted < 0: the target chose another tokenisation inside the forced run: says nothing of the source
        if pending.proposed and accepted >= 0:
            observed = self.draft_rate if pending.source == "draft" else self._lookup_rate(pending.ngram)
            observed.observe(pending.proposed, min(accepted, pending.proposed))
            if pending.chained and accepted >= pending.proposed:  # the block survived: the lookup tail was tried
                self._lookup_rate(pending.ngram).observe(pending.chained, accepted - pending.proposed)
        for rate in (self.draft_rate, *self.lookup_rates.values()):
            if rate is not observed:
                rate.relax()

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int, room: int | None = None,
                logits_hook: Callable | None = None, target_cache: Any = None) -> Proposal | None:
        """A block of at most `room` tokens; the DSpark block holds at most `num_tokens` (0: parked)."""
        plan = self.plan(num_tokens=num_tokens, room=room)
        if not plan.draft_size:
            return plan.proposal
        extra = round_inputs(self.draft, logits_hook=logits_hook, target_cache=target_cache)
        drafted = self.draft.propose(anchor, position=position, num_tokens=plan.draft_size, **extra)
        return self.finish(plan, drafted, hooked="logits_hook" in extra)

    def plan(self, *, num_tokens: int, room: int | None = None) -> Plan:
        """The round's decision before any draft forward (`propose` = plan, the draft, `finish`; a batch
        runs the draft of every row whose plan needs one in one packed forward): a ready block (lookup,
        forced, or None), or a DSpark block of `plan.draft_size` tokens that `finish` completes."""
        room = self.max_lookup if room is None else room
        forced = self.grammar.forced()[:room] if self.grammar is not None else []
        m = len(forced)
        best, expected = self._best_ready(forced, room)
        size = min(num_tokens, room, self.block_size) if self.draft is not None else 0
        if size > m:  # the block is the default: parking the draft is the draft-length policy's call, not ours
            score = self._draft_score(m, size)
            if best[1] != "lookup" or score > best[0]:
                return Plan(draft_size=size, forced=tuple(forced), room=room, strong=best[3] >= CHAIN_MATCH)
        _, source, tokens, ngram = best
        tokens = forced + tokens
        self.chosen[source if tokens else "none"] += 1
        self.forced_tokens += m
        self._pending = _Pending(source, m, len(tokens) - m, ngram)
        if not tokens:
            return Plan(proposal=None)
        return Plan(proposal=Proposal(tokens=mx.array([tokens], dtype=mx.int32), hooked=False, source=source),
                    expected=expected)

    def finish(self, plan: Plan, drafted: Proposal, *, hooked: bool) -> Proposal:
        """The round's block from the draft's proposal of `plan.draft_size` tokens (`hooked`: drafted
        through the round's logits hook): the forced run in front, then a lookup tail where it pays."""
        size, forced = plan.draft_size, list(plan.forced)
        self.chosen["draft"] += 1
        self.forced_tokens += len(forced)
        self._pending = _Pending("draft", len(forced), size - len(forced))
        return self._chained(_forced_in_front(drafted, size, forced, hooked), plan.room, strong=plan.strong)

    def wants_round(self, *, room: int) -> bool:
        """Whether a round with the draft parked would verify anything (a forced run, a lookup block that
        pays) on the committed context: the round's plain pipelined steps (parked.py) stop for it."""
        if self.grammar is not None:
            return True  # forced runs depend on the grammar state the plain steps move: not predicted here
        return self.index is not None and room > 0 and self._best_ready([], room)[0][1] == "lookup"

    # -- inside -----------------------------------------------------------------------------------

    def _best_ready(self, forced: list[int], room: int) -> tuple[tuple[float, str, list[int], int], float]:
        """The best ready block (forced run, then a lookup continuation where it pays) and its expected tokens."""
        m = len(forced)
        best: tuple[float, str, list[int], int] = (self._rate(1 + m, 1 + m), "forced", [], 0)
        expected = 1.0 + m
        if self.index is not None and room > m:
            match = self.index.continuation(forced, max_tokens=min(self.max_lookup, room) - m)
            rate = self._lookup_rate(match.length).rate
            gain, power = 0.0, 1.0  # accepted_drafts(rate, length), summed as the length grows
            for length in range(1, len(match.tokens) + 1):
                power *= rate
                gain += power
                score = self._rate(1 + m + gain, 1 + m + length)
                if score > best[0]:
                    best = (score, "lookup", match.tokens[:length], match.length)
                    expected = 1 + m + gain
        return best, expected

    def _chained(self, proposal: Proposal, room: int, *, strong: bool) -> Proposal:
        """The DSpark block, then the lookup continuation of context + block where the expected rate
        says so. Reading the block costs a host read: only under a grammar (its tokens are read anyway,
        by the masked draft or the validation of an unmasked one) or beside a strong lookup match."""
        pending = self._pending
        size = proposal.tokens.shape[1]
        if self.index is None or room <= size or not (strong or self.grammar is not None):
            return proposal
        drafted = proposal.tokens[0].tolist()
        match = self.index.continuation(drafted, max_tokens=min(self.max_lookup, room) - size)
        unforced = size - pending.forced
        all_accepted = self.draft_rate.rate**unforced
        base = 1 + pending.forced + accepted_drafts(self.draft_rate.rate, unforced)
        rate = self._lookup_rate(match.length).rate
        best, length = self._rate(base, 1 + size, drafts=size), 0
        for n in range(1, len(match.tokens) + 1):
            score = self._rate(base + all_accepted * accepted_drafts(rate, n), 1 + size + n, drafts=size)
            if score > best:
                best, length = score, n
        if length == 0:
            return proposal
        extra = match.tokens[:length]
        pending.chained, pending.ngram = length, match.length
        ones = mx.ones((1, length), mx.float32)
        draft_probs = proposal.draft_probs
        if draft_probs is not None:
            one_hot = (mx.arange(draft_probs.shape[-1])[None] == mx.array(extra)[:, None]).astype(draft_probs.dtype)
            draft_probs = mx.concatenate([draft_probs, one_hot[None]], axis=1)
        token_probs, confidence = (
            None if x is None else mx.concatenate([x.astype(mx.float32), ones], axis=1)
            for x in (proposal.token_probs, proposal.confidence)
        )
        tokens = mx.concatenate([proposal.tokens.astype(mx.int32), mx.array([extra], dtype=mx.int32)], axis=1)
        # hooked=False: the grammar has not seen the lookup tokens, the round validates the block
        return Proposal(tokens=tokens, draft_probs=draft_probs, token_probs=token_probs, confidence=confidence,
                        hooked=False, source="lookup")

    def _lookup_rate(self, length: int) -> SourceRate:
        if length not in self.lookup_rates:  # the prior: a longer match is more likely copied on
            self.lookup_rates[length] = SourceRate(hits=max(1.0, length / 2), misses=1.0)
        return self.lookup_rates[length]

    def _draft_score(self, forced: int, size: int) -> float:
        """Expected tokens per cost of the draft's block of `size` (the first `forced` of them the grammar's):
        from the draft's own estimate where it has one (head_choice.HeadChoice: the round's head, its costs and
        per-position acceptance), else from this chooser's draft rate and the pair's curve."""
        estimate = self.draft.round_estimate(size - forced)
        if estimate is None:
            return self._rate(1 + forced + accepted_drafts(self.draft_rate.rate, size - forced), 1 + size, drafts=size)
        expected, draft_ms = estimate
        return (1 + forced + expected) / (draft_ms + self.cost.verify_cost(1 + size))

    def _rate(self, expected: float, width: int, *, drafts: int | None = None) -> float:
        """Expected tokens per cost of a round verifying `width` tokens; `drafts`: that many came from the draft."""
        spent = self.cost.draft_cost(drafts) if drafts is not None else 0.0
        return expected / (spent + self.cost.verify_cost(width))


def _forced_in_front(proposal: Proposal, size: int, forced: list[int], hooked: bool) -> Proposal:
    """The draft's first `size` tokens, the forced run in front, certain (a masked draft drew it
    already; an unmasked one may not have)."""
    if not forced:
        return Proposal(tokens=proposal.tokens[:, :size], draft_probs=_cut(proposal.draft_probs, size),
                        token_probs=_cut(proposal.token_probs, size), confidence=_cut(proposal.confidence, size),
                        hooked=hooked)
    m = len(forced)
    tokens = mx.concatenate([mx.array([forced], dtype=mx.int32), proposal.tokens[:, m:size].astype(mx.int32)], axis=1)
    draft_probs = proposal.draft_probs
    if draft_probs is not None:
        vocab = draft_probs.shape[-1]
        one_hot = (mx.arange(vocab)[None] == mx.array(forced)[:, None]).astype(draft_probs.dtype)[None]
        draft_probs = mx.concatenate([one_hot, draft_probs[:, m:size]], axis=1)
    ones = mx.ones((1, m), mx.float32)
    token_probs, confidence = (
        None if x is None else mx.concatenate([ones, x[:, m:size].astype(mx.float32)], axis=1)
        for x in (proposal.token_probs, proposal.confidence)
    )
    return Proposal(tokens=tokens, draft_probs=draft_probs, token_probs=token_probs, confidence=confidence,
                    hooked=hooked)


def _cut(x: mx.array | None, size: int) -> mx.array | None:
    return None if x is None else x[:, :size]
