"""Step generators: plain target decoding and the DSpark speculative round.

Each yields one `Round` per target forward after the prefill: the committed tokens, how many draft
tokens were verified and how many were accepted. The consumer decides when to stop (stop tokens,
strings, max tokens); caches live inside the generator, so stopping early leaves nothing behind.

The speculative round (DSPARK.md section 4), with everything lazy until one host read per round:
propose -> verify [anchor, x1..xl] -> accept -> read (accepted count, tokens) -> trim the target
caches -> give the draft the features of the committed positions -> the bonus is the next anchor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx

from mlx_dspark.accept import accept_greedy, accept_sampled
from mlx_dspark.cache import trim_caches
from mlx_dspark.finite import check_finite_logits
from mlx_dspark.propose import Proposal, Proposer
from mlx_dspark.sample import Sampler


@dataclass
class Round:
    tokens: list[int]  # committed by this target forward (accepted drafts, then the target's token)
    proposed: int = 0  # draft tokens sent to verification (l)
    accepted: int = 0  # of those, accepted (a)
    verified: bool = False  # a speculative verify round (False: prefill token or plain decoding)


def prefill(
    target: Any,
    cache: list,
    prompt: Sequence[int],
    *,
    tap_ids: Sequence[int] = (),
    proposer: Proposer | None = None,
    step_size: int = 512,
) -> mx.array:
    """Run the prompt through the target in chunks; returns the logits (V,) at the last position.

    Chunking bounds the memory of long prompts; each chunk's tapped features go to the proposer.
    """
    if len(prompt) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    tokens = mx.array(prompt, dtype=mx.int32)[None]
    for start in range(0, len(prompt), step_size):
        chunk = tokens[:, start : start + step_size]
        is_last = start + step_size >= len(prompt)
        logits, features = target(chunk, cache=cache, tap_ids=tap_ids, last_only=True)
        if proposer is not None:
            proposer.extend(features)
        if not is_last:
            # Evaluate chunk by chunk so a long prompt never builds one giant graph.
            mx.eval(logits, *([] if features is None else [features]))
    last = logits[0, -1]
    check_finite_logits(last, step="the first step (the end of the prompt)")  # NaN weights would decode as nonsense
    return last


def plain_steps(
    target: Any,
    prompt: Sequence[int],
    *,
    sampler: Sampler,
    prefill_step_size: int = 512,
) -> Iterator[Round]:
    """Plain autoregressive decoding with the target alone: the baseline, one token per Round."""
    cache = target.make_cache()
    logits = prefill(target, cache, prompt, step_size=prefill_step_size)
    token = sampler.sample(logits)
    mx.async_eval(token)
    while True:
        # Queue the next step before reading this one, so the device never waits on the host.
        next_logits, _ = target(token.reshape(1, 1), cache=cache)
        next_token = sampler.sample(next_logits[0, -1])
        mx.async_eval(next_token)
        yield Round(tokens=[int(token.item())])
        token = next_token


def speculative_steps(
    target: Any,
    proposer: Proposer,
    prompt: Sequence[int],
    *,
    sampler: Sampler,
    p_min: float = 0.0,
    confidence_threshold: float = 0.0,
    max_tokens: int | None = None,
    prefill_step_size: int = 512,
) -> Iterator[Round]:
    """Lossless speculative decoding: yields the prefill's token, then one Round per verify forward.

    `max_tokens`, when given, shortens the last proposals so no verify work is spent past it.
    """
    cache = target.make_cache()
    tap_ids = tuple(proposer.tap_ids)
    logits = prefill(target, cache, prompt, tap_ids=tap_ids, proposer=proposer, step_size=prefill_step_size)
    anchor = sampler.sample(logits).astype(mx.int32).reshape(1)
    mx.eval(anchor)
    position = len(prompt)  # the anchor's position; caches hold 0 .. position - 1
    emitted = 1
    yield Round(tokens=[int(anchor.item())])

    while True:
        num_tokens = proposer.block_size
        if max_tokens is not None:
            num_tokens = max(0, min(num_tokens, max_tokens - emitted - 1))
        proposal = proposer.propose(anchor, position=position, num_tokens=num_tokens) if num_tokens else None
        if proposal is not None:
            # Start the draft on the device while the host builds the verify graph.
            mx.async_eval(proposal.tokens)
        draft_tokens, draft_probs = _admitted(proposal, num_tokens, p_min=p_min, threshold=confidence_threshold)
        num_draft = draft_tokens.shape[0]

        verify_input = mx.concatenate([anchor, draft_tokens]).reshape(1, num_draft + 1)
        logits, features = target(verify_input, cache=cache, tap_ids=tap_ids)
        if sampler.greedy:
            acceptance = accept_greedy(draft_tokens=draft_tokens, target_logits=logits[0])
        else:
            acceptance = accept_sampled(
                draft_tokens=draft_tokens, draft_probs=draft_probs, target_probs=sampler.probs(logits[0])
            )
        mx.eval(acceptance.accepted, acceptance.tokens)  # the round's one host read
        accepted = int(acceptance.accepted.item())
        committed = acceptance.tokens[: accepted + 1].tolist()

        # Roll back: the target caches keep positions 0 .. position + accepted.
        trim_caches(cache, num_draft - accepted)
        proposer.extend(features[:, : accepted + 1])
        anchor = acceptance.tokens[accepted : accepted + 1]
        position += accepted + 1
        emitted += accepted + 1
        yield Round(tokens=committed, proposed=num_draft, accepted=accepted, verified=True)


def _admitted(
    proposal: Proposal | None, num_tokens: int, *, p_min: float, threshold: float
) -> tuple[mx.array, mx.array | None]:
    """The draft tokens sent to verification (l,), cut by p_min / the confidence threshold.

    A cut depends on draft values, so it costs one extra host read; without cuts nothing is read.
    """
    if proposal is None or num_tokens == 0:
        return mx.zeros((0,), mx.int32), None
    tokens = proposal.tokens[0, :num_tokens].astype(mx.int32)
    draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[0, :num_tokens]
    keep = None
    if p_min > 0.0 and proposal.token_probs is not None:
        keep = proposal.token_probs[0, :num_tokens] >= p_min
    if threshold > 0.0 and proposal.confidence is not None:
        confident = proposal.confidence[0, :num_tokens] >= threshold
        keep = confident if keep is None else keep & confident
    if keep is None:
        return tokens, draft_probs
    length = int(mx.cumprod(keep.astype(mx.int32)).sum().item())
    return tokens[:length], None if draft_probs is None else draft_probs[:length]
