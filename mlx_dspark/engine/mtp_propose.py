"""The proposer over a target's own MTP layers (models/mtp_qwen3_5.py, models/mtp_deepseek.py), behind the
`propose.Proposer` protocol.

Entry t of the MTP cache pairs the target's final hidden state at t with the token at t + 1, so an entry
goes in once that token is committed: the round's features (the final hidden states, tap `FINAL_TAP`)
wait in `_hidden` until `commit` has given the next tokens. A proposal runs the waiting entries in one
MTP forward (its last output predicts the first draft), then chains: each further step feeds the MTP's
own output and the embedding of the draft it just proposed back through the layer (vLLM's and mlx-vlm's
chaining). The MTP module says what its output is (Qwen: normed; DeepSeek / GLM: pre-norm), which
embedding and head it reads (`embed`, `logits`) and which layer step k runs (`step=`). The chained
entries are speculative: the cache is trimmed back to the committed entries right after the proposal,
and the next round writes those positions again from the target's states.

Sampled drafting draws from softmax(logits / T) and returns those distributions (`draft_probs`), so the
round's acceptance (engine/accept.py) stays lossless; greedy drafting is argmax (one-hot).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx

from mlx_dspark.engine.propose import PENDING_LIMIT, Proposal
from mlx_dspark.models.base import FINAL_TAP

DEFAULT_CHAIN = 4  # the most MTP steps per proposal (acceptance falls fast with depth: DRAFTERS.md section 2)


class MTPProposer:
    takes_logits_hook = True

    def __init__(self, mtp: Any, target: Any, *, prompt: Sequence[int], greedy: bool, temperature: float,
                 block_size: int = DEFAULT_CHAIN) -> None:
        """`prompt`: the tokens the prefill will give features for (their next tokens pair with them)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 MTP steps, got {block_size}")
        self.mtp, self.target = mtp, target
        self.greedy, self.temperature = greedy, temperature
        self.tap_ids = (FINAL_TAP,)
        self.block_size = int(block_size)
        self.cache = mtp.make_cache()
        self.tokens: list[int] = [int(t) for t in prompt]  # the committed sequence (prompt, then rounds)
        self.entries = 0  # positions in the MTP cache
        self._hidden: list[mx.array] = []  # (1, n, C) final states of positions entries .. entries + waiting - 1
        self._waiting = 0
        self._last: mx.array | None = None  # (1, 1, C): the MTP output of the newest entry

    def extend(self, features: mx.array) -> None:
        self._hidden.append(features)
        self._waiting += features.shape[1]
        if self._waiting >= PENDING_LIMIT:
            self.flush()

    extend_later = extend  # a parked round: the entries wait as any others

    def commit(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def flush(self) -> None:
        """Run the waiting entries whose next token is committed through the MTP (one forward)."""
        ready = min(self._waiting, len(self.tokens) - 1 - self.entries)
        if ready <= 0:
            return
        hidden = mx.concatenate(self._hidden, axis=1) if len(self._hidden) > 1 else self._hidden[0]
        rest = hidden[:, ready:]
        self._hidden, self._waiting = ([rest] if rest.shape[1] else []), self._waiting - ready
        nxt = mx.array(self.tokens[self.entries + 1 : self.entries + 1 + ready], dtype=mx.int32)[None]
        out = self.mtp(self.mtp.embed(nxt, self.target), hidden[:, :ready], self.cache)  # (1, ready, C)
        self.entries += ready
        self._last = out[:, -1:]
        mx.async_eval(self._last, *(a for c in self.cache for a in (c.keys, c.values) if a is not None))

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int, logits_hook: Callable | None = None) -> Proposal:
        """Up to `num_tokens` chained MTP drafts for positions position+1 ..; anchor (1,) sits at `position`."""
        self.flush()
        assert self.entries == position and self._last is not None, (self.entries, position)
        h = self._last
        tokens: list[mx.array] = []
        token_probs: list[mx.array] = []
        draft_probs: list[mx.array] = []
        for k in range(num_tokens):
            if k:
                h = self.mtp(self.mtp.embed(tokens[-1][:, None], self.target), h, self.cache, step=k)  # a speculative entry
            logits = self.mtp.logits(h, self.target, step=k)[:, -1].astype(mx.float32)  # (1, V)
            if logits_hook is not None:
                logits = logits_hook(logits, tokens)
                if logits is None:  # the hook ends the proposal here
                    break
            if self.greedy:
                token = mx.argmax(logits, axis=-1)
            else:
                scaled = logits * (1.0 / self.temperature)
                token = mx.random.categorical(scaled)
                draft_probs.append(mx.softmax(scaled, axis=-1))
            token_probs.append(mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1)))
            tokens.append(token.astype(mx.int32))
        for c in self.cache:
            c.trim(c.offset - self.entries)  # back to the committed entries (offsets only: the graph keeps its values)
        if not tokens:
            empty = mx.zeros((1, 0), mx.int32)
            return Proposal(tokens=empty, token_probs=empty.astype(mx.float32))
        return Proposal(
            tokens=mx.stack(tokens, axis=1),
            draft_probs=None if self.greedy else mx.stack(draft_probs, axis=1),
            token_probs=mx.stack(token_probs, axis=1),
        )
