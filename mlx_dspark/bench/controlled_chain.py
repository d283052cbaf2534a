"""The controlled-acceptance benchmark's pieces for chained heads (a head whose cost kind is a chain: one
forward per draft token), benchmark-only.

A chained head runs its real k steps each round (`chain_proposer`: the engine's own proposer, greedy),
then `controlled.ControlledProposer` replaces its tokens as it does a block draft's. Its cost is not one
block forward but a chain: the ideal round is `draft_ms + k * draft_step_ms + verify(k + 1)`, the cost
`auto` reads for these heads (engine/costs/probe.measure_chain_curve, CostCurve.round_ms). `ChainProbe`
times the chain of k and of 1 draft and the verify forward, interleaved with the runs as `CostProbe`
does for a block draft; the per-step cost is their difference over k - 1.

The chain runs k = the head's default steps (engine/proposers.head_block), more when a controlled acceptance
length asks for them (an acceptance length tau needs k >= tau - 1).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import mlx.core as mx

from mlx_dspark.engine.costs import probe as cost_probe
from mlx_dspark.engine.proposers import cost_kind, default_head, head_block, make_head_proposer
from mlx_dspark.engine.proposers.base import CHAIN
from mlx_dspark.engine.round.decode import prefill
from mlx_dspark.bench.cost import CostProbe, _timed, random_prompt
from mlx_dspark.bench.stats import loadavg

def chain_head(loaded: Any) -> str | None:
    """The chained head the controlled runs drive; None when the pair's head is a block draft (or it has none)."""
    head = default_head(loaded)  # the block draft's name also for a pair of no head at all
    return head if loaded.heads.get(head) is not None and cost_kind(head) == CHAIN else None


def chain_steps(loaded: Any, head: str, acceptance_lengths: Sequence[float]) -> int:
    """Drafts per proposal: the head's default chain, raised so the largest acceptance length fits."""
    return max(head_block(loaded, head), math.ceil(max(acceptance_lengths, default=1.0)) - 1)


def chain_proposer(loaded: Any, head: str, prompt: Sequence[int], *, steps: int) -> Any:
    """The engine's proposer of a chained head, greedy, `steps` drafts per proposal; `prompt` the tokens the
    prefill gives features for."""
    if loaded.heads.get(head) is None or cost_kind(head) != CHAIN:
        chained = [name for name in loaded.heads if cost_kind(name) == CHAIN]
        raise ValueError(f"{head!r} is not a chained head of this pair (its chained heads: {chained or 'none'})")
    return make_head_proposer(loaded, head, prompt=list(prompt), greedy=True, temperature=1.0, block_size=steps)


class ChainProbe(CostProbe):
    """`CostProbe` (verify widths 1..steps + 1, a plain decode step) over a chained head's taps, at `context`
    positions: `draft_block` times a proposal of `steps` chained drafts, `draft_first` one of a single draft.
    The chain trims its own cache back after each proposal, so the context stays put."""

    def __init__(self, loaded: Any, head: str, *, steps: int, context: int, seed: int = 0) -> None:
        if context < 1:
            raise ValueError(f"the cost-curve context must be >= 1 token, got {context}")
        target = loaded.target
        self.target, self.draft, self.context, self.block_size = target, loaded.heads[head], context, steps
        vocab = target.args.vocab_size
        self.prompt = random_prompt(vocab, context, seed=seed)
        self.proposer = chain_proposer(loaded, head, self.prompt, steps=steps)
        self.cache = target.make_cache()
        logits = prefill(target, self.cache, self.prompt, tap_ids=self.proposer.tap_ids, proposer=self.proposer)
        self.anchor = mx.argmax(logits).astype(mx.int32).reshape(1)
        mx.eval(self.anchor)
        self.proposer.commit([int(self.anchor.item())])  # the anchor pairs with the last entry
        self.extra = {"target_cache": self.cache} if self.proposer.takes_target_cache else {}
        self.candidates = mx.array(random_prompt(vocab, steps + 1, seed=seed + 1), dtype=mx.int32)[None]

    def _chain(self, num_tokens: int) -> tuple[float, float]:
        return _timed(
            lambda: self.proposer.propose(self.anchor, position=self.context, num_tokens=num_tokens, **self.extra),
            outputs=lambda p: [p.tokens],
        )

    def draft_block(self) -> tuple[float, float]:
        return self._chain(self.block_size)

    def draft_first(self) -> tuple[float, float]:
        return self._chain(1)

    def draft_layers(self, *, with_lm_head: bool) -> tuple[float, float]:
        raise ValueError("a chained head has no block forward to time alone: time draft_first / draft_block")


def step_ms(*, chain_ms: float, first_ms: float, steps: int) -> float:
    """A chained draft's cost per further step, from a chain of `steps` drafts and one of a single draft."""
    return max(0.0, (chain_ms - first_ms) / max(steps - 1, 1))


def measure_chain_cost(loaded: Any, head: str, *, steps: int, context: int, repeats: int, seed: int = 0) -> dict:
    """The chained head's cost curve as `auto` measures it (verify(1..8), `draft_ms`, `draft_step_ms`: the
    fastest of `repeats`), JSON-ready, with the round it prices for a chain of `steps`."""
    curve = cost_probe.measure_chain_curve(loaded.target, loaded.heads[head], head=head, context=context, repeats=repeats, seed=seed, chain=steps)
    if steps + 1 > len(curve.verify_ms):
        raise ValueError(f"a chain of {steps} drafts needs verify widths up to {steps + 1}; the curve has {len(curve.verify_ms)}")
    return {
        "head": head,
        "context": curve.context,
        "chain_steps": steps,
        "repeats": repeats,
        "verify_ms": {str(width): ms for width, ms in enumerate(curve.verify_ms, start=1)},
        "draft_ms": curve.draft_ms,
        "draft_step_ms": curve.draft_step_ms,
        "draft_block_ms": curve.proposal_ms(steps),  # a chain of `steps` drafts
        "round_ms": curve.round_ms(steps),
        "source": curve.source,
        "loadavg": loadavg(),
    }


def format_chain_cost(curve: dict) -> str:
    """The chained head's curve as a few text lines."""
    steps, verify = curve["chain_steps"], curve["verify_ms"]
    widths = " ".join(f"{verify[w]:.1f}" for w in sorted(verify, key=int))
    return "\n".join([
        f"cost curve of the {curve['head']} chain at context {curve['context']} (fastest of {curve['repeats']}, loadavg {curve['loadavg']})",
        f"  draft: {curve['draft_ms']:.2f} ms + {curve['draft_step_ms']:.2f} ms per chained step "
        f"({steps} steps: {curve['draft_block_ms']:.2f} ms)",
        f"  verify(1..{len(verify)}): {widths} ms",
        f"  round of {steps} drafts: {curve['round_ms']:.2f} ms",
    ])  # fmt: skip
