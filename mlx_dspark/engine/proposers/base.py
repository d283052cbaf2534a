"""The one interface every draft head implements, and what a proposal is.

A round asks a proposer for a block of drafts and tells it what was committed; everything else a proposer
can do is *declared* here with its default, so the round, the batch, the prompt cache and the policies read
a declaration instead of probing for attributes. A head overrides what it does differently:

- what it reads: `tap_ids` (the target layers whose features `extend` receives; `()` reads none),
  `takes_target_cache` (the round passes `target_cache=`, the target's rolled-back caches), `takes_logits_hook`
  (the round passes `logits_hook=`: penalties, bias, grammar mask at its draft positions);
- how it keeps and rewinds its state: `extend` / `extend_later` / `flush` (features of committed positions),
  `commit` (the committed tokens), `start_at` (where a prompt cache resumed), `context` and `chains` (state a
  prompt cache holds), `resumable` (that state is a prompt cache's);
- its cost: `cost_kind` ("block": one draft forward per proposal; "chain": one forward per draft token);
- its abilities: `grows_trees` (`tree_children`), `takes_room` / `wants_round` (a proposer that sizes its own
  blocks), `round_estimate`, `packs_chains` (a batch runs its rows' chain steps as one packed forward each:
  `chain_packing_problem`, `begin_chain`, `chain_step`, `chain_logits`, `end_chain`; engine/batch/chains.py).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx

from mlx_dspark.models.heads.proposal import Proposal  # noqa: F401  (the round's proposals; re-exported)

BLOCK, CHAIN = "block", "chain"  # cost kinds: one draft forward per proposal, or one per draft token


class Proposer:
    """What the speculative round needs from any head; subclasses override what they do differently."""

    tap_ids: Sequence[int] = ()  # target layers whose features `extend` takes
    block_size: int = 0  # the most draft tokens one proposal can hold
    cost_kind: str = BLOCK
    takes_logits_hook: bool = False
    takes_target_cache: bool = False
    takes_room: bool = False  # propose(room=): the most tokens a block may hold (a proposer that sizes its blocks)
    resumable: bool = False  # its state is a prompt cache's (its `context` / `chains`, or none of its own)
    grows_trees: bool = False  # tree_children(anchor, position=, depth=) gives a token tree's distributions
    context: Any = None  # a block draft's context cache (a prompt cache holds it)
    chains: tuple = ()  # chain_context.ChainContexts it drafts over (a prompt cache holds them)
    grammar: Any = None  # a forced-run grammar the proposer reads (proposal_choice.Chooser)
    packs_chains: bool = False  # a batch drafts its rows' chains together through the `chain_*` methods below

    def extend(self, features: mx.array) -> None:
        """Take the target features (1, n, F) of the next n committed positions."""

    def extend_later(self, features: mx.array) -> None:
        """A parked round's committed positions: by default taken at once."""
        self.extend(features)

    def flush(self) -> None:
        """Put features that wait (`extend_later`) into the head's state."""

    def commit(self, tokens: Sequence[int]) -> None:
        """Each round's committed tokens (the prefill's token first)."""

    def start_at(self, position: int) -> None:
        """A prompt cache resumed the target's caches at `position`."""

    def take_catch_up_ms(self) -> float:
        """Time spent since the last call on one-off catch-ups, not charged to the draft's cost."""
        return 0.0

    def wants_round(self, *, room: int) -> bool:
        """Whether a parked round should still ask this proposer (one that sizes its own blocks)."""
        return self.takes_room and room > 0

    def revise(self, proposal: Proposal, *, position: int, num_tokens: int) -> Proposal:
        """What a batched round verifies for this row, given what the batch's packed draft proposed."""
        return proposal

    def round_estimate(self, length: int) -> Any:
        """(expected tokens, cost ms) of a `length`-draft round where the head knows them; None: unknown."""
        return None

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int, **round_inputs: Any) -> Proposal:
        """Draft tokens for positions position+1 .. position+num_tokens; anchor (1,) sits at `position`.
        `round_inputs`: `logits_hook=`, `target_cache=`, `room=`, as the proposer declares it takes them."""
        raise NotImplementedError

    def tree_children(self, anchor: mx.array, *, position: int, depth: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} grows no trees")

    # A chained head whose batched rows draft together (`packs_chains`): engine/batch/chains.py starts each
    # row's chain alone, runs every step k as ONE packed drafter forward for the rows still drafting and one
    # head call, then ends each row's chain.

    def chain_packing_problem(self) -> str | None:
        """Why this head's rows cannot take their chain steps packed (its drafter's probe, run once), or None."""
        return f"{type(self).__name__} drafts each row by itself"

    def begin_chain(self, *, position: int) -> mx.array:
        """Start this row's chain, alone: what its state has not read yet read (waiting entries, unread
        tokens); the output (1, 1, C) that predicts the first draft after the anchor at `position`."""
        raise NotImplementedError(f"{type(self).__name__} packs no chains")

    def chain_step(self, rows: Sequence["Proposer"], tokens: mx.array, outputs: mx.array, k: int) -> mx.array:
        """Chain step k of `rows` (this head's proposers, each over its own state) as one forward: the drafts
        just taken (b, 1), the previous outputs (b, 1, C) -> the next (b, 1, C)."""
        raise NotImplementedError(f"{type(self).__name__} packs no chains")

    def chain_logits(self, outputs: mx.array, k: int) -> mx.array:
        """Step k's outputs (b, 1, C) -> logits over the target's vocabulary (b, 1, V)."""
        raise NotImplementedError(f"{type(self).__name__} packs no chains")

    def end_chain(self) -> None:
        """This row's state back to its committed entries (the chained ones were speculative)."""
        raise NotImplementedError(f"{type(self).__name__} packs no chains")


def round_inputs(proposer: Proposer, *, logits_hook: Callable | None = None, target_cache: Any = None) -> dict:
    """The keyword arguments a round passes to `proposer.propose`, as it declares them."""
    extra: dict = {}
    if logits_hook is not None and proposer.takes_logits_hook:
        extra["logits_hook"] = logits_hook
    if target_cache is not None and proposer.takes_target_cache:
        extra["target_cache"] = target_cache
    return extra
