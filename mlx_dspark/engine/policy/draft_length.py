"""How many draft tokens each round proposes: a fixed cap, or `auto`, chosen live from this machine's costs.

One policy object per generation. The round asks `next_length(position=...)` before proposing (0: the
round runs the target alone, no draft forward) and reports `observe(proposed=..., accepted=...)` after
its host read. Anything else that proposes (lookup drafts, batched rounds) reads its cap from the same
object, so one choice governs every proposer.

`AutoLength` models a round of l drafts as yielding `E(l) = 1 + a(1) + ... + a(l)` tokens, with
`a(k) = q(1) * ... * q(k)` and `q(k)` the chance that position k is accepted once 1..k-1 were (a moving
average per position of what the rounds showed; positions a round proposed but never reached take the
draft's confidence head's c(k) where it has one), for `t_draft + t_verify(1 + l)` milliseconds of the
cost curve at the context depth reached. It picks the l of the highest `E(l) / ms`, re-chosen every
`every` rounds and changed only for a gain beyond `margin` (no flapping between near-equal lengths),
and parks (length 0: plain decoding) while no length beats one target step per token. Parked, it
probes a short draft now and then, backing off while the probes lose, and never when even perfect
acceptance could not pay at this depth (a curve whose verify(n) grows like n).

Lossless whatever it picks: the length is fixed before the round's drafts are looked at, so each round
is an ordinary speculative block (the greedy output and the sampled distribution do not change).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Sequence

from mlx_dspark.engine.policy import acceptance_memory

from mlx_dspark.engine.costs import heal as cost_heal
from mlx_dspark.engine.costs.heal import CurveHealer
from mlx_dspark.engine.costs.curve import CostCurve

AUTO = "auto"
OPTIMISTIC = 0.9  # the acceptance a probe's length is chosen for: what a good draft shows
NEAR_PAYING = 0.8  # a remembered acceptance this close to paying still gets a free look at the start
CONFIRM_ACCEPTED, MAX_CONFIRMS = 2, 2  # a probe accepting this many gets a free second look, this often per generation
# A position past the rounds' length keeps the estimate its last samples left, and a length shorter than it is
# never corrected by the rounds: each drafted round moves such an estimate up toward the mean of the positions it
# did reach, by this rate divided by the samples the position ever had (a stale value from a few unlucky early
# rounds is tried again within tens of rounds; one sampled often, and low, stays low far longer)
STALE_RELAX = 0.05


class DraftLength:
    """What the round (and any other proposer) asks of a length policy; a policy overrides what it uses."""

    cap: int  # the most draft tokens any round of this generation may propose
    acceptance: list[float] | None = None  # per-position acceptance estimates, where the policy keeps them
    curve: CostCurve | None = None  # the cost curve it chooses on (healed by the rounds), where it has one

    def next_length(self, *, position: int) -> int:
        """Draft tokens for the round whose anchor sits at `position` (0: no draft, a plain target step)."""
        raise NotImplementedError

    def observe(self, *, proposed: int, accepted: int, confidence: Any = None) -> None:
        """The round verified `proposed` drafts and accepted `accepted`; `confidence` (1, K) or None."""

    def restart_clock(self) -> None:
        """The next round is timed from now (a pause that was not drafting: a park, another head's round)."""

    def untimed(self, ms: float) -> None:
        """`ms` of the round in flight were not the draft's own cost (a catch-up)."""

    def finish(self) -> None:
        """The generation ended: keep what it showed for the next one."""

    def summary(self) -> dict:
        return {}


class FixedLength(DraftLength):
    """Every round proposes `cap` drafts (the model card's setting: the block size)."""

    parked_rounds = 0

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.lengths: Counter[int] = Counter()  # verified drafts per round -> rounds

    def next_length(self, *, position: int) -> int:
        return self.cap

    def observe(self, *, proposed: int, accepted: int, confidence: Any = None) -> None:
        self.lengths[proposed] += 1

    def summary(self) -> dict:
        return {"lengths": dict(sorted(self.lengths.items())), "parked_rounds": 0}


def expected_tokens(acceptance: Sequence[float], length: int) -> float:
    """E(l): tokens a round of `length` drafts commits, with conditional acceptances q(1), q(2), ..."""
    expected, prefix = 1.0, 1.0
    for q in acceptance[:length]:
        prefix *= q
        expected += prefix
    return expected


def rates(curve: CostCurve, acceptance: Sequence[float], cap: int) -> list[float]:
    """Expected tokens per millisecond for lengths 0..cap (0: a plain target step, one token)."""
    plain = 1.0 / max(curve.verify_ms[0], 1e-9)
    return [plain] + [expected_tokens(acceptance, n) / max(curve.round_ms(n), 1e-9) for n in range(1, cap + 1)]


def break_even(curve: CostCurve, length: int) -> float | None:
    """The acceptance q (the same at every position) at which `length` drafts per round tie with plain
    decoding; None when even q = 1 loses."""
    plain = rates(curve, [1.0] * length, length)[0]
    if rates(curve, [1.0] * length, length)[length] <= plain:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if rates(curve, [mid] * length, length)[length] <= plain else (low, mid)
    return high


class AutoLength(DraftLength):
    """The draft length of highest expected tokens per millisecond; 0 (parked) while no length pays."""

    def __init__(
        self,
        curve: CostCurve,
        cap: int,
        *,
        prior: float = 0.6,
        smoothing: float = 0.2,
        every: int = 4,
        margin: float = 0.05,
        probe_length: int | None = None,
        probe_every: int = 8,
        max_probe_every: int = 128,
        probe_budget: float = 0.02,
        explore_every: int = 4,
        max_explore_every: int = 16,
        heal: bool = False,
    ) -> None:
        if cap < 1:
            raise ValueError(f"an auto draft length needs a cap >= 1, got {cap}")
        # The curve as the rounds' own times correct it (engine/costs/heal.py): a curve measured under
        # load heals within the generation. A curve no round has checked yet gets one probe at once.
        self.healer = CurveHealer(curve) if heal else None
        self._check_probe = heal and not curve.checked
        self._last_observed: float | None = None
        self._catch_up_ms = 0.0  # this round's one-off work (untimed), part of what a probe costs
        self._probe_ms: float | None = None  # the last probe round, start to end, catch-up included
        self._plain_ms: float | None = None  # a plain step (running median-ish estimate)
        self._after_probe = False
        self._curve = curve
        self.cap = min(cap, curve.max_width - 1)
        if self.cap < 1:
            raise ValueError(f"cost curve {curve.source} covers verify width 1 only: auto needs widths 1..{cap + 1}")
        self.acceptance = [prior] * self.cap  # q(k), k = 1..cap
        self.observed = [False] * self.cap
        self.samples = [0] * self.cap  # how often each position was sampled (STALE_RELAX)
        # What this pair's draft showed in earlier generations (acceptance_memory.py): the prior, and no
        # free look when it says the draft does not pay
        self._memory_path = curve.cache_path if heal else None
        self.memory = acceptance_memory.recall(self._memory_path)
        if self.memory is not None:
            seen = list(self.memory.acceptance[: self.cap])
            self.acceptance = seen + [seen[-1]] * (self.cap - len(seen))
        self.smoothing, self.every, self.margin = smoothing, every, margin
        # A probe drafts the length that would pay best if the draft were good (OPTIMISTIC acceptance at
        # every position): a good draft's probe then commits most of what it costs and shows the deep
        # positions too; a bad one's costs a wider verify than a short probe (the budget counts it).
        self.probe_length = min(probe_length, self.cap) if probe_length else self._optimistic_length()
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.length = 0
        self.parked = False
        self.lengths: Counter[int] = Counter()  # verified drafts per round -> rounds
        self.parked_rounds = 0
        self._due = 0  # rounds until the next choice
        self._interval = probe_every  # parked rounds between probes (doubles after each that leaves it parked)
        self._until_probe = self._interval
        self._hopeless = False
        # Probes cost a draft block and a wider verify: what they may spend is `probe_budget` of the parked
        # rounds' time (in plain steps), so a draft that keeps failing costs ~2% at most; the probe
        # that follows a park by the prior alone is free (it is how a good draft starts drafting at once).
        self.probe_budget = probe_budget
        self._probe_spent = 0.0  # plain steps the charged probes cost beyond the tokens they committed
        self._charging = False  # the round in flight is a charged probe
        self._free_probe = False
        self._confirms = 0  # free looks that followed a probe accepting a run (CONFIRM_ACCEPTED)
        self.probes = 0
        # Exploration: a length whose frontier keeps being accepted is tried longer now and then (the
        # positions past it are never observed otherwise); backed off while the longer rounds fail.
        self.explore_every, self.max_explore_every = explore_every, max_explore_every
        self._explore_after = explore_every
        self._streak = 0  # rounds in a row whose every proposed draft was accepted
        self._exploring = 0  # the length an exploring round extends (0: not exploring)
        self.explorations = 0

    @property
    def curve(self) -> CostCurve:
        return self._curve if self.healer is None else self.healer.curve

    @property
    def _probe_cost(self) -> float:
        curve = self.curve  # in plain steps
        predicted = curve.round_ms(self.probe_length) / max(curve.verify_ms[0], 1e-9)
        # what the last probe really took, its draft context's catch-up included (measured here: a probe
        # after a long park took 4-5 plain steps with the step after it, where the curve said 2.8), once
        # plain steps were timed
        seen = self._probe_steps_seen
        return predicted if seen is None else max(predicted, seen)

    @property
    def _probe_steps_seen(self) -> float | None:
        """What a probe after a park really cost, in plain steps: timed in this generation, else as an earlier
        generation of this pair left it (acceptance_memory.py); None when neither."""
        if self._probe_ms is not None and self._plain_ms is not None:
            return self._probe_ms / self._plain_ms
        return None if self.memory is None else self.memory.probe_steps

    def _optimistic_length(self) -> int:
        """The length of most expected tokens per ms if every position were accepted at OPTIMISTIC."""
        by_length = rates(self.curve, [OPTIMISTIC] * self.cap, self.cap)
        return max(range(1, self.cap + 1), key=lambda n: (by_length[n], -n))

    def start_length(self, position: int = 0) -> int:
        """The length the first round would take at context `position` (the prior acceptance)."""
        best, pays = self._best(self.curve.at(position))
        return best if pays else 0

    def next_length(self, *, position: int) -> int:
        if self._last_observed is None:
            self._last_observed = time.perf_counter()  # the first round's time starts here
        if self._due <= 0:
            self._choose(self.curve.at(position))
            self._due = self.every
        self._due -= 1
        if not self.parked:
            if self._streak >= self._explore_after and self.length < self.cap:
                self._exploring, self._streak, self._due = self.length, 0, 0  # choose again after it
                self.explorations += 1
                return min(self.cap, 2 * self.length)
            return self.length
        self._until_probe -= 1
        if self._check_probe:  # one round that times the draft block: the curve may have been measured under load
            self._check_probe = False
            self._free_probe = False  # it is also the look at the real acceptance a park by the prior gets
            self.probes += 1
            self._due = 0
            return self.probe_length
        affordable = self._free_probe or self._probe_spent + self._probe_cost <= self.probe_budget * self.parked_rounds
        if self._hopeless or self._until_probe > 0 or not affordable:
            self.parked_rounds += 1
            return 0
        if self._free_probe:
            self._free_probe = False
        else:
            self._probe_spent += self._probe_cost  # the tokens it commits are credited back when it is observed
            self._charging = True
        self.probes += 1
        self._due = 0  # choose again right after the probe's observation
        return self.probe_length

    def restart_clock(self) -> None:
        """A round this policy does not observe (a lookup or forced block) ended: time the next from now."""
        if self._last_observed is not None:
            self._last_observed = time.perf_counter()

    def untimed(self, ms: float) -> None:
        """`ms` of this round was one-off work (the draft context catching up after a park or a prompt):
        the healer times the round without it, since it is no part of a round's steady cost."""
        if self._last_observed is not None and ms > 0:
            self._last_observed += ms / 1000
            self._catch_up_ms += ms

    def observe(self, *, proposed: int, accepted: int, confidence: Any = None) -> None:
        now = time.perf_counter()
        if self.healer is not None and self._last_observed is not None:  # real round times (a synthetic drive has none)
            ms = 1000 * (now - self._last_observed)
            self.healer.observe(proposed=proposed, ms=ms)
            if proposed == 0 and self._after_probe and self._probe_ms is not None:
                plain = self.curve.verify_ms[0] if self._plain_ms is None else self._plain_ms
                self._probe_ms += max(0.0, ms - plain)  # the step after a probe is not pipelined: the probe's too
            elif proposed == 0:  # moves by at most 5% a step: robust to the odd slow step
                self._plain_ms = ms if self._plain_ms is None else self._plain_ms * min(1.05, max(0.95, ms / self._plain_ms))
            elif self.parked:
                self._probe_ms = ms + self._catch_up_ms
            self._after_probe = proposed > 0 and self.parked
        self._catch_up_ms = 0.0
        self._last_observed = now
        self.lengths[proposed] += 1
        if proposed == 0:
            return
        if self._charging:  # a charged probe committed accepted + 1 tokens: plain steps it did not cost
            self._probe_spent -= accepted + 1
            self._charging = False
        probe = self.parked
        if probe:  # back off while probes do not show a paying length (leaving the park resets the interval)
            self._interval = min(2 * self._interval, self.max_probe_every)
            self._until_probe = self._interval
            if accepted >= CONFIRM_ACCEPTED and self._confirms < MAX_CONFIRMS:
                # a probe that accepted a run is one sample (the first round after a prompt is seldom like the
                # rest): look again soon, free, before the park settles on it
                self._confirms += 1
                self._free_probe, self._until_probe = True, self.probe_every
        exploring, self._exploring = self._exploring, 0
        if exploring:  # reaching past the old frontier: explore as often again; else less often
            self._explore_after = self.explore_every if accepted > exploring else min(2 * self._explore_after, self.max_explore_every)
        elif not probe:
            self._streak = self._streak + 1 if accepted == proposed else 0
        for k in range(min(accepted + 1, proposed, self.cap)):
            # a probe's or an exploration's sample weighs more: the estimates it corrects are old
            self._update(k, 1.0 if k < accepted else 0.0, weight=2.5 if probe or (exploring and k >= exploring) else 1.0)
        if confidence is not None:
            # positions after the first rejection, and past an accepted frontier: the draft's own estimate
            # of q(k) where the proposal carries it (one small host read)
            start = accepted + 1 if accepted < proposed else proposed
            stop = min(self.cap, confidence.shape[1]) if accepted == proposed else proposed
            for k, c in enumerate(confidence[0, start:stop].tolist(), start=start):
                if k < self.cap:
                    self._update(k, float(c), weight=0.5)
        reached = min(proposed, self.cap)
        if not probe and reached < self.cap:
            fresh = sum(self.acceptance[:reached]) / reached
            for k in range(reached, self.cap):
                if self.observed[k] and self.acceptance[k] < fresh:
                    self.acceptance[k] += STALE_RELAX / max(1, self.samples[k]) * (fresh - self.acceptance[k])
        seen = [k for k in range(self.cap) if self.observed[k]]
        if seen:  # never-reached positions follow the mean of those seen, not the prior (one rejection
            # at position k says little of k + 1 once k is accepted)
            mean = sum(self.acceptance[k] for k in seen) / len(seen)
            for k in range(seen[-1] + 1, self.cap):
                self.acceptance[k] = mean

    def _update(self, k: int, value: float, *, weight: float = 1.0) -> None:
        rate = min(1.0, self.smoothing * weight) if self.observed[k] else 0.5  # the first sample moves the prior halfway
        self.acceptance[k] += rate * (value - self.acceptance[k])
        self.observed[k] = True
        self.samples[k] += 1

    def _best(self, curve: CostCurve) -> tuple[int, bool]:
        """The best length (ties: the shorter) and whether it beats plain decoding."""
        by_length = rates(curve, self.acceptance, self.cap)
        best = max(range(1, self.cap + 1), key=lambda n: (by_length[n], -n))
        return best, by_length[best] > by_length[0]

    def _choose(self, curve: CostCurve) -> None:
        by_length = rates(curve, self.acceptance, self.cap)
        best, _ = self._best(curve)
        plain = by_length[0]
        self._hopeless = max(rates(curve, [1.0] * self.cap, self.cap)[1:]) <= plain  # no probe could pay
        if self.parked:
            if by_length[best] > plain * (1 + self.margin):  # leave the park only for a clear gain
                self.parked, self.length, self._interval = False, best, self.probe_every
                self._until_probe = self._interval
        elif by_length[best] <= plain:
            # parked by the prior alone (the first choice): look at the real acceptance in the next round
            self._until_probe = self._interval if self.length else 1
            # (no free look where the last generation's acceptance says the draft is far from paying); parked
            # after drafting that paid: the text may turn back soon, the first look is free too
            near = self.memory is None or by_length[best] > NEAR_PAYING * plain
            self._free_probe = (not self.length and not any(self.observed) and near) or self.length > 0
            self.parked, self.length, self._streak = True, 0, 0
        elif self.length == 0 or by_length[best] > by_length[self.length] * (1 + self.margin):
            self.length = best

    def finish(self) -> None:
        """The generation ended: keep what its drafted rounds showed for the next one (acceptance_memory.py)."""
        if not any(self.observed):
            return  # nothing drafted: the memory (or the prior) stands
        acceptance_memory.remember(self._memory_path, self.acceptance, probe_steps=self._probe_steps_seen)

    def summary(self) -> dict:
        return {"lengths": dict(sorted(self.lengths.items())), "parked_rounds": self.parked_rounds,
                "probes": self.probes, "explorations": self.explorations}


def make_draft_length(max_draft_tokens: int | str | None, block_size: int, curve: CostCurve | None) -> DraftLength:
    """The policy `SpeculationOptions.max_draft_tokens` asks for: `auto` (over `curve`) or a fixed cap."""
    if max_draft_tokens != AUTO:
        return FixedLength(max_draft_tokens or block_size)
    if curve is None:
        raise ValueError("max_draft_tokens 'auto' needs speculation.cost_curve (api.stream_generate fills in this machine's)")
    # a curve from the cost cache heals by the rounds' times; one given (a file, a test) is taken as given
    return AutoLength(curve, block_size, heal=cost_heal.ENABLED and curve.cache_path is not None)
