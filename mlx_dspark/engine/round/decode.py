"""Step generators: plain target decoding and the DSpark speculative round.

Each yields one `Round` per target forward after the prefill: the committed tokens, how many draft
tokens were verified and how many were accepted. The consumer decides when to stop (stop tokens,
strings, max tokens); a `cancel` event stops them from another thread, checked between prefill chunks
and between rounds (they raise GenerationCancelled).
The caches live in a `PromptCache`: a fresh one per call, or the caller's, which
then resumes from the longest prefix it can serve and stays reusable at every yield (so stopping early
leaves it valid).

The speculative round (DSPARK.md section 4), with everything lazy until one host read per round:
propose -> verify [anchor, x1..xl] -> accept -> read (accepted count, tokens) -> trim the target
caches -> give the draft the features of the committed positions -> the bonus is the next anchor.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx

from mlx_dspark.engine.round.accept import Acceptance, accept_greedy, accept_sampled
from mlx_dspark.engine.policy.draft_length import DraftLength, make_draft_length
from mlx_dspark.models.caches.kv import rollback_limit, trim_caches
from mlx_dspark.models.target.finite import check_finite_logits
from mlx_dspark.engine.logits.processing import LogitsProcessor
from mlx_dspark.engine.options import PREFILL_STEP_SIZE, SpeculationOptions
from mlx_dspark.engine.round.parked import can_pipeline, parked_steps
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.proposers.base import Proposal, Proposer, round_inputs
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.engine.costs.curve import CostCurve, scheduled_length



class GenerationCancelled(Exception):
    """The caller's cancel event was set: the generation stopped between prefill chunks or rounds."""


@dataclass
class Round:
    tokens: list[int]  # committed by this target forward (accepted drafts, then the target's token)
    proposed: int = 0  # draft tokens sent to verification (l)
    accepted: int = 0  # of those, accepted (a)
    verified: bool = False  # a speculative verify round (False: prefill token or plain decoding)
    logprobs: list | None = None  # one logprobs.TokenLogprob per committed token, when asked for
    source: str | None = None  # a verify round's block: "draft", "lookup" or "forced" (None: nothing proposed)


def _check_cancel(cancel: threading.Event | None, where: str = "between rounds") -> None:
    if cancel is not None and cancel.is_set():
        raise GenerationCancelled(f"generation cancelled {where}")


def prefill(
    target: Any,
    cache: list,
    prompt: Sequence[int],
    *,
    tap_ids: Sequence[int] = (),
    proposer: Proposer | None = None,
    step_size: int = PREFILL_STEP_SIZE,
    cancel: threading.Event | None = None,
    later: bool = False,
) -> mx.array:
    """Run the prompt through the target in chunks; returns the logits (V,) at the last position.

    Chunking bounds the memory of long prompts; each chunk's tapped features go to the proposer
    (`later`: through its `extend_later`, so a generation that starts parked computes only the rows a
    windowed draft context keeps, and those when it first drafts).
    `cancel`, when set, stops the prefill before its next chunk (GenerationCancelled): a long prompt
    nobody waits for any more costs at most the chunk in flight.
    """
    if len(prompt) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    tokens = mx.array(prompt, dtype=mx.int32)[None]
    for start in range(0, len(prompt), step_size):
        _check_cancel(cancel, f"during the prefill, after {start} of {len(prompt)} prompt tokens")
        chunk = tokens[:, start : start + step_size]
        is_last = start + step_size >= len(prompt)
        logits, features = target(chunk, cache=cache, tap_ids=tap_ids, last_only=True)
        if proposer is not None:
            (proposer.extend_later if later else proposer.extend)(features)
        if not is_last:
            # Evaluate chunk by chunk so a long prompt never builds one giant graph.
            mx.eval(logits, *([] if features is None else [features]))
    return logits[0, -1]


def prefill_cached(
    target: Any,
    prompt_cache: PromptCache,
    prompt: Sequence[int],
    *,
    tap_ids: Sequence[int] = (),
    proposer: Proposer | None = None,
    step_size: int = PREFILL_STEP_SIZE,
    cancel: threading.Event | None = None,
) -> mx.array:
    """Resume `prompt_cache` on `prompt` and prefill the tokens it does not hold; returns the last logits (V,).

    The prefill pauses where the prompt cache wants snapshots (near the prompt's end).
    """
    prompt = list(prompt)
    # A proposer with no state of its own (lookup alone) keeps nothing in the cache: it resumes like plain decoding.
    stateless = proposer is not None and not proposer.tap_ids and proposer.context is None and not proposer.chains
    start = prompt_cache.resume(target, prompt, proposer=None if stateless else proposer)
    for end in prompt_cache.prefill_stops(start, len(prompt)):
        chunk = prompt[start:end]
        logits = prefill(
            target, prompt_cache.target_cache, chunk, tap_ids=tap_ids, proposer=proposer, step_size=step_size,
            cancel=cancel, later=True,
        )  # fmt: skip
        prompt_cache.record(chunk)
        if end < len(prompt):
            if proposer is not None:
                proposer.flush()  # the snapshot holds the draft context too
            prompt_cache.snapshot()
        start = end
    # Once per prompt, on its last logits (not per prefill stop: each check is a host read)
    check_finite_logits(logits, step="the first step (the end of the prompt)")  # NaN weights would decode as nonsense
    return logits


def plain_steps(
    target: Any,
    prompt: Sequence[int],
    *,
    sampler: Sampler,
    prefill_step_size: int = PREFILL_STEP_SIZE,
    prompt_cache: PromptCache | None = None,
    cancel: threading.Event | None = None,
    processor: LogitsProcessor | None = None,
) -> Iterator[Round]:
    """Plain autoregressive decoding with the target alone: the baseline, one token per Round.

    `processor` (penalties, logit_bias, a constraint, logprobs) processes each step's logits.
    """
    prompt_cache = PromptCache(target, max_snapshots=0) if prompt_cache is None else prompt_cache
    processor = processor or LogitsProcessor.passthrough()
    logits = prefill_cached(target, prompt_cache, prompt, step_size=prefill_step_size, cancel=cancel)
    lease, cache = prompt_cache.lease, prompt_cache.target_cache
    token, logprobs = _draw(sampler, processor, logits[None], mx.zeros((0,), mx.int32))
    mx.async_eval(token, *logprobs)
    while True:
        _check_cancel(cancel)  # before the claim: a cancelled generation leaves the cache reusable
        prompt_cache.claim(lease)
        # Queue the next step before reading this one, so the device never waits on the host.
        next_logits, _ = target(token.reshape(1, 1), cache=cache)
        next_token, next_logprobs = _draw(sampler, processor, next_logits[0, -1:], token.reshape(1))
        mx.async_eval(next_token, *next_logprobs)
        committed = int(token.item())
        prompt_cache.record([committed])  # the queued step already took it
        processor.commit([committed])
        yield Round(tokens=[committed], logprobs=processor.read_logprobs(logprobs, [committed]))
        token, logprobs = next_token, next_logprobs


def _draw(sampler: Sampler, processor: LogitsProcessor, logits: mx.array, pending: mx.array) -> tuple[mx.array, tuple]:
    """One token (and its lazy logprob arrays) from one row of logits (1, V) whose context ends with `pending`."""
    processed = processor.target_logits(logits, pending)
    token = sampler.sample(processed[0])
    return token, processor.logprob_arrays(processed, token.reshape(1))


def speculative_steps(
    target: Any,
    proposer: Proposer,
    prompt: Sequence[int],
    *,
    sampler: Sampler,
    speculation: SpeculationOptions = SpeculationOptions(max_draft_tokens=None),  # full blocks: auto needs a cost curve
    max_tokens: int | None = None,
    prefill_step_size: int = PREFILL_STEP_SIZE,
    prompt_cache: PromptCache | None = None,
    cancel: threading.Event | None = None,
    processor: LogitsProcessor | None = None,
    draft_length: DraftLength | None = None,
) -> Iterator[Round]:
    """Lossless speculative decoding: yields the prefill's token, then one Round per verify forward.

    A round proposes `draft_length.next_length()` drafts (draft_length.py; default the policy
    `speculation.max_draft_tokens` names: auto, or a fixed cap; 0: a target step alone), cut further by
    `p_min`, the confidence threshold and, with `verify_schedule="confidence"`, by the expected rate
    over `speculation.cost_curve` (schedule.py). `max_tokens`, when given, shortens the last proposals
    so no verify work is spent past it. `processor` processes the verify rows and the draft positions
    (logits_processing.py); acceptance uses the processed distributions.
    """
    if draft_length is None:
        cap = speculation.draft_length(proposer.block_size)
        draft_length = make_draft_length(speculation.max_draft_tokens, cap, speculation.cost_curve)
    schedule = None
    if speculation.verify_schedule == "confidence":
        if speculation.cost_curve is None:
            raise ValueError("verify_schedule 'confidence' needs speculation.cost_curve (api.stream_generate fills in this machine's)")
        schedule = speculation.cost_curve
    prompt_cache = PromptCache(target, max_snapshots=0) if prompt_cache is None else prompt_cache
    tap_ids = tuple(proposer.tap_ids)
    logits = prefill_cached(
        target, prompt_cache, prompt, tap_ids=tap_ids, proposer=proposer, step_size=prefill_step_size, cancel=cancel
    )
    lease, cache = prompt_cache.lease, prompt_cache.target_cache
    processor = processor or LogitsProcessor.passthrough()
    hook = processor.draft_hook() if proposer.takes_logits_hook else None
    # A proposer that sizes its own blocks (choose.Chooser: lookup, forced runs) gets the room a round
    # has: what max_tokens leaves and what the target caches can roll back.
    takes_room = proposer.takes_room
    rollback = rollback_limit(cache)
    anchor, logprobs = _draw(sampler, processor, logits[None], mx.zeros((0,), mx.int32))
    anchor = anchor.astype(mx.int32).reshape(1)
    mx.eval(anchor, *logprobs)
    anchor_id = int(anchor.item())
    position = len(prompt)  # the anchor's position; caches hold 0 .. position - 1
    emitted = 1
    _commit(processor, proposer, [anchor_id])
    yield Round(tokens=[anchor_id], logprobs=processor.read_logprobs(logprobs, [anchor_id]))

    def room_at(emitted: int) -> int:
        return rollback if max_tokens is None else max(0, min(rollback, max_tokens - emitted - 1))

    pipelined = can_pipeline(proposer)
    wants_round = proposer.wants_round
    length = None  # the next round's draft length when a parked run already asked the policy
    while True:
        _check_cancel(cancel)
        prompt_cache.claim(lease)
        length = draft_length.next_length(position=position) if length is None else length  # 0: parked
        room = room_at(emitted)
        if length == 0 and pipelined and not wants_round(room=room):
            resume = yield from parked_steps(
                target, proposer, anchor=anchor, anchor_id=anchor_id, position=position, emitted=emitted,
                cache=cache, tap_ids=tap_ids, prompt_cache=prompt_cache, sampler=sampler, processor=processor,
                draft_length=draft_length, room=room_at, commit=lambda tokens: _commit(processor, proposer, tokens),
                round_of=_parked_round, check_cancel=lambda: _check_cancel(cancel),
            )  # fmt: skip
            anchor, anchor_id, position, emitted = resume.anchor, resume.anchor_id, resume.position, resume.emitted
            length = resume.length
            continue
        num_tokens = min(length, room)
        proposal = None
        if num_tokens or (takes_room and room):
            extra = round_inputs(proposer, logits_hook=hook, target_cache=cache) | ({"room": room} if takes_room else {})
            proposal = proposer.propose(anchor, position=position, num_tokens=num_tokens, **extra)
            draft_length.untimed(proposer.take_catch_up_ms())
        if proposal is not None:
            # Start the draft on the device while the host builds the verify graph.
            mx.async_eval(proposal.tokens)
        width = proposal.tokens.shape[1] if takes_room and proposal is not None else num_tokens
        draft_tokens, draft_probs = _admitted(
            proposal, width, p_min=speculation.p_min, threshold=speculation.confidence_threshold, schedule=schedule
        )
        hooked = hook is not None and (proposal is None or proposal.hooked)
        draft_tokens, draft_probs = processor.admit(draft_tokens, draft_probs, hooked=hooked)
        num_draft = draft_tokens.shape[0]

        acceptance, features, logprobs = verify(
            target, cache, anchor, draft_tokens, draft_probs, tap_ids=tap_ids, sampler=sampler, processor=processor
        )  # fmt: skip
        accepted = int(acceptance.accepted.item())
        committed = acceptance.tokens[: accepted + 1].tolist()
        _commit(processor, proposer, committed)
        if proposal is None or proposal.source == "draft":  # lookup / forced blocks say nothing of the draft
            draft_length.observe(proposed=num_draft, accepted=accepted, confidence=None if proposal is None else proposal.confidence)
        else:  # its time is no round of the draft's: the next one is timed from here
            draft_length.restart_clock()

        # Roll back: the target caches keep positions 0 .. position + accepted.
        trim_caches(cache, num_draft - accepted)
        if features is not None:  # a proposer without tapped layers (lookup alone) takes no features
            # parked: the draft context takes the committed positions in batches (extend_later)
            (proposer.extend if length else proposer.extend_later)(features[:, : accepted + 1])
        anchor = acceptance.tokens[accepted : accepted + 1]
        position += accepted + 1
        emitted += accepted + 1
        prompt_cache.record([anchor_id, *committed[:-1]])  # the bonus, the new anchor, is not in the caches
        anchor_id = committed[-1]
        length = None
        yield Round(
            tokens=committed, proposed=num_draft, accepted=accepted, verified=True,
            logprobs=processor.read_logprobs(logprobs, committed),
            source=None if proposal is None or num_draft == 0 else proposal.source,
        )


def verify(
    target: Any, cache: Any, anchor: mx.array, draft_tokens: mx.array, draft_probs: mx.array | None, *,
    tap_ids: Sequence[int], sampler: Sampler, processor: LogitsProcessor,
) -> tuple[Acceptance, mx.array | None, list]:  # fmt: skip
    """One target forward over [anchor, drafts], its acceptance (greedy, or sampled against the drafts' own
    distributions: lossless) and the committed candidates' logprobs, read in the round's one host read."""
    num_draft = draft_tokens.shape[0]
    verify_input = mx.concatenate([anchor, draft_tokens]).reshape(1, num_draft + 1)
    logits, features = target(verify_input, cache=cache, tap_ids=tap_ids)
    target_logits = processor.target_logits(logits[0], draft_tokens)  # (l + 1, V)
    if sampler.greedy:
        acceptance = accept_greedy(draft_tokens=draft_tokens, target_logits=target_logits)
    else:
        acceptance = accept_sampled(draft_tokens=draft_tokens, draft_probs=draft_probs, target_probs=sampler.probs(target_logits))
    logprobs = processor.logprob_arrays(target_logits, acceptance.tokens)
    mx.eval(acceptance.accepted, acceptance.tokens, *logprobs)  # the round's one host read
    return acceptance, features, logprobs


def _parked_round(tokens: list[int], logprobs: list | None) -> Round:
    """A parked round's Round: a verify of the anchor alone (counted as a round with nothing proposed)."""
    return Round(tokens=tokens, verified=True, logprobs=logprobs)


def _commit(processor: LogitsProcessor, proposer: Proposer, tokens: list[int]) -> None:
    processor.commit(tokens)
    proposer.commit(tokens)  # proposers that read the committed tokens (lookup, chains) keep them


def _admitted(
    proposal: Proposal | None, num_tokens: int, *, p_min: float, threshold: float, schedule: CostCurve | None
) -> tuple[mx.array, mx.array | None]:
    """The draft tokens sent to verification (l,), cut by p_min / the confidence threshold / the schedule.

    A cut depends on draft values, so it costs one extra host read; without cuts nothing is read.
    """
    if proposal is None or num_tokens == 0:
        return mx.zeros((0,), mx.int32), None
    if proposal.source != "draft":
        schedule = None  # a lookup or forced block comes sized by its chooser (choose.py)
    tokens = proposal.tokens[0, :num_tokens].astype(mx.int32)
    draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[0, :num_tokens]
    keep = None
    if p_min > 0.0 and proposal.token_probs is not None:
        keep = proposal.token_probs[0, :num_tokens] >= p_min
    if threshold > 0.0 and proposal.confidence is not None:
        confident = proposal.confidence[0, :num_tokens] >= threshold
        keep = confident if keep is None else keep & confident
    if keep is None and schedule is None:
        return tokens, draft_probs
    kept = None if keep is None else mx.cumprod(keep.astype(mx.int32)).sum()
    confidence = None
    if schedule is not None:
        if proposal.confidence is None:
            raise ValueError("verify_schedule 'confidence' needs confidences c(k): this proposer's proposals carry none")
        confidence = proposal.confidence[0, :num_tokens].astype(mx.float32)
    mx.eval(*(x for x in (kept, confidence) if x is not None))  # the one extra host read, for every cut
    length = num_tokens if kept is None else int(kept.item())
    if confidence is not None:
        length = min(length, scheduled_length(confidence.tolist(), schedule))
    return tokens[:length], None if draft_probs is None else draft_probs[:length]
