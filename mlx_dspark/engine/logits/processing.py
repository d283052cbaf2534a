"""What happens to the logits between the model and the sampler: penalties, logit_bias, the grammar mask.

All three depend on the history: the committed tokens, and inside a round the draft prefix. Verify
row j of `[anchor, x1..xl]` sees history + x(1..j); draft position k sees history + x(1..k-1). One
`LogitsProcessor` per request computes the processed logits of any such rows, for plain decoding (one
row per step) and for the speculative round (the verify rows and, through `draft_hook`, each draft
position) alike, so greedy speculative output equals plain greedy output and sampled acceptance sees
exactly the processed distributions.

Order (mlx-lm's): logit_bias, repetition_penalty, presence/frequency penalties, then the grammar mask.
Penalties count the last `penalty_last_n` tokens of the sequence, prompt included (llama-server's
rule); repetition_penalty divides a positive logit (multiplies a negative one) of every token present.
Penalties and bias are device work inside the lazy graph. The grammar mask is host work: the verify
masks are computed after the verify forward is launched, so they overlap it; masked drafting costs one
host read per draft position (the next draft position's mask needs the drawn token), except inside the
grammar's forced run (`GrammarState.forced`), where the only legal token is drawn without a read.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from mlx_dspark.engine.logits import logprobs as logprobs_mod
from mlx_dspark.engine.logits.grammar import GrammarState, allow_only, apply_masks
from mlx_dspark.engine.policy.mask_choice import MaskChoice
from mlx_dspark.engine.options import OptionError, SamplingOptions

# (logits (B, V) of draft position k, the drawn draft tokens x(1..k-1) as (B,) arrays) -> processed
# logits, or None to end the proposal before position k (the grammar has ended)
DraftHook = Callable[[mx.array, list], "mx.array | None"]


class LogitsProcessor:
    def __init__(
        self,
        *,
        vocab_size: int,
        history: Sequence[int],
        sampling: SamplingOptions | None = None,
        grammar: GrammarState | None = None,
        mask_draft: bool | str = True,
        logprobs: int | None = None,
    ) -> None:
        """`history`: the prompt; `logprobs`: None or how many top alternatives each token reports;
        `mask_draft`: True, False or "auto" (mask_choice.py: per round, the faster of the two)."""
        self.vocab_size = vocab_size
        self.history = list(history)
        self.grammar = grammar
        self.mask_choice = MaskChoice() if mask_draft == "auto" and grammar is not None else None
        self._mask_draft = bool(mask_draft)
        self.logprobs = logprobs
        self.bias = None
        self.penalties = None
        if sampling is not None and sampling.logit_bias:
            ids = [t for t, _ in sampling.logit_bias]
            if max(ids) >= vocab_size:
                raise OptionError("logit_bias", dict(sampling.logit_bias), f"token ids below the vocabulary size {vocab_size}")
            bias = np.zeros((vocab_size,), np.float32)
            bias[ids] = [b for _, b in sampling.logit_bias]
            self.bias = mx.array(bias)
        if sampling is not None and sampling.has_penalties:
            self.penalties = sampling
        self.changes_logits = self.bias is not None or self.penalties is not None or grammar is not None

    @property
    def mask_draft(self) -> bool:
        """Whether this round's draft is masked (fixed between the round's proposal and its commit)."""
        return self._mask_draft if self.mask_choice is None else self.mask_choice.masked

    @classmethod
    def passthrough(cls) -> "LogitsProcessor":
        """Changes nothing and reports no logprobs (the loops' default)."""
        return cls(vocab_size=0, history=())

    # -- the target's rows ---------------------------------------------------------------------------

    def target_logits(self, logits: mx.array, pending: mx.array) -> mx.array:
        """Processed rows (n, V): row j's context is the history + pending[: m - n + 1 + j], m = len(pending).

        Verify: n = l + 1 rows over the l draft tokens; plain decoding: one row after the token just drawn.
        """
        if not self.changes_logits:
            return logits
        n = logits.shape[0]
        out = self._device_rows(logits, pending, n)
        if self.grammar is not None:
            # Read the pending tokens first (they precede the forward anyway), then launch the forward
            # and compute the masks while it runs: a read after the launch would wait for the forward.
            pending_ids = pending.tolist()
            mx.async_eval(out)
            start = len(pending_ids) - n + 1
            if start == 0:  # verify rows: every prefix of the draft (those drafting computed are reused)
                masks = self.grammar.masks(pending_ids)
            else:
                masks = np.stack([self.grammar.mask(pending_ids[: start + j]) for j in range(n)])
            out = apply_masks(out, masks)
        return out

    def _device_rows(self, logits: mx.array, pending: mx.array, n: int) -> mx.array:
        logits = logits.astype(mx.float32)
        if self.bias is not None:
            logits = logits + self.bias
        if self.penalties is not None:
            logits = self._penalize(logits, pending, n)
        return logits

    def _penalize(self, logits: mx.array, pending: mx.array, n: int) -> mx.array:
        options = self.penalties
        last_n = options.penalty_last_n
        tail = self.history[-last_n:]
        sequence = mx.concatenate([mx.array(tail, dtype=mx.int32), pending.reshape(-1).astype(mx.int32)])
        ends = len(tail) + pending.size - n + 1 + np.arange(n)  # context length of each row
        index = ends[:, None] - last_n + np.arange(last_n)[None]  # (n, last_n) the window's positions
        inside = index >= 0
        tokens = sequence[mx.array(np.maximum(index, 0))]  # (n, last_n)
        rows = mx.broadcast_to(mx.arange(n)[:, None], tokens.shape)
        counts = mx.zeros((n, logits.shape[-1]), mx.float32).at[rows, tokens].add(mx.array(inside, mx.float32))
        present = counts > 0
        if options.repetition_penalty != 1.0:
            penalty = options.repetition_penalty
            logits = mx.where(present, mx.where(logits < 0, logits * penalty, logits / penalty), logits)
        if options.presence_penalty != 0.0:
            logits = logits - options.presence_penalty * present.astype(mx.float32)
        if options.frequency_penalty != 0.0:
            logits = logits - options.frequency_penalty * counts
        return logits

    # -- the draft's positions -----------------------------------------------------------------------

    def draft_hook(self) -> DraftHook | None:
        """The draft's processing (None when nothing changes logits): penalties, bias, and the mask if masking."""
        if not self.changes_logits:
            return None
        drawn: list[int] = []  # host copies of this proposal's draft tokens so far (masked drafting only)
        forced: list[int] = []  # the grammar's forced run this round: drawn without a host read

        def hook(logits: mx.array, drafted: list) -> mx.array | None:
            pending = mx.concatenate([t.reshape(-1) for t in drafted]) if drafted else mx.zeros((0,), mx.int32)
            out = self._device_rows(logits, pending, logits.shape[0])
            if self.grammar is None or not self.mask_draft:
                return out
            if not drafted:
                drawn.clear()  # a new proposal
                # a grammar that cannot tell its forced run (a test's stand-in) forces nothing
                forced[:] = self.grammar.forced() if hasattr(self.grammar, "forced") else []
            elif len(drafted) <= len(forced):
                drawn.append(forced[len(drafted) - 1])  # allowed alone at its position: no read needed
            else:
                drawn.append(int(drafted[-1].item()))  # the host read per unforced draft position
                if drawn[-1] in self.grammar.eos_ids:
                    return None
            if len(drawn) < len(forced):
                return allow_only(out, forced[len(drawn)])
            if self.grammar.ends_after(drawn):
                return None  # only an end-of-sequence token can follow: the target's bonus gives it
            return apply_masks(out, self.grammar.mask(drawn)[None])

        return hook

    def admit(self, tokens: mx.array, draft_probs: mx.array | None, *, hooked: bool) -> tuple[mx.array, mx.array | None]:
        """Cut a draft (l,) the grammar did not mask (`hooked`: it took `draft_hook`) before its first
        forbidden token (one host read).

        Such a token would be rejected for certain; with sampled drafting its draft distribution row is
        kept (draft_probs gets l' + 1 rows) so the bonus is drawn from the same residual as if it had been
        verified and rejected: the cut stays lossless.
        """
        if self.grammar is None or (hooked and self.mask_draft) or tokens.shape[0] == 0:
            return tokens, draft_probs
        valid = self.grammar.valid_prefix(tokens.tolist())
        if valid == tokens.shape[0]:
            return tokens, draft_probs
        return tokens[:valid], None if draft_probs is None else draft_probs[: valid + 1]

    # -- after the round ------------------------------------------------------------------------------

    def commit(self, tokens: Sequence[int]) -> None:
        if self.penalties is not None:
            self.history.extend(tokens)
            del self.history[: -self.penalties.penalty_last_n]
        if self.grammar is not None:
            self.grammar.commit(tokens)
        if self.mask_choice is not None:
            self.mask_choice.observe(len(tokens))

    def logprob_arrays(self, processed: mx.array, tokens: mx.array) -> tuple[mx.array, ...]:
        """Lazy logprob arrays of `tokens` under the processed rows; () when logprobs are off."""
        if self.logprobs is None:
            return ()
        return logprobs_mod.logprob_arrays(processed, tokens, self.logprobs)

    def read_logprobs(self, arrays: tuple[mx.array, ...], tokens: list[int]) -> list | None:
        return logprobs_mod.read(arrays, tokens) if arrays else None
