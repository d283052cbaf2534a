"""The round and the prompt cache on every cache kind, over mlx-lm's own models (issue 25).

A stand-in target runs an mlx-lm model's own `__call__` under `recording`, so these tests do not depend on
the target adapter: speculative greedy decoding with a wrong draft token injected in most rounds (partial
rejections, rolled back by `trim_caches`) must be token-identical to mlx-lm's own `generate_step`; and a
multi-turn conversation on a `PromptCache` (live rollback, snapshots of the recurrent / rotating state)
must equal cold runs.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlx_dspark.engine.round.decode import plain_steps, speculative_steps
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.models.caches.rollback import RollbackCaches, recording
from mlx_dspark.testing.mlx_lm_models import FACTORIES, VOCAB, make_mlx_lm_cache, tiny_mlx_lm_model
from tests.engine_helpers import OracleProposer


class MlxLmTarget:
    """What the engine needs from a target, over an mlx-lm model's own `__call__` (features are zeros)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.model = tiny_mlx_lm_model(kind)

    def make_cache(self):
        return RollbackCaches(make_mlx_lm_cache(self.kind, self.model))

    def __call__(self, inputs, *, cache=None, tap_ids=(), last_only=False):
        with recording(self.model, cache):
            logits = self.model(inputs, cache=cache)
        features = mx.zeros((*inputs.shape, len(tap_ids))) if tap_ids else None
        return (logits[:, -1:] if last_only else logits), features


def mlx_lm_greedy(target: MlxLmTarget, prompt: list[int], length: int) -> list[int]:
    """mlx-lm's own greedy generation on the same model (its caches, its loop)."""
    cache = make_mlx_lm_cache(target.kind, target.model)
    steps = generate_step(mx.array(prompt), target.model, max_tokens=length, sampler=lambda x: mx.argmax(x, axis=-1),
                          prompt_cache=cache)  # fmt: skip
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_speculative_greedy_with_partial_rejections_equals_mlx_lm_generate(kind):
    target = MlxLmTarget(kind)
    prompt = [random.Random(3).randrange(VOCAB) for _ in range(13)]
    length = 48
    reference = mlx_lm_greedy(target, prompt, length + 8)
    # one wrong token per round at a varied position (none in every fourth round): k of n accepted
    proposer = OracleProposer(reference, len(prompt), VOCAB, errors=lambda r: [] if r % 4 == 3 else [1 + r % 5], block_size=5)
    out, rounds = [], []
    for step in speculative_steps(target, proposer, prompt, sampler=Sampler(temperature=0.0)):
        out.extend(step.tokens)
        rounds.append((step.proposed, step.accepted))
        if len(out) >= length:
            break
    assert out[:length] == reference[:length]
    partial = sum(1 for proposed, accepted in rounds if 0 < proposed and accepted < proposed)
    assert partial >= len(rounds) // 2  # most rounds rolled something back


def run(target, prompt, cache, n=12):
    out = []
    for step in plain_steps(target, prompt, sampler=Sampler(temperature=0.0), prompt_cache=cache, prefill_step_size=16):
        out.extend(step.tokens)
        if len(out) >= n:
            break
    return out[:n]


def spec_run(target, prompt, cache, n=12):
    reference = mlx_lm_greedy(target, prompt, n + 8)
    proposer = OracleProposer(reference, len(prompt), VOCAB, errors=lambda r: [2], block_size=4)
    out = []
    for step in speculative_steps(target, proposer, prompt, sampler=Sampler(temperature=0.0), prompt_cache=cache):
        out.extend(step.tokens)
        if len(out) >= n:
            break
    return out[:n]


EDITS = {
    "extend": lambda p, o: p + o + [5, 6, 7],
    "rewind_2": lambda p, o: p + o[:-2] + [(o[-2] + 1) % VOCAB, 9],
    "rerender": lambda p, o: p + [(o[0] + 1) % VOCAB] + o[1:] + [4],
    "prompt_end_5": lambda p, o: p[:-5] + [(p[-5] + 1) % VOCAB, 2, 3, 4, 5, 6],
}
# what a resume reuses, from the held tokens and the previous prompt
EXPECTED_REUSE = {
    "extend": lambda held, prev: len(held),  # the live caches as they stand (nothing to roll back)
    "rewind_2": lambda held, prev: len(prev) - 1,  # the recurrent state cannot trim: the prompt-end snapshot
    "rerender": lambda held, prev: len(prev) - 1,
    "prompt_end_5": lambda held, prev: len(prev) - 1 - 4,  # the margin snapshot (margin 4)
}


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3_text", "nemotron_h", "falcon_h1"])
def test_multi_turn_prompt_cache_on_hybrids_equals_cold_runs(kind, edit):
    target = MlxLmTarget(kind)
    cache = PromptCache(target, snapshot_margin=4)
    prompt = [random.Random(9).randrange(VOCAB) for _ in range(30)]
    held, previous = (), None
    for turn in range(3):
        out = run(target, prompt, cache)
        assert out == run(target, prompt, PromptCache(target, max_snapshots=0)), f"turn {turn + 1}"
        if previous is not None:
            assert cache.cached_tokens == EXPECTED_REUSE[edit](held, previous), f"turn {turn + 1}"
        held, previous = cache.tokens, prompt
        prompt = EDITS[edit](prompt, out)
