"""The proposer over a small causal LM of the target's vocabulary (models/heads/draft_lm: mlx-lm's
`--draft-model`): k chained steps per proposal over the draft's own caches, which hold committed tokens only.

The draft reads tokens, not target features (`tap_ids = ()`). Its state (`LMContext`) is the committed
sequence (`tokens`: prompt, then each round's commits) and how many of them its caches have read
(`entries`). A proposal for the anchor at `position` first catches up: the tokens the draft has not read
(the accepted drafts and the bonus of the last round, a parked run's tokens, a prompt) in one forward, the
anchor last, whose logits predict the first draft. Then k - 1 chained steps feed each draft back. The caches
are then taken back to the anchor (models/caches/snapshot's `cache_states` / `restore_caches`: trim, or a
hybrid's recurrent and rotating states restored), so only committed tokens ever stay: the rollback is exact for every cache kind,
and the next round catches up on what was accepted. That costs k draft forwards per k drafts, as mlx-lm's
own loop does (its first step feeds the bonus, or the last draft and the bonus).

A batch's rows draft together (`packs_chains`): each row catches up alone (`begin_chain`: its own count of
unread tokens), then every chain step is one forward of the draft for the rows still drafting
(`DraftLM.packed`: mlx-lm's model over (b, 1) with each row's attention over its own caches), where the
draft's probe passes (`chain_packing_problem`); each row's caches then go back to its anchor (`end_chain`).

Greedy drafting is argmax; sampled drafting draws from softmax(logits / T), the draft's own distribution q,
returned as `draft_probs`, so the round's residual acceptance (engine/round/accept.py) stays lossless.

A prompt cache holds the state (`chain_context("lm", make_cache, state=LMContext)`). Since the draft
catches up from tokens by itself, it never limits where the target resumes (`reach`): it keeps the entries
whose tokens are still the new prompt's (trimmed; a draft whose caches cannot trim back starts cold when
it must drop any) and reads the rest at its first proposal.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_dspark.engine.options import PREFILL_STEP_SIZE
from mlx_dspark.engine.proposers.base import CHAIN, Proposal, Proposer
from mlx_dspark.engine.proposers.chain import draw_chain
from mlx_dspark.engine.proposers.chain_context import ChainContext, common_prefix
from mlx_dspark.models.caches.snapshot import cache_states, restore_caches, trims_exactly

DEFAULT_CHAIN = 6  # the most drafts per proposal; `auto` picks fewer from the measured chain curve
COST_KIND = CHAIN


def default_block(draft: Any) -> int:
    return DEFAULT_CHAIN


def make_proposer(draft: Any, target: Any, *, prompt: Sequence[int], greedy: bool, temperature: float,
                  block_size: int | None = None, prompt_cache: Any = None) -> "LMProposer":  # fmt: skip
    context = None if prompt_cache is None else prompt_cache.chain_context("lm", draft.make_cache, state=LMContext)
    return LMProposer(draft, prompt=prompt, greedy=greedy, temperature=temperature,
                      block_size=block_size or DEFAULT_CHAIN, context=context)  # fmt: skip


class LMContext(ChainContext):
    """A draft LM's state: `tokens` (the committed sequence), `entries` (how many of them its caches read) and
    `last`, the logits (1, 1, V) after the newest entry. No features: `waiting` stays 0."""

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache)

    def reach(self, prompt: Sequence[int]) -> int:
        """Any position: the draft reads whatever it lacks from the tokens themselves."""
        return len(prompt)

    def rewind(self, start: int, prompt: Sequence[int] | None = None) -> None:
        """Keep the entries whose tokens are still `prompt`'s; `prompt` None (tokens forgotten past a stop):
        nothing to do, the entries say which tokens they read and the next resume compares them."""
        if prompt is None:
            return
        self.keep(min(self.entries, common_prefix(self.tokens, prompt)))
        self.tokens = [int(t) for t in prompt]

    def keep(self, entries: int) -> None:
        """Hold the first `entries` positions only: trimmed, or from empty where the caches cannot trim back."""
        if entries >= self.entries:
            return
        if entries and trims_exactly(self.cache):
            for c in self.cache:
                c.trim(c.offset - entries)
            self.entries = entries
        else:
            self.reset(self.tokens)
        self.last = None


class LMProposer(Proposer):
    cost_kind = CHAIN
    takes_logits_hook = True
    resumable = True  # its state is its LMContext: a prompt cache's when built over one
    packs_chains = True
    tap_ids = ()

    def __init__(self, draft: Any, *, prompt: Sequence[int], greedy: bool, temperature: float, block_size: int = DEFAULT_CHAIN,
                 context: LMContext | None = None, step_size: int = PREFILL_STEP_SIZE) -> None:  # fmt: skip
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 draft-model steps, got {block_size}")
        self.draft = self.module = draft
        self.greedy, self.temperature, self.block_size = greedy, temperature, int(block_size)
        self.state = LMContext(draft.make_cache, prompt) if context is None else context
        self.step_size = step_size
        self.catch_up_ms = 0.0
        self.marked: list | None = None  # the caches' states at the anchor while a chain runs

    @property
    def chains(self) -> tuple[LMContext, ...]:
        return (self.state,)

    def commit(self, tokens: Sequence[int]) -> None:
        self.state.tokens.extend(int(t) for t in tokens)

    def take_catch_up_ms(self) -> float:
        ms, self.catch_up_ms = self.catch_up_ms, 0.0
        return ms

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int, logits_hook: Callable | None = None) -> Proposal:
        """Up to `num_tokens` drafts for positions position+1 ..; anchor (1,) sits at `position`."""
        first = self.begin_chain(position=position)
        proposal = draw_chain(first, step=lambda tokens, logits, k: self.chain_step([self], tokens, logits, k),
                              logits=self.chain_logits, num_tokens=num_tokens, greedy=self.greedy,
                              temperature=self.temperature, logits_hook=logits_hook)  # fmt: skip
        self.end_chain()
        return proposal

    def begin_chain(self, *, position: int) -> mx.array:
        """The caches read the committed tokens up to the anchor at `position` (marked there); its logits (1, 1, V)."""
        state = self.state
        assert len(state.tokens) > position, (len(state.tokens), position)
        first = self._catch_up(position + 1)
        self.marked = cache_states(state.cache)
        return first

    def end_chain(self) -> None:
        restore_caches(self.state.cache, self.marked, copy=False)  # the chained steps were speculative: back to the anchor
        self.marked = None

    def chain_packing_problem(self) -> str | None:
        return self.draft.packing_problem()

    def chain_step(self, rows: Sequence[Proposer], tokens: mx.array, outputs: mx.array, k: int) -> mx.array:
        """The logits (b, 1, V) after the drafts just taken (b, 1), each row over its own caches."""
        if len(rows) == 1:
            return self.draft(tokens, rows[0].state.cache)[:, -1:]
        return self.draft.packed(tokens, [r.state.cache for r in rows])

    def chain_logits(self, outputs: mx.array, k: int) -> mx.array:
        return outputs  # a draft model's outputs are its logits

    def _catch_up(self, end: int) -> mx.array:
        """The caches read tokens[:end]; returns the logits (1, 1, V) after the last. What a round adds (its
        accepted drafts and bonus) runs in the proposal's graph; a longer run (a prompt, a parked stretch)
        first, evaluated and timed apart (`take_catch_up_ms`), in chunks of `step_size`."""
        state = self.state
        if state.entries > end or (state.entries == end and state.last is None):
            state.keep(end - 1)  # its logits are gone: read the last token again
        if state.entries == end:
            return state.last
        tail = self.block_size + 1
        if end - state.entries > tail:
            start = time.perf_counter()
            while end - state.entries > tail:
                n = min(self.step_size, end - state.entries - tail)
                self._read(state.tokens[state.entries : state.entries + n])
                mx.eval([a for _, a in tree_flatten([c.state for c in state.cache]) if isinstance(a, mx.array)])
            self.catch_up_ms += 1000 * (time.perf_counter() - start)
        return self._read(state.tokens[state.entries : end])

    def _read(self, tokens: Sequence[int]) -> mx.array:
        state = self.state
        logits = self.draft(mx.array(tokens, dtype=mx.int32)[None], state.cache)[:, -1:]
        state.entries += len(tokens)
        state.last = logits
        return logits
