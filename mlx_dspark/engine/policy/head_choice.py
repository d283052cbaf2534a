"""Several draft heads beside one target (a block draft, a chained head, ...):
each round proposes from the head that promises the most tokens per millisecond on this machine.

`HeadChoice` is both the round's proposer (propose.Proposer) and its draft-length policy
(draft_length.DraftLength). Every head keeps its own policy (`AutoLength` over its own cost curve: a
block draft's one forward, a chain's cost per draft; or a fixed cap), so each parks, probes and explores
as it would alone. Before a round, each head's policy names its length; among the heads that would
draft, the one with the highest expected rate E_h(k) / (draft_h(k) + verify(k + 1)) proposes, E_h from
that head's own per-position acceptance seen so far (draft_length.expected_tokens); a head that sat out
`EXPLORE_EVERY` rounds proposes one, so a head that got better is seen (at most one round in 16 spent on
the worse head). The choice reads no
draft of this round, so acceptance stays exactly the single head's: lossless, greedy and sampled.
When no head would draft, the round is a plain step (parked) and every policy observes it.

Every head sees every committed position: the verify taps the union of the heads' layers, each head takes
its own columns; a head that did not propose takes them through `extend_later` (a block draft's context
catches up when it next drafts), and every head that reads committed tokens gets them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Sequence

import mlx.core as mx

from mlx_dspark.engine.policy.draft_length import DraftLength, expected_tokens
from mlx_dspark.engine.proposers.base import Proposal, Proposer, round_inputs
from mlx_dspark.engine.costs.curve import CostCurve

PRIOR, SMOOTHING = 0.6, 0.2  # a head's acceptance before it is observed, and how fast it follows
EXPLORE_EVERY = 16  # a head that would draft but sat out this many rounds proposes one (its acceptance moves)


class HeadChoice(Proposer):
    takes_logits_hook = True

    def __init__(self, heads: dict[str, Proposer], policies: dict[str, DraftLength], curves: dict[str, CostCurve | None]):
        if len(heads) < 2 or set(heads) != set(policies) or set(heads) != set(curves):
            raise ValueError(f"HeadChoice needs two or more heads, each with a policy and a curve; got {sorted(heads)}")
        self.heads, self.policies, self.curves = heads, policies, curves
        self.tap_ids = tuple(dict.fromkeys(t for head in heads.values() for t in head.tap_ids))
        self._columns = {name: [self.tap_ids.index(t) for t in head.tap_ids] for name, head in heads.items()}
        self.block_size = max(int(head.block_size) for head in heads.values())
        self.takes_target_cache = any(h.takes_target_cache for h in heads.values())  # handed on
        self.context = next((h.context for h in heads.values() if h.context is not None), None)
        # a prompt cache resumes the heads together: a block draft over its draft context, chains over its chains
        self.chains = tuple(chain for head in heads.values() for chain in head.chains)
        self.resumable = all(h.resumable or h.context is not None for h in heads.values())
        self.acceptance = {name: [PRIOR] * int(head.block_size) for name, head in heads.items()}
        self.chosen: Counter[str] = Counter()  # rounds each head proposed, for benchmarks
        self._current: str | None = None  # the head of the round in flight; None: parked
        self._position = 0  # the round's position (its curve's context)
        self._idle = {name: 0 for name in heads}  # drafting rounds since each head last proposed

    # -- DraftLength: which head, how long ----------------------------------------------------------

    def next_length(self, *, position: int) -> int:
        lengths = {name: policy.next_length(position=position) for name, policy in self.policies.items()}
        drafting = {name: n for name, n in lengths.items() if n > 0}
        if not drafting:
            self._current = None
            return 0
        idle = max(drafting, key=lambda name: self._idle[name])
        if len(drafting) > 1 and self._idle[idle] >= EXPLORE_EVERY:
            self._current = idle
        else:
            self._current = max(drafting, key=lambda name: (self.rate(name, drafting[name], position), -drafting[name]))
        for name in drafting:
            self._idle[name] = 0 if name == self._current else self._idle[name] + 1
        self._position = position
        return drafting[self._current]

    def round_estimate(self, length: int) -> tuple[float, float] | None:
        """(expected accepted drafts, the proposal's cost in ms) of `length` drafts from the round's head: what
        a lookup block is weighed against (choose.py); None when no head is chosen or its costs are unknown."""
        name = self._current
        if name is None or self.curves[name] is None:
            return None
        curve = self.curves[name].at(self._position)
        return expected_tokens(self.acceptance[name], length) - 1.0, curve.proposal_ms(length)

    def rate(self, name: str, length: int, position: int = 0) -> float:
        """Expected tokens per millisecond of a round of `length` drafts from head `name`."""
        curve = self.curves[name]
        if curve is None:  # no costs known (a fixed length without a measured curve): tokens per round
            return expected_tokens(self.acceptance[name], length)
        curve = curve.at(position)
        length = min(length, curve.max_width - 1)
        return expected_tokens(self.acceptance[name], length) / max(curve.round_ms(length), 1e-9)

    def observe(self, *, proposed: int, accepted: int, confidence: Any = None) -> None:
        if self._current is None:  # a plain step: every head's policy was parked
            for policy in self.policies.values():
                policy.observe(proposed=proposed, accepted=accepted, confidence=confidence)
            return
        self.policies[self._current].observe(proposed=proposed, accepted=accepted, confidence=confidence)
        for name, policy in self.policies.items():
            if name != self._current:  # its next round is timed from here, not across this one
                policy.restart_clock()
        rates = self.acceptance[self._current]
        for k in range(min(accepted + 1, proposed, len(rates))):
            rates[k] += SMOOTHING * ((1.0 if k < accepted else 0.0) - rates[k])

    def restart_clock(self) -> None:
        for policy in self.policies.values():
            policy.restart_clock()

    def untimed(self, ms: float) -> None:
        if self._current is not None:
            self.policies[self._current].untimed(ms)

    def finish(self) -> None:
        for policy in self.policies.values():
            policy.finish()

    def summary(self) -> dict:
        return {"heads": dict(self.chosen), **{name: p.summary() for name, p in self.policies.items()}}

    # -- Proposer -----------------------------------------------------------------------------------

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int, logits_hook: Callable | None = None,
                target_cache: Any = None) -> Proposal:  # fmt: skip
        name = self._current if self._current is not None else next(iter(self.heads))
        head = self.heads[name]
        self.chosen[name] += 1  # here, not when the length is named: a lookup block may take the round instead
        extra = round_inputs(head, logits_hook=logits_hook, target_cache=target_cache)
        proposal = head.propose(anchor, position=position, num_tokens=min(num_tokens, int(head.block_size)), **extra)
        if logits_hook is not None and "logits_hook" not in extra:
            proposal = Proposal(tokens=proposal.tokens, draft_probs=proposal.draft_probs, token_probs=proposal.token_probs,
                                confidence=proposal.confidence, hooked=False, source=proposal.source)  # fmt: skip
        return proposal

    def extend(self, features: mx.array) -> None:
        for name, head in self.heads.items():
            own = self._own(name, features)
            if name == self._current:
                head.extend(own)
            else:
                head.extend_later(own)

    def extend_later(self, features: mx.array) -> None:
        for name, head in self.heads.items():
            head.extend_later(self._own(name, features))

    def commit(self, tokens: Sequence[int]) -> None:
        for head in self.heads.values():
            head.commit(tokens)

    def flush(self) -> None:
        for head in self.heads.values():
            head.flush()

    def start_at(self, position: int) -> None:
        for head in self.heads.values():
            head.start_at(position)

    def take_catch_up_ms(self) -> float:
        return sum(head.take_catch_up_ms() for head in self.heads.values())

    def _own(self, name: str, features: mx.array) -> mx.array:
        """A head's columns of the union of tapped features (1, n, len(tap_ids) * hidden)."""
        columns = self._columns[name]
        if columns == list(range(len(self.tap_ids))) or not columns:  # all of them, or none (a head reading tokens)
            return features if columns else features[..., :0]
        hidden = features.shape[-1] // len(self.tap_ids)
        return mx.concatenate([features[..., i * hidden : (i + 1) * hidden] for i in columns], axis=-1)
