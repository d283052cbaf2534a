"""Packed forwards (models/packed/forward.py) for targets run through mlx-lm's own model class (models/target/mlx_lm.py).

mlx-lm's own `__call__` runs over T single-row sequences (input (T, 1)): its embeddings, projections, MLPs
/ MoE and norms see T rows, as in our families' packed forward. Each layer gets, instead of its cache, a
`PackedView` of the sequences' caches of that layer:
- `offset` is every row's position (T,): the family's `self.rope(q, offset=cache.offset)` rotates each
  row at its own position (`mx.fast.rope` takes an array offset);
- `make_mask(...)` (what mlx-lm's `create_attention_mask(h, cache)` calls) returns a `PackedMask`: the
  mask each sequence's own forward would build from its own cache at that point;
- `update_and_fetch(keys, values)` appends each sequence's rows to its own cache object (KVCache,
  RotatingKVCache, quantized: mlx-lm's own update) and keeps what each returns;
- the attention call, mlx-lm's `scaled_dot_product_attention(q, k, v, cache=, scale=, mask=)` imported by
  each model module, is replaced once per module by a dispatcher that passes every other call to the
  original and runs a packed call per sequence: its rows' queries over its own fetched keys / values
  with its own mask, through the original function (the call of that sequence's own forward). A layer
  that reuses an earlier layer's keys / values (gemma4's KV-shared layers) is recognised by them.
Taps and the final hidden state are recorded by the target's `Capture` as for a solo forward; the logits
of the needed rows come from mlx-lm's own head code (`model_head_logits`). Rollback stays each sequence's
`RollbackCaches`: the forward is recorded per sequence at that sequence's width (rotating caches keep
their state from before it), so `trim_caches` on one sequence's list is exact as after its own forward.

Recurrent layers (`ArraysCache`, or a `CacheList` holding one: GatedDeltaNet, Mamba, short convolutions)
carry a state along the sequence axis that single-row sequences cannot carry: the model's layer list is
swapped for stand-ins (`_PerSequence`). Such a layer runs packed except for its sub-module that takes the
recurrent cache (the mixer: GatedDeltaNet, ShortConv, Mamba), which runs once per sequence on that
sequence's rows (1, n, hidden), its own mask (`create_ssm_mask` of its own cache) and its own cache,
through its `RollbackCaches.call` (recorded for the replay a rollback runs): the call of the sequence's
own forward. Where that does not reproduce the rows' own forwards (the load-time probe), the layer's
cache is a `CacheList`, or two of its sub-modules take the cache (rwkv7's time and channel mixing: a replay
re-runs one recorded call per cache), the whole layer runs per sequence instead. Only the mixers lose the shared
matmuls; norms, MLPs, attention layers, the head and the draft stay packed. A family whose attention does
its own arithmetic on the mask or the fetched keys (gemma2's soft-capped scores written out, DeepSeek's
MLA adding its rotary scores to the mask) fails the probe packed; it is probed again with its attention
modules (every sub-module that takes a cache) run per sequence the same way ("attention" mode: each the
call of the sequence's own forward, so bitwise; the projections, MLPs and head stay packed). A family that
still fails (an `int` offset read outside the layers) is refused with its model_type and both reasons named,
never approximated.

`packed_views` is that set-up for any mlx-lm model: a draft model's chain steps use it too
(models/packed/lm_steps.py), with the same split modes (`choose_split_mode`) probed on the draft.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.cache import CacheList

from mlx_dspark.models.layers.base import check_tap_ids, gather_taps
from mlx_dspark.models.caches.kv import trim_caches
from mlx_dspark.models.target.mlx_lm import MLXLMTarget, feature_dtype
from mlx_dspark.models.caches.rollback import REPLAY, ROTATING, RollbackCaches, cache_kind, layer_owner


class PackedMask:
    """The attention mask of every sequence of a packed forward, as its own forward would build it."""

    def __init__(self, masks: list[Any]):
        self.masks = masks


class _Shape:
    """Stands in for a sequence's hidden states where mlx-lm's mask code reads only `h.shape[1]`."""

    def __init__(self, length: int):
        self.shape = (1, length)


class PackedView:
    """One layer's view of a packed forward: the sequences' own caches of that layer (see module docstring)."""

    def __init__(self, caches: Sequence[Any], lengths: Sequence[int], offset: mx.array, forward: "_Forward", lists: Sequence[Any]):
        self.caches, self.lengths, self.offset, self.forward = list(caches), list(lengths), offset, forward
        self.lists = list(lists)  # each sequence's whole cache list (its RollbackCaches records its layer calls)
        self.recurrent = cache_kind(self.caches[0]) == REPLAY  # the layer runs per sequence (_PerSequence)
        self.fetched: Optional[list[tuple[Any, Any]]] = None

    def make_mask(self, N: int = 1, *, return_array: bool = False, window_size: Optional[int] = None) -> PackedMask:
        if N != 1:
            raise ValueError(f"a packed forward's hidden states have 1 position per sequence row, not {N}")
        if self.recurrent:  # mlx-lm's `create_ssm_mask(h, cache)`
            return PackedMask([mlx_lm_base.create_ssm_mask(_Shape(n), c) for c, n in zip(self.caches, self.lengths)])
        return PackedMask([
            mlx_lm_base.create_attention_mask(_Shape(n), cache, window_size=window_size, return_array=return_array)
            for cache, n in zip(self.caches, self.lengths)
        ])  # fmt: skip

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys / values (T, Hkv, 1, D): each sequence's rows go to its own cache. Returns them as given
        (a layer may hand them to a later one); the attention takes each sequence's fetched ones."""
        self.fetched = [
            cache.update_and_fetch(_rows_as_sequence(keys, start, n), _rows_as_sequence(values, start, n))
            for cache, start, n in _spans(self.caches, self.lengths)
        ]
        self.forward.fetched[id(keys)] = (keys, self)
        return keys, values

    def __bool__(self) -> bool:
        return True

    def __getitem__(self, k: int) -> "PackedView":
        """A `CacheList` layer's k-th member, as a view (mlx-lm builds masks from a member's cache)."""
        return PackedView([c.caches[k] for c in self.caches], self.lengths, self.offset, self.forward, self.lists)


class _Forward:
    """What one packed forward shares between its layers: the keys each view returned, by identity."""

    def __init__(self) -> None:
        self.fetched: dict[int, tuple[mx.array, PackedView]] = {}


def _spans(caches: Sequence[Any], lengths: Sequence[int]):
    start = 0
    for cache, n in zip(caches, lengths):
        yield cache, start, n
        start += n


def _rows_as_sequence(a: mx.array, start: int, n: int) -> mx.array:
    """Packed rows (T, heads, 1, D) [start, start + n) as one sequence (1, heads, n, D)."""
    return a[start : start + n].transpose(2, 1, 0, 3)


def _dispatcher(original: Callable) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache=None, scale=1.0, mask=None, **kwargs):
        view = cache if isinstance(cache, PackedView) else None
        if view is None and isinstance(mask, PackedMask):  # a layer reusing an earlier layer's keys / values
            found = [f[1] for f in (forward.fetched.get(id(keys)) for forward in _CURRENT) if f is not None and f[0] is keys]
            if not found:
                raise ValueError("a packed attention call's keys come from no packed cache update")
            view = found[0]
            caches = [cache] * len(view.caches)
        elif view is None:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
        else:
            caches = view.caches
        if not isinstance(mask, PackedMask):
            raise ValueError(f"a packed attention call got a {type(mask).__name__} mask, not the sequences' own")
        outs = []
        for (k, v), c, m, (_, start, n) in zip(view.fetched, caches, mask.masks, _spans(view.caches, view.lengths)):
            out = original(_rows_as_sequence(queries, start, n), k, v, cache=c, scale=scale, mask=m, **kwargs)
            outs.append(out.transpose(2, 1, 0, 3))  # (n, heads, 1, D)
        return mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]

    scaled_dot_product_attention._dspark_packed = True
    return scaled_dot_product_attention


_CURRENT: list[_Forward] = []  # the packed forwards running now (keys are matched by identity)


def install_dispatch(model: Any) -> list[str]:
    """Route the attention calls of every module the model's layers come from through the dispatcher
    (once per module; other callers of the module see the original). Returns the modules' names; empty when
    no module of its layers calls mlx-lm's `scaled_dot_product_attention` by that name."""
    names = sorted({type(m).__module__ for layer in model.layers for _, m in layer.named_modules()})
    patched = []
    for name in names:
        module = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is None:
            continue
        if not getattr(current, "_dspark_packed", False):
            module.scaled_dot_product_attention = _dispatcher(current)
        patched.append(name)
    return patched


def per_sequence(module: Any, args: tuple, kwargs: dict, view: PackedView, what: str) -> Any:
    """`module(*args, **kwargs)` once per sequence on its rows, masks and caches (`_one`), each call
    through the sequence's `RollbackCaches` (recorded for replay) -> its outputs packed again (T, 1, ...).
    A tuple output (rwkv7's layers hand `v_first` on beside the hidden states) is packed item by item."""
    total, outs = sum(view.lengths), []
    for i, (lists, start, n) in enumerate(_spans(view.lists, view.lengths)):
        part = (i, start, n, total)
        call_args, call_kwargs = tuple(_one(a, *part) for a in args), {k: _one(v, *part) for k, v in kwargs.items()}
        out = lists.call(module, *call_args, **call_kwargs) if isinstance(lists, RollbackCaches) else module(*call_args, **call_kwargs)
        items = out if isinstance(out, tuple) else (out,)
        if not all(isinstance(o, mx.array) and o.shape[:2] == (1, n) for o in items):
            got = ", ".join(f"{type(o).__name__} {getattr(o, 'shape', '')}" for o in items)
            raise ValueError(f"{what} (recurrent) returned {got}, not one sequence's per-position arrays")
        outs.append([o.reshape(n, 1, *o.shape[2:]) for o in items])
    packed = [mx.concatenate(column, axis=0) if len(column) > 1 else column[0] for column in zip(*outs)]
    return tuple(packed) if isinstance(out, tuple) else packed[0]


def _split_view(args: tuple, kwargs: dict, mode: str) -> Optional[PackedView]:
    """The view of a call that runs per sequence: a recurrent cache's, or any cache's in "attention" mode."""
    view = next((v for v in (*args, *kwargs.values()) if isinstance(v, PackedView)), None)
    return view if view is not None and (view.recurrent or mode == "attention") else None


class _PerSequenceChild:
    """Stands in for a direct sub-module of a recurrent layer: the one that receives the recurrent cache
    (the mixer) runs per sequence; the others (norms, MLP, a CacheList layer's attention) run packed."""

    def __init__(self, module: Any, used: list, mode: str):
        self._module, self._used, self._mode = module, used, mode

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        view = _split_view(args, kwargs, self._mode)
        if view is None:
            return self._module(*args, **kwargs)
        if view.recurrent and self._used:  # a replay re-runs the one call recorded per cache (rwkv7's time + channel mixing)
            raise ValueError(f"more than one sub-module ({type(self._module).__name__} too) takes the layer's recurrent cache")
        self._used.append(view.recurrent)
        return per_sequence(self._module, args, kwargs, view, type(self._module).__name__)


class _PerSequence:
    """Stands in for one decoder layer in a packed forward. A layer with a recurrent cache (its state runs
    along the sequence) runs packed except for the sub-module that takes that cache, which runs once per
    sequence ("module" mode); or, where a family's layer does more with its cache or mask, the whole layer
    runs per sequence ("layer" mode). Either is the call of the sequence's own forward, recorded by its
    `RollbackCaches` for replay. Any other layer runs packed, except in "attention" mode (a family whose
    attention does its own arithmetic on the mask or the fetched keys: DeepSeek's MLA), where the
    sub-module that takes any cache runs per sequence. Attributes pass through to the layer."""

    def __init__(self, layer: Any, index: int, capture: Any, mode: str):
        self._layer, self._index, self._capture, self._mode = layer, index, capture, mode

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        view = _split_view(args, kwargs, self._mode)
        if view is None:
            return self._layer(*args, **kwargs)
        if self._mode != "layer" and not isinstance(view.caches[0], CacheList):  # a member is not recorded alone
            used: list = []
            children = [(k, m) for k, m in self._layer.items() if isinstance(m, nn.Module)]
            for key, child in children:
                self._layer[key] = _PerSequenceChild(child, used, self._mode)
            try:
                out = self._layer(*args, **kwargs)
            finally:
                for key, child in children:
                    self._layer[key] = child
            if not used:
                raise ValueError(f"layer {self._index}: no sub-module of it took its cache")
            return out
        out = per_sequence(self._layer, args, kwargs, view, f"layer {self._index}")
        capture = self._capture  # the per-sequence calls recorded per-sequence taps: the packed ones instead
        if capture is None:
            return out
        if self._index == 0 and -1 in capture.tap_ids:
            capture.taps[-1] = args[0]
        if self._index in capture.tap_ids:
            capture.taps[self._index] = out[0] if isinstance(out, tuple) else out
        return out


def _one(value: Any, i: int, start: int, n: int, total: int) -> Any:
    """Sequence i's part of a packed layer argument: its cache, its mask, its rows (1, n, ...)."""
    if isinstance(value, PackedView):
        return value.caches[i]
    if isinstance(value, PackedMask):
        return value.masks[i]
    if isinstance(value, mx.array) and value.ndim >= 2 and value.shape[:2] == (total, 1):
        return value[start : start + n].reshape(1, n, *value.shape[2:])
    return value


def _begin_recording(caches: Any, width: int) -> None:
    """Record a sequence's part of the forward for rollback, as its own forward through `recording` does."""
    if not isinstance(caches, RollbackCaches):
        return
    caches.begin_forward()
    hidden = mx.zeros((1, width))  # only its width is read; never evaluated
    for i, kind in enumerate(caches.kinds):
        if kind == ROTATING:  # REPLAY caches are recorded by their per-sequence layer calls (_PerSequence)
            caches.record(None, (hidden,), {"cache": caches[i]})


@contextmanager
def packed_views(model: Any, caches: Sequence[list], lengths: Sequence[int], *, name: str,
                 capture: Any = None) -> Iterator[list[PackedView]]:  # fmt: skip
    """Within it, mlx-lm's own `model(inputs (T, 1), cache=views)` is one packed forward: sequence i's
    `lengths[i]` rows over its own cache list `caches[i]` (the views, the attention dispatch, and the layer
    stand-ins of the split mode the model's probe chose). `name` says which model in an error; `capture`: a
    target's (the taps of layers run per sequence are recorded packed)."""
    offsets = [_first_offset(c) for c in caches]
    row_positions = mx.array([o + j for o, n in zip(offsets, lengths) for j in range(n)], dtype=mx.int32)
    forward = _Forward()
    views = [PackedView([c[i] for c in caches], lengths, row_positions, forward, caches) for i in range(len(caches[0]))]
    if not getattr(model, "_dspark_packed_dispatch", None):
        object.__setattr__(model, "_dspark_packed_dispatch", install_dispatch(model))
    mode = getattr(model, "_dspark_split_mode", "module")
    if not model._dspark_packed_dispatch and mode != "attention" and not all(view.recurrent for view in views):
        raise ValueError(
            f"{name}: its attention does not call mlx-lm's scaled_dot_product_attention, the call a packed forward splits per sequence"
        )
    for c, n in zip(caches, lengths):
        _begin_recording(c, n)
    owner = layer_owner(model)
    layers = owner["layers"]
    if mode == "attention" or any(view.recurrent for view in views):
        owner["layers"] = [_PerSequence(layer, i, capture, mode) for i, layer in enumerate(layers)]
    _CURRENT.append(forward)  # list.append / remove: atomic under the GIL
    try:
        yield views
    finally:
        _CURRENT.remove(forward)
        owner["layers"] = layers


def packed_mlx_lm_forward(
    target: MLXLMTarget,
    tokens: mx.array,
    caches: Sequence[list],
    lengths: Sequence[int],
    *,
    tap_ids: Sequence[int] = (),
    head_rows: Optional[Sequence[int]] = None,
) -> tuple[mx.array, Optional[mx.array]]:
    """models/packed.packed_target_forward for an mlx-lm target (same arguments and results)."""
    total = sum(lengths)
    tap_ids = check_tap_ids(tap_ids, target.args.num_hidden_layers, final=True)  # FINAL_TAP: a head reading the final state
    capture = target._capture
    capture.start("forward", tap_ids=tap_ids)
    try:
        with packed_views(target, caches, lengths, name=f"model_type {target.mlx_lm_model_type!r}", capture=capture) as views:
            super(MLXLMTarget, target).__call__(tokens.reshape(total, 1), cache=views)  # its logits: never evaluated
        final, taps, bad = capture.final, dict(capture.taps), capture.bad_output
    finally:
        capture.start("off")
    if bad or final is None:
        raise ValueError(f"model_type {target.mlx_lm_model_type!r}: the packed forward was not recorded ({bad})")
    if head_rows is not None:
        final = final[mx.array(list(head_rows), dtype=mx.int32)]
    logits = target.model_head_logits(final)  # (R, 1, V): mlx-lm's own head code
    features = gather_taps(taps, tap_ids, feature_dtype(target, taps[tap_ids[0]])) if tap_ids else None
    return logits[:, 0], None if features is None else features[:, 0]


def _first_offset(caches: Sequence[Any]) -> int:
    """The sequence's position: the offset of its first cache that has one (0 without any: recurrent only)."""
    for cache in caches:
        for c in getattr(cache, "caches", None) or (cache,):  # a CacheList's members
            if isinstance(getattr(c, "offset", None), int):
                return c.offset
    return 0


def target_packing_problem(target: MLXLMTarget) -> Optional[str]:
    """Why this mlx-lm target cannot run packed, or None (the answer is kept on the target). A target with
    recurrent layers is probed with only their cache-taking sub-module per sequence, else whole layers; a
    target whose attention fails packed (its own mask or key arithmetic) with its attention per sequence."""
    known = getattr(target, "_dspark_packing_problem", False)
    if known is not False:
        return known
    problem = choose_split_mode(target, lambda: probe_packing(target), target.make_cache)
    if problem is not None:
        problem = f"the target (model_type {target.mlx_lm_model_type!r}) {problem}"
    object.__setattr__(target, "_dspark_packing_problem", problem)
    return problem


def choose_split_mode(model: Any, probe: Callable[[], Optional[str]], make_cache: Callable[[], Any]) -> Optional[str]:
    """The first split mode under which `probe()` passes, kept on the model: "module" (only the sub-module
    that takes a recurrent cache per sequence), "layer" (whole recurrent layers), "attention" (every
    cache-taking sub-module). None, or what failed (the first mode's and the attention mode's reasons)."""
    object.__setattr__(model, "_dspark_split_mode", "module")
    problem = probe()
    if problem is not None and any(cache_kind(c) == REPLAY for c in make_cache()):
        object.__setattr__(model, "_dspark_split_mode", "layer")  # whole recurrent layers per sequence
        problem = probe()
    if problem is not None:
        object.__setattr__(model, "_dspark_split_mode", "attention")  # every cache-taking sub-module per sequence
        split = probe()
        problem = None if split is None else f"{problem}; with its attention per sequence it {split}"
    return problem


def probe_packing(target: MLXLMTarget, *, lengths: Sequence[int] = (3, 1, 2), tolerance: float = 1e-3) -> Optional[str]:
    """Run a short packed forward (sequences at different offsets), roll each sequence back its own number
    of rows and run one more, against each sequence's own forwards doing the same; what went wrong when it
    fails or differs (relative to the logits' scale), else None."""
    vocab = target.args.vocab_size
    prompts = [[(5 + 13 * i + 7 * j) % vocab for j in range(2 + i)] for i in range(len(lengths))]
    segments = [[(11 + 17 * i + 3 * j) % vocab for j in range(n)] for i, n in enumerate(lengths)]
    rejected = [n // 2 for n in lengths]
    try:
        solo, packed_caches = [], []
        for prompt, segment, back in zip(prompts, segments, rejected):
            cache = target.make_cache()
            target(mx.array(prompt)[None], cache=cache)
            logits, _ = target(mx.array(segment)[None], cache=cache)
            trim_caches(cache, back)
            again, _ = target(mx.array([segment[0]])[None], cache=cache)
            solo.extend([logits[0], again[0]])
            packed_caches.append(target.make_cache())
            target(mx.array(prompt)[None], cache=packed_caches[-1])
        tokens = mx.array([t for s in segments for t in s], dtype=mx.int32)
        packed, _ = packed_mlx_lm_forward(target, tokens, packed_caches, lengths)
        for cache, back in zip(packed_caches, rejected):
            trim_caches(cache, back)
        again, _ = packed_mlx_lm_forward(target, mx.array([s[0] for s in segments], dtype=mx.int32), packed_caches, [1] * len(lengths))
        reference = mx.concatenate(solo[0::2] + solo[1::2], axis=0)
        packed = mx.concatenate([packed, again], axis=0)
        worst = mx.max(mx.abs(packed - reference)).item() / max(mx.max(mx.abs(reference)).item(), 1e-6)
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError, AssertionError) as e:
        return f"fails in a packed forward ({type(e).__name__}: {e})"
    if not worst <= tolerance:
        return f"differs in a packed forward from its rows' own forwards (relative {worst:.2g})"
    return None
