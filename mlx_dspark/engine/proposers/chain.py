"""What the autoregressive drafters share (chained heads over a cache of their own): one small layer
over its own KV cache, chained k steps per proposal, behind the `propose.Proposer` protocol.

Entry t of the drafter's cache pairs the target's features at position t with the token at t + 1, so an
entry goes in once that token is committed: the round's features wait (`features`) until `commit` has
given the next tokens. A proposal runs the waiting entries in one forward (`_entries`; its last output
predicts the first draft), then chains: each further step (`_step`) feeds the drafter's own output and
the embedding of the draft it just proposed back through the layer (vLLM's and mlx-vlm's chaining). The
chained entries are speculative: the cache is trimmed back to the committed entries right after the
proposal, and the next round writes those positions again from the target's states.

Sampled drafting draws from softmax(logits / T) over the target's vocabulary and returns those
distributions (`draft_probs`), so the round's acceptance (engine/round/accept.py) stays lossless; greedy
drafting is argmax (one-hot). A subclass gives `tap_ids`, `_entries`, `_step` and `_logits`, and its drafter's
`make_cache`.

The state (the drafter's cache, the entries, the committed tokens, the waiting features) is a
chain_context.ChainContext: the proposer's own, or a prompt cache's (`context=prompt_cache.chain_context(name,
make_cache)`), which the prompt cache's `resume` rewinds to the prompt's reusable prefix (`resumable`).
A batch packs its rows' chain steps (`packs_chains`: `begin_chain` flushes, `chain_step` runs the drafter's
step for all rows at once, models/packed/chain.py, where `chain_packing_problem`'s probe passes).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx

from mlx_dspark.engine.proposers.chain_context import ChainContext
from mlx_dspark.engine.proposers.base import CHAIN, Proposal, Proposer
from mlx_dspark.engine.proposers.dspark import PENDING_LIMIT
from mlx_dspark.models.packed import chain as packed_chain


class ChainProposer(Proposer):
    cost_kind = CHAIN
    takes_logits_hook = True
    resumable = True  # its state is its ChainContext: a prompt cache's when built over one
    packs_chains = True
    tap_ids: tuple[int, ...]
    module: Any  # the drafter a batch's packed chain step runs (models/packed/chain.py), with its `make_cache`
    target: Any

    def __init__(self, *, prompt: Sequence[int], greedy: bool, temperature: float, block_size: int, what: str,
                 make_cache: Callable[[], list], context: ChainContext | None = None) -> None:  # fmt: skip
        """`prompt`: the tokens the prefill will give features for (their next tokens pair with them).
        `context`: a prompt cache's ChainContext (its `resume` sets it up for `prompt`); default a new one."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 {what} steps, got {block_size}")
        self.greedy, self.temperature = greedy, temperature
        self.block_size = int(block_size)
        self.chain = ChainContext(make_cache, prompt) if context is None else context

    @property
    def chains(self) -> tuple[ChainContext, ...]:
        return (self.chain,)

    @property
    def cache(self) -> list:
        return self.chain.cache

    @property
    def tokens(self) -> list[int]:
        """The committed sequence (prompt, then rounds)."""
        return self.chain.tokens

    @property
    def entries(self) -> int:
        return self.chain.entries

    def _entries(self, next_ids: mx.array, features: mx.array) -> mx.array:
        """Committed entries: tokens (1, n) at t + 1, the target's features (1, n, F) at t -> outputs (1, n, C)."""
        raise NotImplementedError

    def _step(self, token_ids: mx.array, hidden: mx.array, step: int = 0, cache: list | None = None) -> mx.array:
        """One chained (speculative) entry, the proposal's `step`-th: the draft just proposed (1, 1), the
        previous output (1, 1, C). `cache`: another cache list than `self.cache` (a batch's packed step,
        engine/batch/chains.py: rows (b, 1) over the rows' own caches)."""
        raise NotImplementedError

    def _logits(self, hidden: mx.array, step: int = 0) -> mx.array:
        """Outputs (1, 1, C) of the proposal's `step`-th step -> logits over the target's vocabulary (1, 1, V)."""
        raise NotImplementedError

    def extend(self, features: mx.array) -> None:
        chain = self.chain
        chain.features.append(features)
        chain.waiting += features.shape[1]
        if chain.waiting >= PENDING_LIMIT:
            self.flush()

    extend_later = extend  # a parked round: the entries wait as any others

    def commit(self, tokens: Sequence[int]) -> None:
        self.chain.tokens.extend(int(t) for t in tokens)

    def flush(self) -> None:
        """Run the waiting entries whose next token is committed through the drafter (one forward)."""
        chain = self.chain
        ready = min(chain.waiting, len(chain.tokens) - 1 - chain.entries)
        if ready <= 0:
            return
        features = mx.concatenate(chain.features, axis=1) if len(chain.features) > 1 else chain.features[0]
        rest = features[:, ready:]
        chain.features, chain.waiting = ([rest] if rest.shape[1] else []), chain.waiting - ready
        nxt = mx.array(chain.tokens[chain.entries + 1 : chain.entries + 1 + ready], dtype=mx.int32)[None]
        out = self._entries(nxt, features[:, :ready])  # (1, ready, C)
        chain.entries += ready
        # the newest entry's features, in a buffer of their own (a slice would keep the whole chunk alive)
        chain.last, chain.last_features = out[:, -1:], mx.contiguous(features[:, ready - 1 : ready])
        mx.async_eval(chain.last, chain.last_features, *(a for c in chain.cache for a in (c.keys, c.values) if a is not None))

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int, logits_hook: Callable | None = None) -> Proposal:
        """Up to `num_tokens` chained drafts for positions position+1 ..; anchor (1,) sits at `position`."""
        first = self.begin_chain(position=position)
        proposal = draw_chain(first, step=lambda tokens, h, k: self._step(tokens, h, step=k),
                              logits=lambda h, k: self._logits(h, step=k), num_tokens=num_tokens, greedy=self.greedy,
                              temperature=self.temperature, logits_hook=logits_hook)  # fmt: skip
        self.end_chain()
        return proposal

    def begin_chain(self, *, position: int) -> mx.array:
        self.flush()
        assert self.entries == position and self.chain.last is not None, (self.entries, position)
        return self.chain.last

    def end_chain(self) -> None:
        self.chain.drop_speculative()  # the graph keeps the chained entries' values

    def chain_packing_problem(self) -> str | None:
        self.flush()
        if self.chain.last is None:
            return "no committed entry yet"
        return packed_chain.chain_packing_problem(
            self.module, lambda ids, hidden, caches: self._step(ids, hidden, step=1, cache=caches),
            width=self.chain.last.shape[-1], vocab=self.target.args.vocab_size, make_cache=self.module.make_cache,
        )  # fmt: skip

    def chain_step(self, rows: Sequence[Proposer], tokens: mx.array, outputs: mx.array, k: int) -> mx.array:
        if len(rows) == 1:
            return rows[0]._step(tokens, outputs, step=k)
        return packed_chain.packed_chain_step(
            self.module, lambda caches: self._step(tokens, outputs, step=k, cache=caches), [p.cache for p in rows],
            make_cache=self.module.make_cache,
        )  # fmt: skip

    def chain_logits(self, outputs: mx.array, k: int) -> mx.array:
        return self._logits(outputs, step=k)


def draw_chain(first: mx.array, *, step: Callable, logits: Callable, num_tokens: int, greedy: bool, temperature: float,
               logits_hook: Callable | None = None) -> Proposal:
    """Up to `num_tokens` drafts of a chained drafter: `first` (1, 1, C) is its output that predicts the first
    draft, `step(token_ids (1, 1), output, k)` its next output from the draft just taken, `logits(output, k)` the
    k-th step's logits over the target's vocabulary (1, 1, V). Greedy: argmax; sampled: a draw from
    softmax(logits / T), whose distributions come back as `draft_probs`. `logits_hook` (the round's penalties,
    bias, grammar mask) processes each step's logits; None from it ends the chain there."""
    h = first
    tokens: list[mx.array] = []
    token_probs: list[mx.array] = []
    draft_probs: list[mx.array] = []
    for k in range(num_tokens):
        if k:
            h = step(tokens[-1][:, None], h, k)
        row = logits(h, k)[:, -1].astype(mx.float32)  # (1, V)
        if logits_hook is not None:
            row = logits_hook(row, tokens)
            if row is None:  # the hook ends the proposal here
                break
        draw_token(row, tokens, token_probs, draft_probs, greedy=greedy, temperature=temperature)
    return chain_proposal(tokens, token_probs, draft_probs, greedy=greedy)


def draw_token(row: mx.array, tokens: list, token_probs: list, draft_probs: list, *, greedy: bool, temperature: float,
               key: mx.array | None = None) -> None:
    """One chain step's draft from its (processed) logits row (1, V), appended to the lists: argmax, or a
    draw from softmax(row / T) (from `key` when given) whose distribution goes to `draft_probs`."""
    if greedy:
        token = mx.argmax(row, axis=-1)
    else:
        scaled = row * (1.0 / temperature)
        token = mx.random.categorical(scaled, key=key)
        draft_probs.append(mx.softmax(scaled, axis=-1))
    token_probs.append(mx.exp(mx.max(row, axis=-1) - mx.logsumexp(row, axis=-1)))
    tokens.append(token.astype(mx.int32))


def chain_proposal(tokens: list, token_probs: list, draft_probs: list, *, greedy: bool) -> Proposal:
    """The Proposal of a chain's drafts (1,) each, in order (none: an empty proposal)."""
    if not tokens:
        empty = mx.zeros((1, 0), mx.int32)
        return Proposal(tokens=empty, token_probs=empty.astype(mx.float32))
    return Proposal(
        tokens=mx.stack(tokens, axis=1),
        draft_probs=None if greedy else mx.stack(draft_probs, axis=1),
        token_probs=mx.stack(token_probs, axis=1),
    )
