"""Parked rounds as plain decoding's own pipelined steps.

While the draft-length policy parks (length 0) and the proposer has nothing ready (no lookup block that
pays), a round of the speculative loop would verify the anchor alone and wait for its host read before
building the next forward: slower than plain decoding, which queues step n+1 before it reads step n.
`parked_steps` runs those rounds as plain decoding does. The policy's answer for the next round does not
depend on this round's token (a parked round observes nothing), so it is asked before the token is read;
a lookup proposer is asked on the context committed so far (one token behind, so a copy starts one token
later than it could: the price of never waiting on the host).

Each step taps the target's features for the draft context (the proposer batches them: `extend_later`),
keeps the prompt cache's record and yields the same one-token Round a parked round yields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx

from mlx_dspark.engine.policy.draft_length import DraftLength
from mlx_dspark.engine.logits.processing import LogitsProcessor
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.proposers.base import Proposer
from mlx_dspark.engine.logits.sample import Sampler


@dataclass
class Resume:
    """Where the speculative loop goes on after a parked run: the anchor (read, committed, not in the
    caches) at `position`, and the draft length the policy already gave its round."""

    anchor: mx.array  # (1,) int32
    anchor_id: int
    position: int
    emitted: int
    length: int


def can_pipeline(proposer: Proposer) -> bool:
    """A grammar's forced runs are planned on the grammar's state: those rounds stay rounds."""
    return proposer.grammar is None


def parked_steps(
    target: Any,
    proposer: Proposer,
    *,
    anchor: mx.array,
    anchor_id: int,
    position: int,
    emitted: int,
    cache: list,
    tap_ids: Sequence[int],
    prompt_cache: PromptCache,
    sampler: Sampler,
    processor: LogitsProcessor,
    draft_length: DraftLength,
    room: Callable[[int], int],
    commit: Callable[[list[int]], None],
    round_of: Callable[..., Any],
    check_cancel: Callable[[], None],
) -> Iterator[Any]:
    """Plain pipelined steps from `anchor` until the policy or the proposer wants a round; returns a Resume.

    `room(emitted)` is the most draft tokens a round may hold; `commit` gives committed tokens to the
    processor and the proposer; `round_of(tokens, logprobs)` builds the yielded Round.
    """
    takes_room = proposer.takes_room
    wants_round = proposer.wants_round
    extend = proposer.extend_later
    lease = prompt_cache.lease
    # the anchor is committed already (nothing pending); later tokens are queued before they are committed
    token, logprobs = _step(target, cache, anchor, mx.zeros((0,), mx.int32), tap_ids, extend, sampler, processor)
    prompt_cache.record([anchor_id])
    position, emitted = position + 1, emitted + 1  # `token` sits at `position`
    while True:
        check_cancel()
        length = draft_length.next_length(position=position)
        stop = length > 0 or wants_round(room=room(emitted))
        if stop:
            mx.eval(token, *logprobs)
            token_id = int(token.item())
            commit([token_id])
            draft_length.observe(proposed=0, accepted=0)  # the run's last parked round, counted like the others
            yield round_of([token_id], processor.read_logprobs(logprobs, [token_id]))
            return Resume(anchor=token.astype(mx.int32).reshape(1), anchor_id=token_id, position=position,
                          emitted=emitted, length=length)
        prompt_cache.claim(lease)
        # Queue the next step before reading this one, so the device never waits on the host.
        next_token, next_logprobs = _step(target, cache, token, token.reshape(1), tap_ids, extend, sampler, processor)
        token_id = int(token.item())
        prompt_cache.record([token_id])  # the queued step already took it
        commit([token_id])
        draft_length.observe(proposed=0, accepted=0)
        yield round_of([token_id], processor.read_logprobs(logprobs, [token_id]))
        token, logprobs = next_token, next_logprobs
        position, emitted = position + 1, emitted + 1


def _step(target, cache, token, pending, tap_ids, extend, sampler, processor) -> tuple[mx.array, tuple]:
    """One target forward of `token` (lazy), its features to the draft context; the next token, queued
    (`pending`: the tokens the processor has not been given yet)."""
    logits, features = target(token.reshape(1, 1), cache=cache, tap_ids=tap_ids)
    if features is not None:
        extend(features)
    processed = processor.target_logits(logits[0, -1:], pending)
    next_token = sampler.sample(processed[0])
    next_logprobs = processor.logprob_arrays(processed, next_token.reshape(1))
    mx.async_eval(next_token, *next_logprobs)
    return next_token, next_logprobs
