"""One chained drafter step for the rows of several sequences at once.

A batch's chained rows each hold their own drafter cache, at their own length. A chain step takes one
row per sequence (b, 1, C); this runs the drafter's own `__call__` over those rows with, as its cache
list, one `PackedView` per drafter layer (models/packed/mlx_lm.py: each row's position as the offset,
each row's own mask): its norms, projections, MLP / MoE and head see the b rows at once, and only its
attention modules, the sub-modules that update a cache, run once per row on that row's (1, 1, C) input,
own mask and own cache: the call of that row's own step, so a packed step is bitwise each row's own on a
BLAS whose rows are independent (checked once per drafter by `chain_packing_problem`, never assumed).

The attention modules are found once per drafter (`_consumers`): one step on a throwaway cache with every
sub-module wrapped by a recorder, the innermost one running when a cache's `update_and_fetch` is called.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.models.packed.mlx_lm import PackedView, _Forward, per_sequence


class _Recorder:
    """Stands in for one sub-module during the trace: keeps the stack of running sub-modules."""

    def __init__(self, module: Any, path: tuple, stack: list):
        self._module, self._path, self._stack = module, path, stack

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._stack.append(self._path)
        try:
            return self._module(*args, **kwargs)
        finally:
            self._stack.pop()


class _TracedCache:
    """A throwaway cache that notes which sub-module updates it (the top of the recorders' stack)."""

    def __init__(self, cache: Any, stack: list, found: set):
        self._cache, self._stack, self._found = cache, stack, found

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        if self._stack:
            self._found.add(self._stack[-1])
        return self._cache.update_and_fetch(keys, values)


def _slots(module: Any, path: tuple = ()):
    """Every sub-module below `module` as (its container, key, sub-module, path); lists of modules included."""
    for key, child in list(module.items()):
        if isinstance(child, nn.Module):
            yield module, key, child, (*path, key)
            yield from _slots(child, (*path, key))
        elif isinstance(child, list):
            for i, item in enumerate(child):
                if isinstance(item, nn.Module):
                    yield child, i, item, (*path, key, i)
                    yield from _slots(item, (*path, key, i))


def _swap(module: Any, make: Callable[[Any, tuple], Any], paths: set | None = None) -> list:
    """Put `make(sub-module, path)` in place of the sub-modules at `paths` (None: all): the undo list."""
    undo = [(container, key, child, path) for container, key, child, path in _slots(module) if paths is None or path in paths]
    for container, key, child, path in undo:
        container[key] = make(child, path)
    return undo


def _restore(undo: list) -> None:
    for container, key, child, _ in reversed(undo):
        container[key] = child


def _consumers(module: Any, step: Callable[[list], mx.array], make_cache: Callable[[], list]) -> set:
    """The paths of the sub-modules that update a cache in one `step(caches)` (kept on the module)."""
    known = getattr(module, "_dspark_chain_consumers", None)
    if known is not None:
        return known
    stack: list = []
    found: set = set()
    undo = _swap(module, lambda child, path: _Recorder(child, path, stack))
    try:
        mx.eval(step([_TracedCache(c, stack, found) for c in make_cache()]))
    finally:
        _restore(undo)
    object.__setattr__(module, "_dspark_chain_consumers", found)
    return found


class _PerRow:
    """Stands in for an attention module in a packed step: a call with a `PackedView` runs once per row."""

    def __init__(self, module: Any):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        view = next((v for v in (*args, *kwargs.values()) if isinstance(v, PackedView)), None)
        if view is None:
            return self._module(*args, **kwargs)
        return per_sequence(self._module, args, kwargs, view, type(self._module).__name__)


def packed_chain_step(module: Any, step: Callable[[list], mx.array], caches: Sequence[list], *,
                      make_cache: Callable[[], list]) -> mx.array:
    """`step(cache_list)` (the drafter's own step over inputs (b, 1, ...)) for b rows, row i over its own
    cache list `caches[i]` (each as long as its row's chain): its output (b, 1, C). `make_cache` gives a
    throwaway cache list for finding the drafter's attention modules once."""
    consumers = _consumers(module, step, make_cache)
    if not consumers:
        raise ValueError(f"{type(module).__name__}: no sub-module of the drafter updates its cache")
    offsets = mx.array([c[0].offset for c in caches], dtype=mx.int32)
    shared = _Forward()
    views = [PackedView([c[j] for c in caches], [1] * len(caches), offsets, shared, caches) for j in range(len(caches[0]))]
    stand_ins = _swap(module, lambda child, path: _PerRow(child), consumers)
    try:
        return step(views)
    finally:
        _restore(stand_ins)


def chain_packing_problem(module: Any, step: Callable[[mx.array, mx.array, list], mx.array], *, width: int,
                          vocab: int, make_cache: Callable[[], list], tolerance: float = 1e-3) -> str | None:
    """Why the drafter's chain steps cannot run packed, or None (kept on the module): three rows whose
    caches hold 1, 3 and 2 chained entries take one more step packed and each alone; they must agree
    (relative to the outputs' scale; bitwise on this CPU). `step(token_ids (b, 1), hidden (b, 1, C), caches)`."""
    known = getattr(module, "_dspark_chain_problem", False)
    if known is not False:
        return known
    entries = (1, 3, 2)

    def filled() -> list[list]:
        sets = []
        for i, n in enumerate(entries):
            caches = make_cache()
            for j in range(n):
                mx.eval(step(_probe_ids(i + j, vocab, 1), _probe_hidden(i + j, width, 1), caches))
            sets.append(caches)
        return sets

    ids, hidden = _probe_ids(7, vocab, len(entries)), _probe_hidden(7, width, len(entries))
    try:
        alone = mx.concatenate([step(ids[i : i + 1], hidden[i : i + 1], c) for i, c in enumerate(filled())], axis=0)
        packed = packed_chain_step(module, lambda c: step(ids, hidden, c), filled(), make_cache=make_cache)
        worst = mx.max(mx.abs(packed - alone)).item() / max(mx.max(mx.abs(alone)).item(), 1e-6)
        problem = None if worst <= tolerance else f"a packed chain step differs from its rows' own steps (relative {worst:.2g})"
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError, AssertionError) as e:
        problem = f"a packed chain step fails ({type(e).__name__}: {e})"
    if problem is not None:
        problem = f"the {type(module).__name__} drafter: {problem}"
    object.__setattr__(module, "_dspark_chain_problem", problem)
    return problem


def _probe_ids(seed: int, vocab: int, rows: int) -> mx.array:
    return mx.array([[(11 + 17 * seed + 5 * r) % vocab] for r in range(rows)], dtype=mx.int32)  # (rows, 1)


def _probe_hidden(seed: int, width: int, rows: int) -> mx.array:
    values = mx.sin(mx.arange(rows * width, dtype=mx.float32) * 0.37 + seed)
    return values.reshape(rows, 1, width)  # (rows, 1, C)
