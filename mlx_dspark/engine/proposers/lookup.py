"""Lookup drafts: propose what followed the last tokens earlier in the context (prompt lookup).

Agents re-emit long runs of their prompt (a file being edited, a diff being applied, a JSON record
being copied) and of their own output. `ContextIndex` holds the context (prompt + committed tokens)
and, for each n-gram length in `ngram_sizes`, where every n-gram ended. A proposal matches the longest
suffix of the context (plus any tokens already fixed this round, e.g. a grammar's forced run) that
occurred before, at its most recent earlier occurrence, and continues with the tokens that followed
it: an overlapping copy (LZ77-style), so a repeating pattern continues past the end of the context.

A lookup proposal is deterministic (one-hot draft distributions, `draft_probs=None`): the standard
acceptance rule stays lossless under sampling. `LookupProposer` is the same index behind the
`propose.Proposer` protocol, for rounds that use lookup alone (a target without a draft).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from mlx_dspark.engine.proposers.base import Proposal, Proposer

# Measured on benchmarks/workloads (RESULTS.md section 13): the longest indexed n-gram picks the copy
# site (its most recent occurrence), the backward extension gives the match length; 1-grams propose too
# often beside a draft, so the shortest match that proposes is a 2-gram.
DEFAULT_NGRAM_SIZES = (8, 4, 2)
LOOKUP_MAX_TOKENS = 32  # the most tokens one lookup proposal holds (the verify width is one more)


MATCH_BUCKETS = (2, 3, 4, 8, 16)  # a match's length is reported as the largest of these it reaches


@dataclass(frozen=True)
class Match:
    tokens: list[int]  # the continuation
    length: int  # how many tokens before it match (the n-gram, extended backwards; a MATCH_BUCKETS value, 0: none)


class ContextIndex:
    def __init__(self, context: Sequence[int] = (), *, ngram_sizes: Sequence[int] = DEFAULT_NGRAM_SIZES) -> None:
        sizes = tuple(sorted({int(n) for n in ngram_sizes}, reverse=True))
        if not sizes or sizes[-1] < 1:
            raise ValueError(f"ngram_sizes must be integers >= 1, got {tuple(ngram_sizes)}")
        self.sizes = sizes
        self.tokens: list[int] = []
        # n-gram -> end positions (the index of its last token), ascending
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(context)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens to the context and index the n-grams that end in them."""
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens) - 1
            for n in self.sizes:
                if end + 1 >= n:
                    self._ends.setdefault(tuple(self.tokens[end + 1 - n :]), []).append(end)

    def continuation(self, pending: Sequence[int] = (), *, max_tokens: int) -> Match:
        """What followed the longest matched suffix of context + `pending`, up to `max_tokens` tokens.

        `pending` (tokens fixed this round, not committed) takes part in the match and the copy but is
        not indexed.
        """
        if max_tokens <= 0:
            return Match([], 0)
        # context + pending without copying the context (asked every parked step: a copy costs O(context))
        tokens, pending = self.tokens, [int(t) for t in pending]
        size = len(tokens) + len(pending)

        def at(i: int) -> int:
            return tokens[i] if i < len(tokens) else pending[i - len(tokens)]

        last = size - 1
        for n in self.sizes:
            if size <= n:
                continue
            suffix = tuple(tokens[last + 1 - n :]) if not pending else tuple(at(i) for i in range(last + 1 - n, size))
            ends = self._ends.get(suffix)
            if not ends:
                continue
            # the most recent occurrence that ends before the suffix itself
            end = ends[-1] if ends[-1] < last else (ends[-2] if len(ends) > 1 else None)
            if end is None:
                continue
            length = n  # a longer match (the same tokens further back) predicts a longer copy
            while length < MATCH_BUCKETS[-1] and end - length >= 0 and at(end - length) == at(last - length):
                length += 1
            out: list[int] = []
            for i in range(end + 1, end + 1 + max_tokens):
                out.append(at(i) if i < size else out[i - size])  # the copy may overlap its own output: a repeat goes on
            return Match(out, max([b for b in MATCH_BUCKETS if b <= length] or [length]))
        return Match([], 0)


class LookupProposer(Proposer):
    """Lookup alone behind the Proposer protocol: no target features, no draft forward."""

    tap_ids: tuple[int, ...] = ()
    takes_logits_hook = False

    def __init__(self, context: Sequence[int], *, max_tokens: int = LOOKUP_MAX_TOKENS,
                 ngram_sizes: Sequence[int] = DEFAULT_NGRAM_SIZES) -> None:
        self.index = ContextIndex(context, ngram_sizes=ngram_sizes)
        self.block_size = max_tokens

    def extend(self, features: mx.array | None) -> None:
        pass  # lookup reads tokens, not features

    def commit(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int) -> Proposal | None:
        """The continuation after the committed tokens (which end with the anchor); None without a match."""
        match = self.index.continuation(max_tokens=num_tokens)
        if not match.tokens:
            return None
        return Proposal(tokens=mx.array([match.tokens], dtype=mx.int32), hooked=False, source="lookup")
