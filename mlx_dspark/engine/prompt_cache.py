"""Prompt cache: a conversation's target caches and draft context, kept warm between generations.

Design (issue 11). A `PromptCache` owns the target's per-layer caches, the draft's context cache (when
the pair has a draft) and `tokens`, the exact sequence those caches hold: after a generation that is
the prompt plus the committed tokens the target has processed (the last anchor is not in it; tokens a
round committed past the generation's stop are forgotten again: `forget_past`). A new generation calls `resume(target, prompt, proposer=...)`,
which rewinds the caches to the longest prefix they can serve *exactly* and returns its length
(`cached_tokens`); the step generator then prefills only the rest. At least one prompt token is
always prefilled, because the first generated token needs its logits.

Rewinding is exact, never approximate, and picks the first of:
1. the live caches, trimmed to the common prefix: always possible for full-attention layers
   (mlx-lm's `KVCache` and the draft's full context trim any amount); the draft's windowed layers only
   while the rolled-back span is within what they still keep (`trimmable()`); the target's other caches
   (`models/rollback.RollbackCaches`: rotating windows, recurrent states) only within their latest
   recorded forward (a verify);
2. the newest snapshot at or before the common prefix: a snapshot copies, at one position, only what
   cannot be trimmed back to, i.e. the target's rotating-window and recurrent layer states
   (`LayerState`) and the last `window - 1` keys/values of every windowed draft layer (full layers are
   trimmed to its position instead). Snapshots are
   taken during the prefill at `len(prompt) - 1` (so re-sending a prompt, or a next turn that extends
   it, resumes there) and at `len(prompt) - 1 - snapshot_margin` (for chat templates that re-render
   the generation prompt differently in the history); the newest `max_snapshots` are kept, which
   bounds their memory whatever the conversation's length;
3. nothing: a cold prefill (correct, only slower).
Chat templates that re-render the last assistant turn (thinking removed) make the common prefix end
before the cached position; the snapshot at the previous prompt's end serves that case.

Consistency. The caches are only consistent between rounds; the step generators `record` the tokens
the caches took at every yield (the cache is then reusable, also when the consumer stops early or
drops the generator) and `claim` the cache before they change it again. An exception in between
leaves the cache marked inconsistent, and the next `resume` starts cold. A newer `resume` (a second
generation on the same cache) makes the older generator raise on its next step instead of running on
caches that are no longer its own.

Draft context. The draft proposer must read and extend this cache's `draft_context`
(`DraftProposer(..., context=prompt_cache.draft_context)`); a plain generation does not extend it,
so switching between plain and speculative generations on one cache restarts it cold.

Chained heads (issue 35.5). A chained head's proposer drafts over this cache's `chain_context(name,
make_cache)` (`context=`; engine/proposers/chain_context.py): the drafter's KV cache (full attention: trimmed to any
position, so snapshots copy nothing of it), its entries, the tokens they pair with, the waiting features and
the newest entry's features. Entry t pairs the target's features at t with the token at t + 1, so a resume
also stops where a chain can no longer serve exactly (`ChainContext.reach`): the entry before the resumed
position is kept when its next token is the prompt's, written again from kept features otherwise (the newest
entry's: a next turn that extends the held tokens with another token than the last anchor), else the resume
starts one position earlier (the target then gives that position's features again). A Gemma 4 assistant keeps
nothing of its own (`resumable`, `start_at`): it reads the target's caches and the newest features, which the
prefill always gives. Several heads (`HeadChoice`) resume together over their states. A chain that did not
follow the latest generation, or a proposer whose state this cache does not hold (a chain of its own, or no
`draft_context` and not `resumable`), starts cold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx

from mlx_dspark.models.caches.kv import trim_caches
from mlx_dspark.models.caches.rollback import TRIM, LayerState, RollbackCaches, layer_state, restore_layer
from mlx_dspark.engine.proposers.chain_context import ChainContext, common_prefix
from mlx_dspark.engine.proposers.base import Proposer

__all__ = ["PromptCache", "Snapshot", "common_prefix"]

State = tuple[mx.array | None, mx.array | None, int]  # a cache's `snapshot()`: kept keys, values, offset


def _state_arrays(state: State | LayerState) -> list[mx.array]:
    if isinstance(state, LayerState):
        return state.arrays()
    keys, values, _ = state
    return [] if keys is None else [keys, values]


@dataclass
class Snapshot:
    """The state at `position` that trimming cannot reach back to, by layer index: sliding target layers,
    a hybrid's recurrent / rotating target layers (`LayerState`), windowed draft layers."""

    position: int
    target: dict[int, State | LayerState] = field(default_factory=dict)
    draft: dict[int, State] | None = None  # None: taken during a plain generation (a chained head's: {})

    @property
    def nbytes(self) -> int:
        states = list(self.target.values()) + list((self.draft or {}).values())
        return sum(a.nbytes for state in states for a in _state_arrays(state))


class PromptCache:
    """The caches of one conversation and the token sequence they hold; see the module docstring.

    For a server's LRU: `tokens` (the held sequence), `nbytes` (live caches and snapshots),
    `reusable(prompt, speculative=...)` (what a resume would reuse, without changing anything) and
    `cached_tokens` (what the latest resume reused).
    """

    def __init__(self, target: Any, draft: Any = None, *, max_snapshots: int = 4, snapshot_margin: int = 16,
                 max_rollback: int | None = None):
        """`max_rollback`: how far the target's sliding caches can roll back after a round (None: the
        target's default, 8); lookup blocks (choose.py) verify up to that many tokens."""
        if not isinstance(max_snapshots, int) or max_snapshots < 0:
            raise ValueError(f"max_snapshots must be an integer >= 0, got {max_snapshots!r}")
        if not isinstance(snapshot_margin, int) or snapshot_margin < 0:
            raise ValueError(f"snapshot_margin must be an integer >= 0, got {snapshot_margin!r}")
        self.target = target
        self.draft = draft
        self.max_snapshots = max_snapshots
        self.snapshot_margin = snapshot_margin
        self._cache_options = {} if max_rollback is None else {"max_rollback": max_rollback}
        self.target_cache: list[Any] = target.make_cache(**self._cache_options)
        self.draft_context: list[Any] | None = None if draft is None else draft.make_cache()
        self.chains: dict[str, ChainContext] = {}  # the chained heads' states, by head name (`chain_context`)
        self.cached_tokens = 0  # prompt tokens the latest resume reused
        self._tokens: list[int] = []
        self._snapshots: list[Snapshot] = []  # in position order
        self._consistent = True  # the live caches hold exactly `_tokens`
        self._speculative: bool | None = None  # whether the draft context followed the latest generation
        self._followers: tuple[ChainContext, ...] | None = ()  # the chains that did (None: a state not held here)
        self._lease = 0

    # -- what a server reads ---------------------------------------------------------------------

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    @property
    def lease(self) -> int:
        """Bumped by every `resume`: the generation that owns the caches now."""
        return self._lease

    @property
    def nbytes(self) -> int:
        live = sum(c.nbytes for c in self.target_cache) + sum(c.nbytes for c in self.draft_context or [])
        live += sum(chain.nbytes for chain in self.chains.values())
        return live + sum(s.nbytes for s in self._snapshots)

    def reusable(self, prompt: Sequence[int], *, speculative: bool) -> int:
        """How many tokens of `prompt` a resume would reuse now (changes nothing); a speculative one with
        the heads of the latest generation."""
        return self._plan(prompt, speculative=speculative, chains=self._followers if speculative else ())[0]

    def chain_context(self, name: str, make_cache: Callable[[], list], *, state: type[ChainContext] = ChainContext) -> ChainContext:
        """The state of the chained head `name` (its registry name), made on first use (a `state`: the head's own
        kind of ChainContext): build its proposer with `context=` this so a later generation resumes it."""
        if name not in self.chains:
            self.chains[name] = state(make_cache)
        return self.chains[name]

    # -- what the step generators call -----------------------------------------------------------

    def resume(self, target: Any, prompt: Sequence[int], *, proposer: Proposer | None = None) -> int:
        """Rewind the caches to the longest prefix of `prompt` they can serve exactly; returns its length.

        After it the target caches (and, with a proposer, the draft context) hold `prompt[:start]`;
        the caller prefills `prompt[start:]` and `record`s it.
        """
        if len(prompt) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if target is not self.target:
            raise ValueError("this prompt cache was made for another target model; make one per loaded model")
        speculative = proposer is not None
        proposer = proposer if speculative else Proposer()  # plain decoding: no state of a head's
        foreign = proposer.context is not self.draft_context
        if speculative and self.draft_context is not None and foreign:
            raise ValueError(
                "the proposer does not use this prompt cache's draft context: "
                "build it as DraftProposer(..., context=prompt_cache.draft_context)"
            )
        used = tuple(proposer.chains)
        for chain in used:
            if chain not in self.chains.values() and (chain.entries or chain.waiting):
                raise ValueError(
                    "the proposer drafts over a chained head's state that is not this prompt cache's: build it "
                    "with context=prompt_cache.chain_context(name, drafter.make_cache), or with a fresh state"
                )
        chains = self._held(proposer) if speculative else ()
        start, snapshot = self._plan(prompt, speculative=speculative, chains=chains)
        self._lease += 1
        self._consistent = False
        if start == 0:
            self._reset()
        else:
            self._rewind(start, snapshot, speculative=speculative, chains=chains or (), prompt=prompt)
        for chain in self.chains.values():
            if chain not in used:
                chain.reset()  # it does not follow this generation: stale from here on (memory freed)
            elif start == 0:
                chain.reset(prompt)  # a cold prefill of the whole prompt follows
        proposer.start_at(start)
        self._speculative, self._followers = speculative, chains
        self.cached_tokens = start
        return start

    def prefill_stops(self, start: int, end: int) -> list[int]:
        """Where the prefill of positions `start .. end - 1` pauses for a snapshot; the last entry is `end`."""
        if self.max_snapshots == 0:
            return [end]
        points = sorted({end - 1 - self.snapshot_margin, end - 1})
        return [p for p in points if start < p < end] + [end]

    def record(self, tokens: Sequence[int]) -> None:
        """The caches took `tokens` (in order) and are consistent again: reusable as they stand."""
        self._tokens.extend(tokens)
        self._consistent = True

    def claim(self, lease: int) -> None:
        """The generation holding `lease` is about to change the caches; it must still own them."""
        if lease != self._lease:
            raise RuntimeError(
                "another generation resumed this prompt cache since this one started; "
                "this generation cannot continue (use one prompt cache per concurrent generation)"
            )
        self._consistent = False

    def forget_past(self, output: Sequence[int]) -> None:
        """Hold nothing past the common prefix of the held tokens and `output` (a generation's prompt and
        emitted tokens, when its last round committed tokens past its stop). Exact, as `resume`: the
        live caches roll back when they reach, else the newest snapshot at or before it, else nothing
        (the next resume starts cold). Call it between rounds, with the step generator closed."""
        if not self._consistent:
            return
        length = common_prefix(self._tokens, output)
        if length == len(self._tokens):
            return
        speculative = bool(self._speculative) and self._followers is not None
        chains = self._followers or ()
        if self._live_reaches(length, speculative=speculative):
            self._rewind(length, None, speculative=speculative, chains=chains)
            return
        snapshot = next((s for s in reversed(self._snapshots) if s.position <= length), None)
        if snapshot is not None and (snapshot.draft is not None or not speculative):
            self._rewind(snapshot.position, snapshot, speculative=speculative, chains=chains)
        else:
            self._consistent = False

    def snapshot(self) -> None:
        """Keep the windowed state at the current position (the caches must be consistent)."""
        assert self._consistent, "snapshot of caches in the middle of an update"
        position = len(self._tokens)
        snap = Snapshot(position)
        kinds = getattr(self.target_cache, "kinds", None)  # a RollbackCaches: which layers cannot trim
        for i, cache in enumerate(self.target_cache):
            if kinds is not None and kinds[i] != TRIM:
                snap.target[i] = layer_state(cache, copy=True)  # rotating buffers are written in place later
        if self._speculative:  # a chain's drafter caches are full attention: trimmed to the position instead
            snap.draft = {i: ctx.snapshot() for i, ctx in enumerate(self.draft_context or []) if ctx.keep is not None}
        arrays = [a for s in (snap.target, snap.draft or {}) for state in s.values() for a in _state_arrays(state)]
        mx.eval(*arrays)  # the copies stand alone: the cache buffers they came from may be freed
        self._snapshots = [s for s in self._snapshots if s.position != position] + [snap]
        self._snapshots.sort(key=lambda s: s.position)
        del self._snapshots[: max(0, len(self._snapshots) - self.max_snapshots)]

    # -- internals -------------------------------------------------------------------------------

    def _held(self, proposer: Proposer) -> tuple[ChainContext, ...] | None:
        """The chains `proposer` drafts over when this cache holds all its state; None when it does not (a
        proposer built over chains of its own, or one not `resumable` beside no draft context)."""
        chains = tuple(proposer.chains)
        if self.draft_context is None and not proposer.resumable:
            return None
        if proposer.context is not self.draft_context:
            return None  # a block draft's context of its own (a cache made without the draft)
        if any(all(chain is not held for held in self.chains.values()) for chain in chains):
            return None
        return chains

    def _plan(self, prompt: Sequence[int], *, speculative: bool,
              chains: tuple[ChainContext, ...] | None) -> tuple[int, Snapshot | None]:  # fmt: skip
        """(start, snapshot to restore or None for the live caches); start 0 means a cold prefill."""
        if not self._consistent or speculative != self._speculative:
            return 0, None
        if speculative and (chains is None or self._followers is None or any(c not in self._followers for c in chains)):
            return 0, None  # the proposer's own state, or a chain that did not follow the latest generation
        # a chain resumes exactly up to its first entry whose next token changed (chain_context.py)
        limit = min(common_prefix(self._tokens, prompt), len(prompt) - 1, *(c.reach(prompt) for c in chains or ()))
        if limit <= 0:
            return 0, None
        if self._live_reaches(limit, speculative=speculative):
            return limit, None
        for snap in reversed(self._snapshots):
            if snap.position <= limit:
                return snap.position, snap
        return 0, None

    def _live_reaches(self, position: int, *, speculative: bool) -> bool:
        n = len(self._tokens) - position
        draft = self.draft_context if speculative else []
        if isinstance(self.target_cache, RollbackCaches) and n > self.target_cache.trimmable():
            return False  # a hybrid's recurrent state rewinds only within the latest forward
        return all(n <= c.trimmable() for c in draft or [])

    def _rewind(self, start: int, snapshot: Snapshot | None, *, speculative: bool, chains: Sequence[ChainContext] = (),
                prompt: Sequence[int] | None = None) -> None:  # fmt: skip
        n = len(self._tokens) - start
        if snapshot is None:
            trim_caches(self.target_cache, n)
        else:
            for i, cache in enumerate(self.target_cache):
                if i in snapshot.target:
                    restore_layer(cache, snapshot.target[i], copy=True)  # the snapshot stays reusable
                else:
                    cache.trim(n)  # a full layer: any amount
            if isinstance(self.target_cache, RollbackCaches):
                self.target_cache.begin_forward()  # the latest forward's record no longer matches the caches
        if speculative:
            for i, ctx in enumerate(self.draft_context or []):
                if snapshot is not None and i in (snapshot.draft or {}):
                    ctx.restore(snapshot.draft[i])
                else:
                    ctx.trim(n)
            for chain in chains:
                chain.rewind(start, prompt)
        del self._tokens[start:]
        self._snapshots = [s for s in self._snapshots if s.position <= start]

    def _reset(self) -> None:
        self.target_cache = self.target.make_cache(**self._cache_options)
        for ctx in self.draft_context or []:
            ctx.restore((None, None, 0))  # in place: the proposer holds this list
        self._tokens = []
        self._snapshots = []
