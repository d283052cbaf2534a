"""Verification outcome of one speculative round, as pure (lazy) functions of arrays.

Both functions return an `Acceptance` whose `tokens[: accepted + 1]` are the tokens the round commits
(the accepted draft tokens, then the bonus token). Nothing here reads back to the host: the loop
evaluates `accepted` and `tokens` together, once per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class Acceptance:
    accepted: mx.array  # () int32: number of accepted draft tokens a (0..l)
    tokens: mx.array  # (l + 1,) committed candidates; only the first a + 1 are meaningful


def accept_greedy(*, draft_tokens: mx.array, target_logits: mx.array) -> Acceptance:
    """Greedy verification: accept x(k) while it equals the target's argmax at k - 1.

    draft_tokens: (l,) proposed tokens; target_logits: (l + 1, V) for [anchor, x1..xl].
    Accepted draft tokens equal the target's argmax, so the committed tokens are simply the target's
    argmax at positions 0..a (the last being the bonus).
    """
    target_tokens = mx.argmax(target_logits, axis=-1).astype(mx.int32)  # (l + 1,)
    num_draft = draft_tokens.shape[0]
    matches = (draft_tokens.astype(mx.int32) == target_tokens[:num_draft]).astype(mx.int32)
    accepted = mx.cumprod(matches).sum() if num_draft else mx.array(0, mx.int32)
    return Acceptance(accepted=accepted, tokens=target_tokens)


def accept_sampled(
    *,
    draft_tokens: mx.array,
    draft_probs: mx.array | None,
    target_probs: mx.array,
) -> Acceptance:
    """Speculative sampling (Leviathan et al.; DSPARK.md section 4.3), lossless for any proposer.

    draft_tokens: (l,); draft_probs: (l, V) the distributions the draft tokens were drawn from, or None
    when drafting was greedy (then each is one-hot at its token); target_probs: (l + 1, V) the target's
    sampling distributions at [anchor, x1..xl]. draft_probs may carry one more row, q(l+1), of a draft
    token cut before verification because the target cannot produce it (a grammar forbids it): that
    token counts as rejected, so all-accepted draws its bonus from max(0, P(l) - q(l+1)).
    """
    num_draft = draft_tokens.shape[0]
    vocab_size = target_probs.shape[-1]
    draft_tokens = draft_tokens.astype(mx.int32)
    if draft_probs is None:
        draft_probs = (mx.arange(vocab_size) == draft_tokens[:, None]).astype(target_probs.dtype)
    # Row a of the residual: max(0, P(a) - q(a+1)) after a rejection, P(l) itself when all survived
    # (an appended zero row makes that case the same formula).
    if draft_probs.shape[0] == num_draft + 1:
        padded_draft_probs = draft_probs
        draft_probs = draft_probs[:num_draft]
    else:
        padded_draft_probs = mx.concatenate([draft_probs, mx.zeros((1, vocab_size), draft_probs.dtype)], axis=0)

    if num_draft:
        target_at_draft = mx.take_along_axis(target_probs[:num_draft], draft_tokens[:, None], axis=-1)[:, 0]
        draft_at_draft = mx.take_along_axis(draft_probs, draft_tokens[:, None], axis=-1)[:, 0]
        # accept with probability min(1, target / draft), written without a division
        uniforms = mx.random.uniform(shape=(num_draft,))
        survives = (uniforms * draft_at_draft < target_at_draft).astype(mx.int32)
        accepted = mx.cumprod(survives).sum()
    else:
        accepted = mx.array(0, mx.int32)

    residual = mx.maximum(target_probs - padded_draft_probs, 0.0)  # (l + 1, V)
    row = residual[accepted]
    # A rejection is impossible where P == q; guard the 0/0 anyway by falling back to P(a).
    row = mx.where(row.sum() > 0, row, target_probs[accepted])
    bonus = mx.random.categorical(mx.log(row)).astype(mx.int32)

    positions = mx.arange(num_draft + 1)
    padded_draft = mx.concatenate([draft_tokens, mx.zeros((1,), mx.int32)])
    tokens = mx.where(positions < accepted, padded_draft, bonus)
    return Acceptance(accepted=accepted, tokens=tokens)
