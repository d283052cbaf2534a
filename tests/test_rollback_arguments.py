"""A replayed layer call is cut to the kept prefix by what each argument is (its parameter name), not by
its shape: a family whose backbone hands every layer an extra per-position tensor shaped like an
attention mask (B, L, H, S) replays exactly (issue 33: it was cut as a mask, a broadcast error or, for
other shapes, a silently wrong state). The oracle is plain decoding of the kept tokens, one at a time."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import ArraysCache

from mlx_dspark.models.caches.rollback import RollbackCaches, recording

HIDDEN, HEADS, WIDTH = 16, 4, 4  # the extra tensor is (B, L, HEADS, HIDDEN): its last two axes look like (L, S)


class RecurrentLayer(nn.Module):
    """h_t = a * h_{t-1} + W x_t (a recurrent state in an ArraysCache), mixed with the extra tensor and
    masked per position by an SSM-style (B, L) mask."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.extra_proj = nn.Linear(HEADS * HIDDEN, HIDDEN, bias=False)

    def __call__(self, x: mx.array, extra: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
        u = self.in_proj(x) + self.extra_proj(extra.reshape(*extra.shape[:2], -1))
        if mask is not None:
            u = u * mask[..., None]
        state = cache[0] if cache[0] is not None else mx.zeros((x.shape[0], HIDDEN))
        outputs = []
        for t in range(x.shape[1]):
            state = 0.9 * state + u[:, t]
            outputs.append(state)
        cache[0] = state
        return x + mx.tanh(mx.stack(outputs, axis=1))


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, HIDDEN)
        self.extra = nn.Linear(HIDDEN, HEADS * HIDDEN, bias=False)
        self.layers = [RecurrentLayer() for _ in range(2)]

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        extra = self.extra(h).reshape(*h.shape[:2], HEADS, HIDDEN)  # handed to every layer, not a mask
        mask = mx.ones(inputs.shape, dtype=h.dtype)
        for layer, c in zip(self.layers, cache):
            h = layer(h, extra, mask, cache=c)
        return h


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Backbone()

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        return self.model(inputs, cache)

    @property
    def layers(self):
        return self.model.layers


def _states(caches) -> list[mx.array]:
    return [c[0] for c in caches]


@pytest.mark.parametrize("kept", [1, 2, 3])
def test_a_replay_cuts_each_argument_by_its_name(kept):
    mx.random.seed(0)
    model = Model()
    prompt, block = mx.array([[3, 9, 27, 5]]), mx.array([[11, 40, 2, 33]])
    assert block.shape[1] == WIDTH
    caches = RollbackCaches([ArraysCache(1) for _ in model.layers])
    model(prompt, cache=caches)  # a prompt's forward (not rolled back)
    with recording(model, caches):
        model(block, cache=caches)  # the verify
    caches.rollback(WIDTH - kept)

    plain = [ArraysCache(1) for _ in model.layers]
    model(prompt, cache=plain)
    for t in range(kept):
        model(block[:, t : t + 1], cache=plain)
    for got, want in zip(_states(caches), _states(plain)):
        assert mx.allclose(got, want, atol=1e-5).item()
