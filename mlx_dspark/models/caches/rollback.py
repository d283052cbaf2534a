"""Exact rollback of every mlx-lm cache kind: `RollbackCaches`, the target's cache list for speculation.

A verify runs `[anchor, x1..xn]` through the target and keeps the first `k + 1` positions. Afterwards every
cache must hold what plain decoding of those `k + 1` tokens would have left. Per cache kind:
- `KVCache`, `QuantizedKVCache`, `ConcatenateKVCache`, `ChunkedKVCache`: move the
  offset back (`trim`), as before;
- `RotatingKVCache` (sliding windows): mlx-lm's `trim` only moves offsets and, once the window wrapped,
  leaves the rejected keys visible and the oldest kept ones dropped. We keep the cache's state from before
  the forward (references: a forward wider than one position builds new buffers) and on rollback restore
  it and append the kept positions' keys / values again, taken from the verify's own buffers;
- `ArraysCache` (GatedDeltaNet recurrent + conv states, Mamba / Mamba-2 states, LFM2's short-conv states)
  and a `CacheList` holding one: the state cannot be rewound. We keep its arrays from before the forward
  (references: the mlx-lm layers assign new arrays, never write into old ones) and record the layer's call
  (its input hidden states and arguments); on rollback the state is restored and only that layer is run
  again on the kept prefix of its recorded input. Exact: a layer's cache update depends only on its input
  and its previous state, and by causality the kept prefix's inputs are those of plain decoding.
  (Measured against re-running the whole model on the kept tokens: benchmarks/RESULTS.md, issue 25.)

How a target uses it: `make_cache` returns `RollbackCaches(model.make_cache())`; each forward calls
`caches.begin_forward()` first and runs every decoder layer as `caches.call(layer, *args, **kwargs)`
(or runs mlx-lm's own `__call__` inside `with recording(model, caches):`, which does both). Calls are
matched to caches by the cache object the layer receives, so layers without a cache (nemotron_h's MLP /
MoE blocks) cost nothing. `trim_caches(caches, n)` (models/caches/kv.py) calls `caches.rollback(n)`.

Only the latest forward can be rolled back through caches that cannot trim (`trimmable()` says how far,
at most that forward's width); a forward wider than `max_record` positions (a prefill chunk) is not
recorded. Longer rewinds (the prompt cache) restore a `layer_state` snapshot instead.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)


TRIMMABLE = (KVCache, QuantizedKVCache, ConcatenateKVCache, ChunkedKVCache)
TRIM, ROTATING, REPLAY = "trim", "rotating", "replay"


def cache_kind(cache: Any) -> str:
    """How `cache` rolls back: TRIM (move the offset), ROTATING (restore and re-append), REPLAY (restore, re-run)."""
    if isinstance(cache, TRIMMABLE):
        return TRIM
    if isinstance(cache, RotatingKVCache):
        return ROTATING
    if isinstance(cache, ArraysCache):
        return REPLAY
    if isinstance(cache, CacheList):
        # A layer with several caches, one of which cannot trim, is restored whole and run again.
        return TRIM if all(cache_kind(c) == TRIM for c in cache.caches) else REPLAY
    raise ValueError(
        f"no exact rollback is known for the cache type {type(cache).__name__}; "
        f"supported: {', '.join(t.__name__ for t in (*TRIMMABLE, RotatingKVCache, ArraysCache, CacheList))}"
    )


# -- a cache's state at one position ---------------------------------------------------------------


@dataclass
class LayerState:
    """What one layer's cache needs to go back to a position: arrays / rotating state, or a trimmable offset."""

    kind: type
    state: Any  # ArraysCache: its arrays; RotatingKVCache: its `state`; trimmable: its offset; CacheList: [LayerState]

    @property
    def nbytes(self) -> int:
        if self.kind is CacheList:
            return sum(s.nbytes for s in self.state)
        if self.kind is ArraysCache:
            return sum(a.nbytes for a in self.state if a is not None)
        if self.kind is RotatingKVCache:
            keys, values = self.state[:2]
            return 0 if keys is None else keys.nbytes + values.nbytes
        return 0

    def arrays(self) -> list[mx.array]:
        if self.kind is CacheList:
            return [a for s in self.state for a in s.arrays()]
        if self.kind is ArraysCache:
            return [a for a in self.state if a is not None]
        if self.kind is RotatingKVCache:
            return [a for a in self.state[:2] if a is not None]
        return []


def layer_state(cache: Any, *, copy: bool = False) -> LayerState:
    """The state of one layer's cache now. `copy`: rotating buffers copied (a width-1 update writes into them)."""
    if isinstance(cache, CacheList):
        return LayerState(CacheList, [layer_state(c, copy=copy) for c in cache.caches])
    if isinstance(cache, ArraysCache):
        assert cache.left_padding is None and cache.lengths is None, "batched (padded) caches are not rolled back"
        return LayerState(ArraysCache, list(cache.cache))
    if isinstance(cache, RotatingKVCache):
        keys, values, *rest = cache.state
        if copy and keys is not None:
            keys, values = mx.array(keys), mx.array(values)
        return LayerState(RotatingKVCache, (keys, values, *rest))
    return LayerState(type(cache), cache.offset)


def restore_layer(cache: Any, saved: LayerState, *, copy: bool = False) -> None:
    """Put `cache` back to `saved` (in place: the model holds the cache objects). Trimmable caches are trimmed.

    `copy`: rotating buffers are copied, so that a later width-1 update (written in place) leaves `saved` intact.
    """
    if isinstance(cache, CacheList):
        for c, s in zip(cache.caches, saved.state):
            restore_layer(c, s, copy=copy)
    elif isinstance(cache, ArraysCache):
        cache.cache = list(saved.state)
    elif isinstance(cache, RotatingKVCache):
        keys, values, *rest = saved.state
        if copy and keys is not None:
            keys, values = mx.array(keys), mx.array(values)
        cache.state = (keys, values, *rest)
    else:
        assert cache.offset >= saved.state, "a trimmable cache cannot go forward"
        cache.trim(cache.offset - saved.state)


# -- rollback of the latest forward ----------------------------------------------------------------


@dataclass
class _Forward:
    """The latest forward, as far as rollback needs it."""

    width: int  # positions it added
    kept: int  # of those, still in the caches
    recorded: bool  # snapshots and calls were taken (width <= max_record)
    before: dict[int, LayerState]  # cache index -> its state before the forward (ROTATING / REPLAY caches)
    calls: dict[int, tuple[Any, tuple, dict]]  # cache index -> (layer, args, kwargs) (REPLAY caches)
    new_rows: dict[int, tuple[mx.array, mx.array]]  # ROTATING: the forward's own keys / values, in order
    projections: dict[int, list[tuple[Any, mx.array]]]  # REPLAY: the layer's projection outputs, in call order


class RollbackCaches(list):
    """A target's per-layer caches (a list, as mlx-lm's models expect) whose `rollback(n)` is exact for every kind.

    See the module docstring for the protocol: `begin_forward()`, then `call(layer, ...)` per layer.
    """

    def __init__(self, caches: Sequence[Any], *, max_record: int = 64, reuse_projections: bool = True):
        super().__init__(caches)
        self.kinds = [cache_kind(c) for c in caches]
        self.max_record = max_record
        self.reuse_projections = reuse_projections
        self._index = {id(c): i for i, c in enumerate(caches)}
        self._forward: _Forward | None = None
        self._start: list[int | None] = []  # the caches' offsets when the latest forward began

    @property
    def exact_trim_only(self) -> bool:
        return all(kind == TRIM for kind in self.kinds)

    # -- the forward ---------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A new forward starts: forget the previous one (it can no longer be rolled back)."""
        self._forward = None
        self._start = [_offset(c) for c in self]

    def call(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        """Run `layer(*args, **kwargs)`, recording what rollback needs when it updates one of these caches."""
        index = self.record(layer, args, kwargs)
        if index is None or not self.reuse_projections or index not in self._forward.calls:
            return layer(*args, **kwargs)
        outputs = self._forward.projections.setdefault(index, [])
        with _projections(layer, outputs, record=True):
            return layer(*args, **kwargs)

    def record(self, layer: Any, args: tuple, kwargs: dict) -> int | None:
        """Before `layer(*args, **kwargs)` runs: keep its cache's state and (for REPLAY caches) the call.

        Returns the index of the cache the call updates, or None (no cache of ours, or a trimmable one).
        """
        index = self._cache_index(args, kwargs)
        if index is None or self.kinds[index] == TRIM:
            return None
        width = _hidden(args, kwargs).shape[1]
        if self._forward is None:
            # Width 1 is plain decoding: nothing of it is ever rolled back, and rotating buffers are
            # written in place then (a snapshot would have to copy them).
            self._forward = _Forward(width, width, 1 < width <= self.max_record, {}, {}, {}, {})
        forward = self._forward
        assert width == forward.width, "a layer ran on another width than the forward's first layer: call begin_forward"
        if not forward.recorded or index in forward.before:
            return index
        forward.before[index] = layer_state(self[index])  # references: wider updates build new buffers
        if self.kinds[index] == REPLAY:
            forward.calls[index] = (layer, args, kwargs)
        return index

    def _cache_index(self, args: tuple, kwargs: dict) -> int | None:
        for value in (kwargs.get("cache"), *args, *kwargs.values()):
            index = self._index.get(id(value))
            if index is not None and value is self[index]:
                return index
        return None

    # -- rollback --------------------------------------------------------------------------------

    def trimmable(self) -> int:
        """How many positions `rollback` can remove now."""
        limits = [_trim_limit(c) for c in self]
        if not self.exact_trim_only:
            forward = self._forward
            limits.append(forward.kept if forward is not None and forward.recorded else 0)
        limit = min(limits, default=0)
        return 0 if limit == float("inf") else int(limit)

    def rollback(self, n: int) -> int:
        """Remove the last `n` positions from every cache, exactly (or none: ValueError)."""
        if n < 0:
            raise ValueError(f"rollback: n must be >= 0, got {n}")
        if n == 0:
            return 0
        if n > self.trimmable():
            raise ValueError(f"rollback: cannot roll back {n} positions; these caches can roll back {self.trimmable()} now")
        if self.exact_trim_only:
            for cache in self:
                cache.trim(n)
            return n
        forward = self._forward
        moved = [i for i, c in enumerate(self) if self._start[i] is not None and _offset(c) != self._start[i] + forward.kept]
        assert not moved, f"caches {moved} moved since the recorded forward: every forward must call begin_forward"
        kept = forward.kept - n
        for i, cache in enumerate(self):
            if self.kinds[i] == TRIM:
                cache.trim(n)
            elif self.kinds[i] == ROTATING:
                self._rollback_rotating(i, kept)
            else:
                self._replay(i, kept)
        forward.kept = kept
        return n

    def _rollback_rotating(self, i: int, kept: int) -> None:
        forward, cache = self._forward, self[i]
        if i not in forward.new_rows:  # first rollback of this forward: its keys / values, oldest first
            forward.new_rows[i] = _newest(cache, forward.width)
        restore_layer(cache, forward.before[i])
        if kept:
            # mlx-lm's own update of the kept positions. One position goes through its in-place path, which
            # writes into the buffers: those are `before`'s, so copy them first (a later rollback of this
            # forward restores `before` again). More positions go through the concatenating path.
            if kept == 1:
                cache.keys, cache.values = mx.array(cache.keys), mx.array(cache.values)
            keys, values = forward.new_rows[i]
            cache.update_and_fetch(keys[..., :kept, :], values[..., :kept, :])

    def _replay(self, i: int, kept: int) -> None:
        forward = self._forward
        restore_layer(self[i], forward.before[i])
        if kept:
            layer, args, kwargs = forward.calls[i]
            args, kwargs = _prefix_call(layer, args, kwargs, forward.width, kept)
            if i in forward.projections:
                with _projections(layer, list(forward.projections[i]), record=False, width=forward.width, kept=kept):
                    layer(*args, **kwargs)
            else:
                layer(*args, **kwargs)


def _trim_limit(cache: Any) -> float:
    """How far `trim` alone may move this cache back (inf: it does not bound a rollback by itself)."""
    if isinstance(cache, CacheList):
        return min((_trim_limit(c) for c in cache.caches), default=float("inf"))
    if isinstance(cache, ChunkedKVCache):
        return cache.offset - cache.start_position
    return getattr(cache, "offset", float("inf"))


def _offset(cache: Any) -> int | None:
    if isinstance(cache, CacheList):
        return next((o for o in map(_offset, cache.caches) if o is not None), None)
    return getattr(cache, "offset", None)


def _newest(cache: RotatingKVCache, width: int) -> tuple[mx.array, mx.array]:
    keys = cache._temporal_order(cache.keys)[..., -width:, :]
    values = cache._temporal_order(cache.values)[..., -width:, :]
    return keys, values


def _hidden(args: tuple, kwargs: dict) -> mx.array:
    """A decoder layer's input hidden states: its first positional argument (mlx-lm's layers all take it first)."""
    if args and isinstance(args[0], mx.array):
        return args[0]
    for name in ("x", "h", "hidden_states", "inputs"):
        if isinstance(kwargs.get(name), mx.array):
            return kwargs[name]
    raise ValueError("RollbackCaches.record: the layer's input hidden states are not its first argument")


def _prefix_call(layer: Any, args: tuple, kwargs: dict, width: int, kept: int) -> tuple[tuple, dict]:
    """The recorded call cut to its first `kept` positions, each argument by its parameter name (a tensor
    handed from layer to layer can have a mask's shape): `*mask*` by mask rules, other (B, L, ...) arrays
    on their position axis, anything else as it was."""
    names = _parameter_names(layer, len(args))

    def cut(value: Any, name: str) -> Any:
        if isinstance(value, (tuple, list)):  # (cos, sin) position embeddings and the like
            return type(value)(cut(v, name) for v in value)
        if not isinstance(value, mx.array) or value.ndim < 2:
            return value
        if "mask" in name.lower() and (value.ndim >= 3 or value.shape[-2] == width and value.shape[-1] > width):
            rows = value[..., :kept, :] if value.shape[-2] == width else value  # (..., L, offset + L)
            return rows[..., : value.shape[-1] - width + kept]
        return value[:, :kept] if value.shape[1] == width else value  # (B, L, ...): per position, an SSM mask

    return tuple(cut(a, names[i] if i < len(names) else "") for i, a in enumerate(args)), {k: cut(v, k) for k, v in kwargs.items()}


def _parameter_names(layer: Any, count: int) -> list[str]:
    """A layer's first `count` positional parameter names (its class's own `__call__`, past a recording
    subclass's `(*args, **kwargs)`)."""
    for cls in type(layer).__mro__:
        call = cls.__dict__.get("__call__")
        if call is None:
            continue
        try:
            parameters = list(inspect.signature(call).parameters.values())[1:]  # past self
        except (TypeError, ValueError):
            continue
        named = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if named or not any(p.kind == p.VAR_POSITIONAL for p in parameters):
            return named[:count]
    return []


# -- the verify's own projections, reused by a replay ----------------------------------------------
# A replay's cost is mostly its input projections (weights read once more for k + 1 rows). A projection
# (nn.Linear / QuantizedLinear) maps each position on its own, so on the kept prefix it gives the
# verify's own rows: the replay takes them from the verify instead of recomputing them.


class _Projection:
    """Stands in for one projection of a layer during a recorded call or its replay."""

    def __init__(self, module: Any, outputs: list, record: bool, width: int, kept: int):
        self.module, self.outputs, self.record, self.width, self.kept = module, outputs, record, width, kept

    def __call__(self, x: mx.array) -> mx.array:
        if self.record:
            y = self.module(x)
            self.outputs.append((self.module, y))
            return y
        # Replay: the same projections are called in the same order; anything unexpected is computed.
        if self.outputs and self.outputs[0][0] is self.module:
            _, y = self.outputs.pop(0)
            if x.ndim >= 2 and x.shape[1] == self.kept and y.shape[1] == self.width and y.shape[0] == x.shape[0]:
                return y[:, : self.kept]
        return self.module(x)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


@contextmanager
def _projections(layer: Any, outputs: list, *, record: bool, width: int = 0, kept: int = 0) -> Iterator[None]:
    """Within it, the layer's projections record their outputs (record) or hand back the recorded rows."""
    swapped = []
    for _, parent in layer.named_modules():
        for key, child in list(parent.items()):
            if isinstance(child, (nn.Linear, nn.QuantizedLinear)):
                swapped.append((parent, key, child))
                parent[key] = _Projection(child, outputs, record, width, kept)
    try:
        yield
    finally:
        for parent, key, child in swapped:
            parent[key] = child


# -- running mlx-lm's own __call__ with recording --------------------------------------------------


class _RecordedLayer:
    """Stands in for one decoder layer during a forward: records, then calls it (attributes pass through)."""

    def __init__(self, layer: Any, caches: RollbackCaches):
        self._layer, self._caches = layer, caches

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._caches.call(self._layer, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def layer_owner(model: Any) -> Any:
    """The module whose `layers` list the model's `__call__` iterates (model.model, model.backbone, ...)."""
    first = model.layers[0]
    pending = [model]
    while pending:
        module = pending.pop(0)
        layers = module.get("layers") if isinstance(module, dict) else None
        if isinstance(layers, list) and any(layer is first for layer in layers):  # a pipeline stage: None before its own
            return module
        pending.extend(v for v in (module.values() if isinstance(module, dict) else ()) if isinstance(v, dict))
    raise ValueError(f"cannot find the decoder layer list of {type(model).__name__}")


@contextmanager
def recording(model: Any, caches: Any) -> Iterator[None]:
    """Within it, `model(inputs, cache=caches)` (mlx-lm's own __call__) is one recorded forward."""
    if not isinstance(caches, RollbackCaches):
        yield
        return
    owner = layer_owner(model)
    layers = owner["layers"]
    caches.begin_forward()
    owner["layers"] = [None if layer is None else _RecordedLayer(layer, caches) for layer in layers]
    try:
        yield
    finally:
        owner["layers"] = layers
