"""The prompt cache: multi-turn generations resumed from a cache are token-identical to cold runs.

Tiny float32 targets (spark window 16: three sliding layers and a full one; qwen3 all-full, and qwen3
with sliding layers of window 12) and drafts (sliding window 4, or one sliding and one full layer).
Conversations are built at the token level: each next prompt is an edit of the previous history
(prompt + output): extended, rewound by a few / more than 8 / more than the window, with the reply
re-rendered, with the previous prompt's end changed, or diverging at once.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

import mlx_dspark
from mlx_dspark.engine.round.decode import plain_steps, speculative_steps
from mlx_dspark.engine.prompt_cache import PromptCache, common_prefix
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.logits.sample import Sampler
from tests.engine_helpers import make_draft, make_target, qwen3_config

OUT = 16  # tokens generated per turn
VOCAB = 96  # engine_helpers' tiny vocabulary; the last id is the draft's mask token


@pytest.fixture(scope="module")
def models():
    spark = make_target("spark2_5", seed=3)
    qwen = make_target("qwen3", seed=3)
    return {
        "spark": (spark, None),
        "spark+draft": (spark, make_draft(spark, seed=1, window=12)),
        "qwen3": (qwen, None),
        "qwen3+mixed-draft": (qwen, make_draft(qwen, seed=1, layer_types=["sliding_attention", "full_attention"])),
    }


class RecordingProposer(DraftProposer):
    """The draft proposer, keeping every proposed block: equal blocks mean equal draft contexts."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.blocks: list[list[int]] = []

    def propose(self, anchor, *, position, num_tokens):
        proposal = super().propose(anchor, position=position, num_tokens=num_tokens)
        self.blocks.append(proposal.tokens[0].tolist())
        return proposal


def run(target, draft, prompt, n=OUT, *, cache=None, temperature=0.0, step_size=512, blocks=None):
    """The first n tokens of a generation; the consumer then stops (the generator is closed).

    With a draft, the proposed blocks are appended to `blocks` when given.
    """
    sampler = Sampler(temperature=temperature)
    if draft is None:
        steps = plain_steps(target, prompt, sampler=sampler, prompt_cache=cache, prefill_step_size=step_size)
    else:
        context = None if cache is None else cache.draft_context
        proposer = RecordingProposer(
            draft, target, greedy=sampler.greedy, temperature=max(temperature, 1e-6), context=context
        )
        proposer.blocks = proposer.blocks if blocks is None else blocks
        steps = speculative_steps(
            target, proposer, prompt, sampler=sampler, prompt_cache=cache, prefill_step_size=step_size
        )
    out: list[int] = []
    for step in steps:
        out.extend(step.tokens)
        if len(out) >= n:
            break
    steps.close()
    return out[:n]


def diverging(history: list[int], at: int, seed: int, count: int = 5) -> list[int]:
    """`count` new tokens, the first one different from history[at] (so the prompts really diverge there)."""
    rng = random.Random(seed)
    new = [rng.randrange(VOCAB - 1) for _ in range(count)]
    if at < len(history) and new[0] == history[at]:
        new[0] = (new[0] + 1) % (VOCAB - 1)
    return new


def edit(kind: str, prompt: list[int], out: list[int], seed: int) -> list[int]:
    history = prompt + out
    keep = {
        "extend": len(history),
        "rewind_3": len(history) - 3,
        "rewind_12": len(history) - 12,  # more than the 8 positions a sliding layer rolls back
        "rewind_40": len(history) - 40,  # more than the window, back into the prompt
        "prompt_end_5": len(prompt) - 5,  # the previous generation prompt re-rendered
        "early": 3,
    }
    if kind == "rerender":  # the reply re-rendered differently (its first token changed)
        return prompt + [(out[0] + 1) % (VOCAB - 1)] + out[1:] + diverging(history, len(history), seed)
    return history[: keep[kind]] + diverging(history, keep[kind], seed)


EDITS = ["extend", "rewind_3", "rewind_12", "rewind_40", "rerender", "prompt_end_5", "early"]


@pytest.mark.parametrize("edit_kind", EDITS)
@pytest.mark.parametrize("pair", ["spark", "spark+draft", "qwen3", "qwen3+mixed-draft"])
def test_three_turn_greedy_conversation_with_a_reused_cache_is_identical_to_cold_runs(models, pair, edit_kind):
    target, draft = models[pair]
    step_size = 8 if "draft" in pair else 512  # chunked prefills that cross the window, too
    cache = PromptCache(target, draft)
    prompt = [random.Random(7).randrange(VOCAB - 1) for _ in range(40)]  # longer than every window
    for turn in range(3):
        expected_reuse = cache.reusable(prompt, speculative=draft is not None)
        held = cache.tokens
        warm_blocks, cold_blocks = [], []
        out = run(target, draft, prompt, cache=cache, step_size=step_size, blocks=warm_blocks)
        assert out == run(target, draft, prompt, step_size=step_size, blocks=cold_blocks), f"turn {turn + 1}"
        assert warm_blocks == cold_blocks  # the resumed draft context is the cold one: same proposals
        assert cache.cached_tokens == expected_reuse
        assert cache.cached_tokens <= min(common_prefix(held, prompt), len(prompt) - 1)
        if turn > 0 and edit_kind in ("extend", "rewind_3", "rewind_12", "rerender"):
            assert cache.cached_tokens > 0  # these never diverge before the previous prompt's end snapshot
        prompt = edit(edit_kind, prompt, out, seed=turn)


# Exact reuse: 40-token prompt, 16-token reply, then the edit.
EXACT = [
    ("spark", "extend", lambda p: p + OUT),  # the plain loop's cache holds the whole history
    ("spark", "rewind_3", lambda p: p - 1),  # rotating windows roll back only their latest forward: the snapshot
    ("spark", "rewind_12", lambda p: p - 1),  # too far for them: the snapshot at the prompt's end
    ("spark", "rerender", lambda p: p - 1),
    ("spark", "prompt_end_5", lambda p: p - 1 - 16),  # the margin snapshot
    ("spark", "early", lambda p: 0),  # before every snapshot: cold
    ("qwen3", "rewind_40", lambda p: p + OUT - 40),  # full layers trim any amount
    ("qwen3", "early", lambda p: 3),
    ("spark+draft", "rewind_12", lambda p: p - 1),
    ("spark+draft", "rerender", lambda p: p - 1),
    ("qwen3+mixed-draft", "prompt_end_5", lambda p: p - 1 - 16),
]


@pytest.mark.parametrize("pair,edit_kind,expected", EXACT)
def test_cached_tokens_is_the_exactly_servable_prefix(models, pair, edit_kind, expected):
    target, draft = models[pair]
    cache = PromptCache(target, draft)
    prompt = [random.Random(11).randrange(VOCAB - 1) for _ in range(40)]
    out = run(target, draft, prompt, cache=cache)
    second = edit(edit_kind, prompt, out, seed=1)
    warm_blocks, cold_blocks = [], []
    assert run(target, draft, second, cache=cache, blocks=warm_blocks) == run(target, draft, second, blocks=cold_blocks)
    assert warm_blocks == cold_blocks
    assert cache.cached_tokens == expected(len(prompt))


def kept_rows(cache) -> list[tuple[mx.array, mx.array]]:
    """(keys, values) each layer can still attend to: the last `window - 1` rows of windowed layers, or all."""
    rows = []
    for layer in cache.target_cache:
        if isinstance(layer, RotatingKVCache):  # in position order, the rows the next query can see
            keep = min(layer.offset, layer.max_size - 1)
            keys, values = (layer._temporal_order(a)[..., -keep:, :] for a in (layer.keys, layer.values))
        else:
            keys, values = (a[..., : layer.offset, :] for a in (layer.keys, layer.values))
        rows.append((keys, values))
    for ctx in cache.draft_context or []:
        rows.append(ctx.fetch() or (mx.zeros((0,)), mx.zeros((0,))))
    return rows


@pytest.mark.parametrize("edit_kind", EDITS)
@pytest.mark.parametrize("pair", ["spark+draft", "qwen3+mixed-draft"])
def test_a_resumed_cache_holds_the_same_keys_and_values_as_a_cold_prefill(models, pair, edit_kind):
    # Right after the prefill, while restored rows are still inside every window (the draft's
    # context rows never affect the output, only the proposals, so compare them directly).
    target, draft = models[pair]
    warm, cold = PromptCache(target, draft), PromptCache(target, draft)
    prompt = [random.Random(3).randrange(VOCAB - 1) for _ in range(40)]
    out = run(target, draft, prompt, cache=warm)
    second = edit(edit_kind, prompt, out, seed=5)
    run(target, draft, second, n=1, cache=warm)
    run(target, draft, second, n=1, cache=cold)
    assert warm.tokens == cold.tokens == tuple(second)
    for (wk, wv), (ck, cv) in zip(kept_rows(warm), kept_rows(cold), strict=True):
        assert wk.shape == ck.shape and wv.shape == cv.shape
        assert mx.allclose(wk, ck, atol=1e-5).item() and mx.allclose(wv, cv, atol=1e-5).item()


def test_snapshots_past_a_rewound_position_are_never_restored(models):
    target, _ = models["spark"]
    cache = PromptCache(target)
    first = list(range(1, 41))
    run(target, None, first, cache=cache)  # snapshots at 23 and 39
    second = first[:35] + list(range(60, 70))
    run(target, None, second, cache=cache)  # resumes at 23; 39 now belongs to the old suffix
    assert cache.cached_tokens == 23
    third = second[:42] + [90, 91, 92]
    assert run(target, None, third, cache=cache) == run(target, None, third)
    assert cache.cached_tokens == 28  # the second prompt's margin snapshot, not the stale one at 39


@pytest.mark.parametrize("pair", ["spark", "spark+draft", "qwen3+mixed-draft"])
def test_resending_the_same_prompt_prefills_only_its_last_token(models, pair):
    target, draft = models[pair]
    cache = PromptCache(target, draft)
    prompt = list(range(3, 43))
    first_blocks, again_blocks = [], []
    first = run(target, draft, prompt, cache=cache, blocks=first_blocks)
    assert run(target, draft, prompt, cache=cache, blocks=again_blocks) == first
    assert again_blocks == first_blocks
    assert cache.cached_tokens == len(prompt) - 1


@pytest.mark.parametrize("edit_kind", ["extend", "rewind_12", "prompt_end_5"])
@pytest.mark.parametrize("pair", ["spark", "spark+draft", "qwen3+mixed-draft"])
def test_sampled_generation_with_a_reused_cache_equals_a_cold_run_with_the_same_seed(models, pair, edit_kind):
    target, draft = models[pair]
    cache = PromptCache(target, draft)
    prompt = list(range(50, 90))
    mx.random.seed(0)
    out = run(target, draft, prompt, cache=cache, temperature=1.0)
    second = edit(edit_kind, prompt, out, seed=2)
    mx.random.seed(1)
    warm = run(target, draft, second, cache=cache, temperature=1.0)
    assert cache.cached_tokens > 0
    mx.random.seed(1)
    assert warm == run(target, draft, second, temperature=1.0)


def test_the_cache_holds_exactly_what_the_target_processed(models):
    target, draft = models["spark"]
    cache = PromptCache(target)
    prompt = list(range(1, 30))
    out = run(target, None, prompt, n=10, cache=cache)
    assert cache.tokens == tuple(prompt + out)  # plain decoding queued the last token before yielding it

    target, draft = models["spark+draft"]
    cache = PromptCache(target, draft)
    out = run(target, draft, prompt, n=10, cache=cache)
    held = cache.tokens
    # the last anchor is not in the caches; a round cut by the consumer may hold tokens past the output
    assert held[: len(prompt) + 9] == tuple(prompt + out[:9])
    assert all(c.offset == len(held) for c in cache.target_cache + cache.draft_context)


def test_a_second_generation_on_the_same_cache_stops_the_first(models):
    target, _ = models["spark"]
    cache = PromptCache(target)
    first = plain_steps(target, list(range(1, 20)), sampler=Sampler(), prompt_cache=cache)
    next(first)
    run(target, None, list(range(1, 25)), n=5, cache=cache)
    with pytest.raises(RuntimeError, match="another generation resumed this prompt cache"):
        next(first)


class FailingTarget:
    """Delegates to a target and raises on its `fail_at`-th forward (a failure in the middle of a step)."""

    def __init__(self, target, fail_at: int):
        self.target, self.fail_at, self.calls = target, fail_at, 0

    def make_cache(self):
        return self.target.make_cache()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return self.target(*args, **kwargs)


def test_a_failure_inside_a_step_makes_the_next_resume_cold(models):
    target, _ = models["spark"]
    failing = FailingTarget(target, fail_at=6)  # prefill (3 segments), then the third decoding step
    cache = PromptCache(failing)
    prompt = list(range(1, 30))
    with pytest.raises(RuntimeError, match="injected failure"):
        run(failing, None, prompt, cache=cache)
    second = prompt + [5, 6, 7]
    assert cache.reusable(second, speculative=False) == 0
    assert run(failing, None, second, cache=cache) == run(target, None, second)
    assert cache.cached_tokens == 0


def test_switching_between_plain_and_speculative_generation_restarts_cold(models):
    target, draft = models["spark+draft"]
    cache = PromptCache(target, draft)
    prompt = list(range(1, 30))
    out = run(target, draft, prompt, cache=cache)
    second = prompt + out + [1, 2, 3]
    assert run(target, None, second, cache=cache) == run(target, None, second)
    assert cache.cached_tokens == 0
    third = second + [4, 5]
    assert run(target, draft, third, cache=cache) == run(target, draft, third)
    assert cache.cached_tokens == 0
    assert all(c.offset == len(cache.tokens) for c in cache.draft_context)


def test_memory_of_sliding_state_and_snapshots_stays_bounded_as_the_conversation_grows(models):
    target, draft = models["spark+draft"]
    cache = PromptCache(target, draft, max_snapshots=3)
    prompt = list(range(1, 21))
    sizes, sliding_sizes = [], []
    for turn in range(8):  # about 10 windows long at the end
        out = run(target, draft, prompt, n=12, cache=cache)
        full = sum(c.nbytes for c in cache.target_cache if isinstance(c, KVCache))
        sizes.append(cache.nbytes)
        sliding_sizes.append(cache.nbytes - full)
        prompt = prompt + out + [turn + 1] * 4
    assert sizes[-1] > sizes[0]  # the full layer grows with the conversation

    window, bytes_per_row = 16, 2 * 2 * 16 * 4  # keys + values, 2 KV heads x 16 dims, float32
    sliding_layers = sum(isinstance(c, RotatingKVCache) for c in cache.target_cache)
    assert sliding_layers > 0
    draft_row = 2 * draft.args.layers.num_key_value_heads * draft.args.layers.head_dim * 4
    # mlx-lm's rotating cache keeps its window, plus the rest of a verify's block until the next update
    live = sliding_layers * (window + 8) * bytes_per_row + len(cache.draft_context) * (3 + 256) * draft_row
    snapshots = 3 * (sliding_layers * (window + 8) * bytes_per_row + len(cache.draft_context) * 3 * draft_row)
    assert max(sliding_sizes) <= live + snapshots


def test_misuse_is_refused_with_the_fix(models):
    target, draft = models["spark+draft"]
    other, _ = models["qwen3"]
    cache = PromptCache(target, draft)
    with pytest.raises(ValueError, match="another target model"):
        run(other, None, [1, 2, 3], cache=cache)
    foreign = DraftProposer(draft, target, greedy=True, temperature=1.0)
    with pytest.raises(ValueError, match="context=prompt_cache.draft_context"):
        next(speculative_steps(target, foreign, [1, 2, 3], sampler=Sampler(), prompt_cache=cache))
    with pytest.raises(ValueError, match="max_snapshots"):
        PromptCache(target, max_snapshots=-1)


def test_api_prompt_cache_reuses_a_conversation_and_reports_cached_tokens(tiny_spark_pair):
    model = mlx_dspark.load(str(tiny_spark_pair[0]), draft=str(tiny_spark_pair[1]))
    cache = mlx_dspark.make_prompt_cache(model)
    first_prompt = model.tokenizer.encode("The first turn of a conversation, longer than the window of sixteen.")
    first = mlx_dspark.generate(model, first_prompt, max_tokens=12, prompt_cache=cache)
    assert first.cached_tokens == 0
    second_prompt = first_prompt + first.tokens + model.tokenizer.encode(" And a second question?")
    warm = mlx_dspark.generate(model, second_prompt, max_tokens=12, prompt_cache=cache)
    cold = mlx_dspark.generate(model, second_prompt, max_tokens=12)
    assert warm.tokens == cold.tokens
    assert warm.cached_tokens == cache.cached_tokens >= len(first_prompt) - 1
    assert cold.cached_tokens == 0
    steps = list(mlx_dspark.stream_generate(model, second_prompt, max_tokens=4, prompt_cache=cache))
    assert all(s.cached_tokens == len(second_prompt) - 1 for s in steps)


def test_prompt_tps_counts_only_the_prefilled_tokens(tiny_spark_pair):
    model = mlx_dspark.load(str(tiny_spark_pair[0]), draft=str(tiny_spark_pair[1]))
    cache = mlx_dspark.make_prompt_cache(model)
    prompt = model.tokenizer.encode("A prompt re-sent as it was: only its last token is prefilled again.")
    mlx_dspark.generate(model, prompt, max_tokens=4, prompt_cache=cache)
    again = mlx_dspark.generate(model, prompt, max_tokens=4, prompt_cache=cache)
    assert again.cached_tokens == len(prompt) - 1 > 20
    # prompt_tps x time to first token is the number of tokens it counted: 1 here, not the whole prompt.
    assert again.prompt_tps * again.time_to_first_token == pytest.approx(1, rel=0.5)
