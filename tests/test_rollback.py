"""Exact rollback for every cache kind (issue 25): RollbackCaches against plain one-token decoding.

For each tiny mlx-lm model (mlx-lm's own `__call__`, random float32 weights): a prompt, then rounds of
"verify [anchor, n random drafts] -> keep k + 1 -> trim_caches(n - k)". A second set of caches decodes the
same kept tokens, in one update or one token at a time. After every round the caches' states must be
equal, and so must the logits (the verify's kept rows against the reference's, row 0 being the first
computed on the rolled-back caches). Bitwise, except where mlx-lm's own kernels depend on the update's
width (ONE_BY_ONE_ATOL / BLOCK_ATOL below, relative and absolute): with MLX's CPU kernels a row of a
matmul does not depend on the other rows, and GatedDeltaNet and the short conv step the same way
whatever the width.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from mlx_dspark.models.caches.kv import trim_caches
from mlx_dspark.models.caches.rollback import REPLAY, ROTATING, TRIM, RollbackCaches, cache_kind, recording
from mlx_dspark.testing.mlx_lm_models import FACTORIES, VOCAB, make_mlx_lm_cache, tiny_mlx_lm_model


def cache_state(cache) -> list[mx.array]:
    """What the next decode step can see: the arrays that matter, in position order."""
    if isinstance(cache, CacheList):
        return [a for c in cache.caches for a in cache_state(c)] + [mx.array(0)]
    if isinstance(cache, ArraysCache):
        return list(cache.cache)
    if isinstance(cache, RotatingKVCache):
        # The next query sees the newest max_size - 1 positions and itself; the buffer layout may differ.
        rows = min(cache.offset, cache.max_size - 1)
        keys = cache._temporal_order(cache.keys)[..., -rows:, :]
        values = cache._temporal_order(cache.values)[..., -rows:, :]
        return [keys, values, mx.array(cache.offset)]
    if isinstance(cache, QuantizedKVCache):
        return [a[..., : cache.offset, :] for a in (*cache.keys, *cache.values)] + [mx.array(cache.offset)]
    return [cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :], mx.array(cache.offset)]


def same(a: mx.array, b: mx.array, atol: float) -> bool:
    if a.shape != b.shape:
        return False
    return mx.array_equal(a, b).item() if atol == 0 else mx.allclose(a, b, rtol=atol, atol=atol).item()


def assert_same_caches(caches, reference, where: str, atol: float = 0.0) -> None:
    for i, (cache, ref) in enumerate(zip(caches, reference)):
        got, want = cache_state(cache), cache_state(ref)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert same(a, b, atol), f"{where}: cache {i} ({type(cache).__name__}) differs"


def run_rounds(kind: str, *, one_by_one: bool, atol: float = 0.0, rounds: int = 8, seed: int = 0, naive: bool = False) -> None:
    """Verify / keep / roll back, against decoding the kept tokens (in one update, or one by one)."""
    model = tiny_mlx_lm_model(kind)
    rng = np.random.default_rng(seed)
    caches = RollbackCaches(make_mlx_lm_cache(kind, model))
    reference = make_mlx_lm_cache(kind, model)
    prompt = mx.array(rng.integers(0, VOCAB, (1, 11)))
    with recording(model, caches):
        model(prompt, cache=caches)
    model(prompt, cache=reference)
    anchor = int(rng.integers(0, VOCAB))
    for r in range(rounds):
        num_draft = int(rng.integers(1, 6))
        keep = int(rng.integers(0, num_draft)) if r % 3 else num_draft  # partial rejections, sometimes none
        drafts = rng.integers(0, VOCAB, num_draft).tolist()
        with recording(model, caches):
            verify_logits = model(mx.array([[anchor, *drafts]]), cache=caches)
        if naive:  # what mlx-lm's trim does: offsets only
            for cache in caches:
                if cache.is_trimmable():
                    cache.trim(num_draft - keep)
        else:
            assert trim_caches(caches, num_draft - keep) == num_draft - keep
        kept = [anchor, *drafts[:keep]]
        if one_by_one:
            logits = mx.concatenate([model(mx.array([[t]]), cache=reference) for t in kept], axis=1)
        else:
            logits = model(mx.array([kept]), cache=reference)
        where = f"{kind} round {r} (kept {keep + 1} of {num_draft + 1})"
        assert_same_caches(caches, reference, where, atol)
        # Row 0 is the anchor's: the first logits computed on the caches the previous rollback left.
        assert same(verify_logits[:, : keep + 1], logits, atol), f"{where}: logits differ"
        anchor = int(rng.integers(0, VOCAB))


EXPECTED_KINDS = {
    "qwen3_5": {REPLAY, TRIM},
    "qwen3_5_moe": {REPLAY, TRIM},
    "lfm2": {REPLAY, TRIM},
    "qwen3_next": {REPLAY, TRIM},
    "mamba2": {REPLAY},
    "nemotron_h": {REPLAY, TRIM},
    "falcon_h1": {REPLAY},
    "gemma3_text": {ROTATING, TRIM},
    "gemma4_text": {ROTATING, TRIM},
    "llama_quantized": {TRIM},
}


# One-token decoding differs from any wider update in the last bits for two kernel paths of mlx-lm's
# own (measured max |diff| over these rounds, logits of magnitude ~1-4, in benchmarks/RESULTS.md):
# Mamba-2's SSD scan (`ssm_attn`) sums a block in matrix form, and a RotatingKVCache's in-place path
# keeps positions rotated, so attention sums them in another order than after a wide update.
# The verify itself computes its kept rows over the concatenated layout; so, past a wrapped window,
# gemma3_text matches a one-position update only to that tolerance (the rotating cache alone is checked
# bitwise below, where no arithmetic depends on the layout).
ONE_BY_ONE_ATOL = {"mamba2": 1e-4, "nemotron_h": 1e-4, "falcon_h1": 1e-4, "gemma3_text": 1e-4, "gemma4_text": 1e-4}  # rtol and atol
BLOCK_ATOL = {"gemma3_text": 1e-4, "gemma4_text": 1e-4}


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_rollback_equals_decoding_the_kept_tokens_in_one_update(kind):
    model = tiny_mlx_lm_model(kind)
    assert {cache_kind(c) for c in make_mlx_lm_cache(kind, model)} == EXPECTED_KINDS[kind]
    run_rounds(kind, one_by_one=False, atol=BLOCK_ATOL.get(kind, 0.0))


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_rollback_equals_one_token_decoding(kind):
    run_rounds(kind, one_by_one=True, atol=ONE_BY_ONE_ATOL.get(kind, 0.0))


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "mamba2", "lfm2", "nemotron_h", "falcon_h1", "gemma3_text", "gemma4_text"])
def test_offset_only_trim_is_caught(kind):
    # The witness can fail: mlx-lm's trim (offsets only, ArraysCache untouched) diverges, beyond the tolerance too.
    with pytest.raises(AssertionError):
        run_rounds(kind, one_by_one=True, atol=ONE_BY_ONE_ATOL.get(kind, 0.0), naive=True)


def _rotating_layer(x, cache):  # a "layer" (B, L, D) whose cache update is its input: keys = values = x
    return cache.update_and_fetch(x[:, None], x[:, None])


@pytest.mark.parametrize("prefill, num_draft, keep", [(3, 4, 2), (9, 4, 0), (9, 4, 1), (9, 4, 3), (12, 6, 4), (5, 2, 1)])
def test_rotating_rollback_is_exact_after_the_window_wrapped(prefill, num_draft, keep):
    rng = np.random.default_rng(prefill * 100 + num_draft * 10 + keep)
    rows = mx.array(rng.standard_normal((1, prefill + num_draft + 1 + 3, 2)).astype(np.float32))
    caches, one_by_one = RollbackCaches([RotatingKVCache(max_size=5)]), RotatingKVCache(max_size=5)
    caches.begin_forward()
    caches.call(_rotating_layer, rows[:, :prefill], cache=caches[0])
    for t in range(prefill):
        _rotating_layer(rows[:, t : t + 1], one_by_one)
    verify = rows[:, prefill : prefill + num_draft + 1]
    caches.begin_forward()
    caches.call(_rotating_layer, verify, cache=caches[0])
    trim_caches(caches, num_draft - keep)
    for t in range(prefill, prefill + keep + 1):
        _rotating_layer(rows[:, t : t + 1], one_by_one)
    assert_same_caches(caches, [one_by_one], "rotating")
    # and decoding goes on from there exactly (mlx-lm's trim would leave the rejected keys visible)
    for t in range(prefill + keep + 1, rows.shape[1]):
        for cache in (caches[0], one_by_one):
            _rotating_layer(rows[:, t : t + 1], cache)
        assert_same_caches(caches, [one_by_one], f"rotating, step {t}")


def test_rotating_cache_has_wrapped():
    model = tiny_mlx_lm_model("gemma3_text")
    caches = make_mlx_lm_cache("gemma3_text", model)
    model(mx.zeros((1, 11), mx.int32), cache=caches)
    rotating = [c for c in caches if isinstance(c, RotatingKVCache)]
    assert rotating and all(c.offset > c.max_size for c in rotating)  # the prompt alone wraps the window


def test_rollback_limits_are_clear_errors():
    model = tiny_mlx_lm_model("qwen3_5")
    caches = RollbackCaches(model.make_cache())
    with recording(model, caches):
        model(mx.zeros((1, 4), mx.int32), cache=caches)
    assert caches.trimmable() == 4
    with pytest.raises(ValueError, match="cannot roll back 5 positions"):
        trim_caches(caches, 5)
    trim_caches(caches, 2)
    assert caches.trimmable() == 2  # the rest of the same forward can still go
    with recording(model, caches):
        model(mx.zeros((1, 1), mx.int32), cache=caches)  # plain decoding: not recorded
    assert caches.trimmable() == 0
    with pytest.raises(ValueError, match="cannot roll back 1 positions"):
        trim_caches(caches, 1)


def test_two_rollbacks_of_one_forward_equal_one():
    model = tiny_mlx_lm_model("gemma3_text")
    one, two = (RollbackCaches(model.make_cache()) for _ in range(2))
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]])
    for caches, steps in ((one, [4]), (two, [1, 3])):
        with recording(model, caches):
            model(tokens[:, :9], cache=caches)
        with recording(model, caches):
            model(tokens[:, 9:], cache=caches)
        for n in steps:
            trim_caches(caches, n)
    assert_same_caches(one, two, "rolled back 4 at once or 1 then 3")


def test_unknown_cache_kind_is_refused_by_name():
    class OddCache:
        pass

    with pytest.raises(ValueError, match="no exact rollback is known for the cache type OddCache"):
        RollbackCaches([KVCache(), OddCache()])


def test_mlx_lm_rotating_trim_is_not_exact_after_the_wrap():
    # Why ROTATING exists: the same scenario with mlx-lm's own trim leaves rejected keys visible.
    rows = mx.array(np.random.default_rng(1).standard_normal((1, 16, 2)).astype(np.float32))
    trimmed, one_by_one = RotatingKVCache(max_size=5), RotatingKVCache(max_size=5)
    _rotating_layer(rows[:, :9], trimmed)
    _rotating_layer(rows[:, 9:14], trimmed)
    trimmed.trim(3)
    for t in range(11):
        _rotating_layer(rows[:, t : t + 1], one_by_one)
    with pytest.raises(AssertionError):
        for t in range(11, 16):
            for cache in (trimmed, one_by_one):
                _rotating_layer(rows[:, t : t + 1], cache)
            assert_same_caches([trimmed], [one_by_one], f"step {t}")


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "lfm2", "nemotron_h", "falcon_h1"])
def test_replay_with_the_verify_projections_equals_recomputing_them(kind, monkeypatch):
    # The replay takes its projections' rows from the verify; recomputing them gives the same bits here.
    from mlx_dspark.models.caches import rollback

    model = tiny_mlx_lm_model(kind)
    rng = np.random.default_rng(5)
    reused, recomputed = RollbackCaches(model.make_cache()), RollbackCaches(model.make_cache(), reuse_projections=False)
    hits = []
    original = rollback._Projection.__call__

    def counting(self, x):
        if not self.record and self.outputs and self.outputs[0][0] is self.module:
            hits.append(1)
        return original(self, x)

    monkeypatch.setattr(rollback._Projection, "__call__", counting)
    prompt = mx.array(rng.integers(0, VOCAB, (1, 9)))
    for caches in (reused, recomputed):
        with recording(model, caches):
            model(prompt, cache=caches)
    for r in range(5):
        tokens = mx.array(rng.integers(0, VOCAB, (1, 5)))
        for caches in (reused, recomputed):
            with recording(model, caches):
                model(tokens, cache=caches)
            trim_caches(caches, 1 + r % 4)
        assert_same_caches(reused, recomputed, f"{kind} round {r}")
    assert hits  # the verify's rows were used


def test_a_list_of_trimmable_cache_lists_trims_like_mlx_lm():
    # deepseek_v32 / longcat_flash keep CacheList(KVCache, KVCache) per layer: offsets move back, nothing recorded.
    caches = RollbackCaches([CacheList(KVCache(), KVCache()) for _ in range(2)])
    for layer in caches:
        for c in layer.caches:
            c.update_and_fetch(mx.zeros((1, 1, 5, 4)), mx.zeros((1, 1, 5, 4)))
    assert caches.trimmable() == 5
    assert trim_caches(caches, 2) == 2
    assert [c.offset for layer in caches for c in layer.caches] == [3, 3, 3, 3]


def test_a_forward_without_begin_forward_is_caught_before_a_wrong_rollback():
    model = tiny_mlx_lm_model("qwen3_5")
    caches = RollbackCaches(model.make_cache())
    with recording(model, caches):
        model(mx.zeros((1, 4), mx.int32), cache=caches)
    model(mx.zeros((1, 4), mx.int32), cache=caches)  # not recorded: the snapshots are stale now
    with pytest.raises(AssertionError, match="every forward must call begin_forward"):
        trim_caches(caches, 2)
