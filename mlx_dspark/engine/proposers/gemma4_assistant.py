"""The proposer over a Gemma 4 assistant drafter (models/heads/gemma4_assistant/model.py): k chained steps per proposal
that read the target's own caches.

The assistant keeps no state of its own. It needs, at a proposal for the anchor at `position`: the target's
final normed state at position - 1 (tap `FINAL_TAP`; `extend` keeps the newest row) and the target's keys and
values of rows 0 .. position - 1, read from the round's target caches (`takes_target_cache`: the round passes
them as `target_cache=`). The round proposes after it rolled the caches back to the committed positions, and
`kv_rows` reads no row past a cache's offset, so a rejected draft's K/V is never read. Nothing is rolled back
here: the chained steps write no cache.

A prompt cache resumes it exactly (`resumable`, `start_at`): the target's caches are all it reads besides the
newest state, which the prefill always gives (it prefills at least the prompt's last token).

Greedy drafting is argmax, sampled drafting a draw from softmax(logits / T) with those distributions returned
(`draft_probs`), through chain_propose.draw_chain as the other chained heads.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from mlx_dspark.engine.proposers.chain import draw_chain
from mlx_dspark.engine.proposers.base import CHAIN, Proposal, Proposer
from mlx_dspark.models.layers.base import FINAL_TAP

# drafts per proposal: mlx-vlm's default block (4 = the target's token and 3 drafts) for these assistants
DEFAULT_TOKENS = 3
COST_KIND = CHAIN


def default_block(assistant: Any) -> int:
    return DEFAULT_TOKENS


def make_proposer(assistant: Any, target: Any, *, prompt: Sequence[int], greedy: bool, temperature: float,
                  block_size: int | None = None, prompt_cache: Any = None) -> "AssistantProposer":  # fmt: skip
    """No state of its own for a prompt cache to hold: it reads the target's caches."""
    return AssistantProposer(assistant, target, prompt=prompt, greedy=greedy, temperature=temperature,
                             block_size=block_size)  # fmt: skip


class AssistantProposer(Proposer):
    cost_kind = CHAIN
    takes_logits_hook = True
    takes_target_cache = True
    resumable = True  # nothing of its own to keep: a prompt cache resumes it on the target's caches (`start_at`)

    def __init__(self, assistant: Any, target: Any, *, prompt: Sequence[int] = (), greedy: bool, temperature: float,
                 block_size: Optional[int] = None) -> None:  # fmt: skip
        """`prompt` is unused (the assistant reads no token history); taken as the other chained heads take it."""
        size = DEFAULT_TOKENS if block_size is None else int(block_size)
        if size < 1:
            raise ValueError(f"block_size must be >= 1 Gemma 4 assistant steps, got {size}")
        self.assistant, self.target = assistant, target
        self.greedy, self.temperature, self.block_size = greedy, temperature, size
        self.tap_ids = (FINAL_TAP,)
        self.layer_types = target.layer_types
        self.positions = 0  # committed positions whose features came in
        self._hidden: mx.array | None = None  # (1, 1, C_b): the newest one's final normed state

    def extend(self, features: mx.array) -> None:
        self._hidden = features[:, -1:]
        self.positions += features.shape[1]

    extend_later = extend  # nothing to batch: only the newest state is read

    def start_at(self, position: int) -> None:
        """A prompt cache resumed the target's caches at `position`: the prefill gives the features from there
        (at least the last prompt position's, the only state read)."""
        self.positions, self._hidden = position, None

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int, logits_hook: Callable | None = None,
                target_cache: Any = None) -> Proposal:  # fmt: skip
        """Up to `num_tokens` drafts for positions position+1 ..; anchor (1,) sits at `position`, the target's
        caches (`target_cache`) hold positions 0 .. position - 1."""
        if target_cache is None:
            raise ValueError("a Gemma 4 assistant proposes from the target's caches: pass target_cache=")
        assert self.positions == position and self._hidden is not None, (self.positions, position)
        model, target = self.assistant, self.target
        shared = model.shared_kv(target_cache, self.layer_types)
        at = position - 1  # every step's query position: the state's (transformers' single-position generator)
        first = model(model.embed(anchor.reshape(1, 1), target), self._hidden, shared, position=at)

        def step(tokens: mx.array, y: mx.array, k: int) -> mx.array:
            return model(model.embed(tokens, target), model.post_projection(y), shared, position=at)

        return draw_chain(first, step=step, logits=lambda y, k: model.logits(y), num_tokens=num_tokens, greedy=self.greedy,
                          temperature=self.temperature, logits_hook=logits_hook)  # fmt: skip
