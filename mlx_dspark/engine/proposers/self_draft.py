"""The proposer of `draft="self"`: the target's own first N layers, final norm and head (models/heads/self_draft)
drafting k chained steps over the target's own caches.

The draft's K/V rows of layers 0 .. N - 1 are the target's (LayerSkip, Draft & Verify), so the proposal writes
into the round's target caches (`takes_target_cache`): each step runs one token through layers 0 .. N - 1,
appending to those layers' caches, and its exit's logits give the next draft. Every cache is then put back to
what it held before the proposal (`layer_state` / `restore_layer`: a trimmable cache's offset moved back, a
recurrent state's arrays and a rotating window's buffers restored by reference), so the verify sees the
committed positions alone and the round stays lossless. A round costs about k * N / L of a target step besides
its verify.

Greedy drafting is argmax, sampled drafting a draw from softmax(logits / T) whose distributions are returned
(`draft_probs`), through chain.draw_chain as the other chained heads. It keeps no state of its own, so a prompt
cache resumes it as it is (`resumable`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx

from mlx_dspark.engine.proposers.base import CHAIN, Proposal, Proposer
from mlx_dspark.engine.proposers.chain import draw_chain
from mlx_dspark.models.caches.snapshot import cache_states, restore_caches
from mlx_dspark.models.heads.self_draft.model import exit_logits

DEFAULT_TOKENS = 4  # drafts per proposal by default; `auto` chooses from the chain's measured cost
COST_KIND = CHAIN


def default_block(module: Any) -> int:
    return DEFAULT_TOKENS


def make_proposer(module: Any, target: Any, *, prompt: Sequence[int], greedy: bool, temperature: float,
                  block_size: int | None = None, prompt_cache: Any = None) -> "SelfDraftProposer":  # fmt: skip
    """No state of its own for a prompt cache to hold: it drafts over the target's caches."""
    return SelfDraftProposer(target, num_layers=module.layers_for(target), greedy=greedy, temperature=temperature,
                             block_size=DEFAULT_TOKENS if block_size is None else block_size)  # fmt: skip


class SelfDraftProposer(Proposer):
    cost_kind = CHAIN
    takes_logits_hook = True
    takes_target_cache = True
    resumable = True  # nothing of its own: the target's caches are all it reads

    def __init__(self, target: Any, *, num_layers: int, greedy: bool, temperature: float, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 self-draft steps, got {block_size}")
        self.target, self.num_layers = target, num_layers
        self.greedy, self.temperature, self.block_size = greedy, temperature, int(block_size)

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int, logits_hook: Callable | None = None,
                target_cache: Any = None) -> Proposal:  # fmt: skip
        """Up to `num_tokens` drafts for positions position+1 ..; anchor (1,) sits at `position`, the target's
        caches (`target_cache`) hold positions 0 .. position - 1 and hold them again afterwards."""
        if target_cache is None:
            raise ValueError("draft 'self' proposes over the target's own caches: pass target_cache=")
        saved = cache_states(target_cache)  # references, and copies of in-place buffers

        def step(tokens: mx.array, _: Any, k: int) -> mx.array:
            return exit_logits(self.target, tokens, target_cache, self.num_layers)  # (1, 1, V)

        try:
            first = step(anchor.reshape(1, 1), None, 0)
            return draw_chain(first, step=step, logits=lambda logits, k: logits, num_tokens=num_tokens, greedy=self.greedy,
                              temperature=self.temperature, logits_hook=logits_hook)  # fmt: skip
        finally:
            restore_caches(target_cache, saved)
