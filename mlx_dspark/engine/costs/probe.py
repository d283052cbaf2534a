"""The cost curve of the loaded pair on this machine (for `auto` draft lengths and the confidence
schedule): measured once at first use (`measure_cost_curve`, a quick interleaved probe of verify widths
and a draft block at two context depths) and cached on disk under a key of the pair and the machine
(`cost_curve_for`), in `~/.cache/mlx_dspark/cost/` or `$MLX_DSPARK_COST_DIR`. Apart from `schedule.py`
because it runs the round's own prefill and proposer: the schedule stays below `decode`, the probe above it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from mlx_dspark.engine.costs.heal import write_cached  # noqa: F401  (the cache's one writer; callers import it from here)
from mlx_dspark.engine.round.decode import prefill
from mlx_dspark.engine.proposers import cost_kind, default_head, head_block, loaded_heads, proposer_module
from mlx_dspark.engine.proposers.base import CHAIN
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.costs.curve import CostCurve
from mlx_dspark.engine.proposers.lookup import LOOKUP_MAX_TOKENS
from mlx_dspark.models.caches.kv import trim_caches
from mlx_dspark.models.caches.rollback import TRIM, cache_kind

COST_CACHE_DIR = Path.home() / ".cache" / "mlx_dspark" / "cost"
COST_DIR_ENV = "MLX_DSPARK_COST_DIR"  # where the curves are cached instead, when set
SHALLOW_CONTEXT, DEEP_CONTEXT = 256, 1024  # the two depths a first-use measurement times
DEFAULT_BLOCK = 7  # verify widths 1..8 for a pair without a DSpark draft
# past the draft's widths, a few up to the longest lookup block (its anchor and LOOKUP_MAX_TOKENS): the
# round's choice between blocks of every width reads them, the widths between are interpolated
WIDE_WIDTHS = (12, 17, 25, LOOKUP_MAX_TOKENS + 1)


def cost_cache_dir() -> Path:
    """Where measured curves are cached: `$MLX_DSPARK_COST_DIR`, else `~/.cache/mlx_dspark/cost`."""
    return Path(os.environ[COST_DIR_ENV]) if os.environ.get(COST_DIR_ENV) else COST_CACHE_DIR


def machine() -> dict:
    """What the costs depend on besides the pair: host, device, MLX version, BLAS."""
    from importlib.metadata import version

    maps = Path("/proc/self/maps")
    blas = "openblas" if maps.is_file() and "libopenblas" in maps.read_text() else "default"
    return {
        "node": platform.node(),
        "machine": platform.machine(),
        "system": platform.system(),
        "device": str(mx.default_device()),
        "mlx": version("mlx"),
        "blas": blas,
    }


def _taps(proposer: DraftProposer | None) -> tuple:
    return () if proposer is None else proposer.tap_ids


def cache_key(model: Any, *, head: str = "draft") -> str:
    """A hash of what the costs depend on: the pair (paths, configs, weight dtypes), the draft head whose
    cost it holds (by its registry name; the block draft's key stays unnamed) and the machine."""
    from mlx.utils import tree_flatten

    head_module = model.heads.get(head)  # the head's own module (its precision)
    dtypes = {
        name: sorted({str(v.dtype) for _, v in tree_flatten(module.parameters())})
        for name, module in (("target", model.target), ("draft", head_module))
        if module is not None
    }
    draft_path, draft_config = model.head_source(head)
    identity = {
        "target": str(Path(model.target_path).resolve()),
        "draft": str(Path(draft_path).resolve()) if draft_path else None,
        "target_config": model.target_config,
        "draft_config": draft_config,
        "dtypes": dtypes,
        "machine": machine(),
        **({} if head == "draft" else {"head": head}),
    }
    group = getattr(model.target, "_split_group", None)  # a target split over ranks (models/distributed/split_target.py)
    if group is not None:
        identity["split_ranks"] = group.size()  # its costs are the group's, network included
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cost_curve_path(model: Any, cache_dir: Path | None = None, *, head: str = "draft") -> Path:
    """The file the loaded pair's curve on this machine is cached in."""
    return (cache_dir or cost_cache_dir()) / f"{cache_key(model, head=head)}.json"


def cost_curve_for(
    model: Any,
    *,
    cache_dir: Path | None = None,
    measure: Callable[[Any, Any], CostCurve] | None = None,
    head: str | None = None,
) -> CostCurve:
    """The loaded pair's curve on this machine for one draft head (default `default_head`): read from
    `cache_dir` (default `cost_cache_dir()`), else measured (`measure`, default `measure_cost_curve`, or
    `measure_chain_curve` for a head whose cost kind is a chain) and written there."""
    head = default_head(model) if head is None else head
    path = cost_curve_path(model, cache_dir, head=head)
    cache_dir = path.parent
    if not path.is_file():
        if cost_kind(head) == CHAIN:
            curve = (measure or measure_chain_curve)(model.target, model.heads[head], head=head)
        else:
            curve = (measure or measure_cost_curve)(model.target, model.heads.get(head))
        write_cached(path, {**curve.to_json(), "source": f"measured at first use, {time.strftime('%Y-%m-%d %H:%M')}",
                            "measured_at": time.time()})  # fmt: skip
    # cache_path: generations write what their rounds observed back here (engine/costs/heal.py)
    return dataclasses.replace(CostCurve.from_file(path), cache_path=path)


def measure_cost_curve(
    target: Any,
    draft: Any,
    *,
    context: int = SHALLOW_CONTEXT,
    deep_context: int | None = DEEP_CONTEXT,
    repeats: int = 3,
    seed: int = 0,
) -> CostCurve:
    """A quick curve: verify forwards of 1..block_size + 1 tokens, a few wider ones up to the longest lookup
    block (`WIDE_WIDTHS`, the widths between interpolated) and a draft block at `context` positions,
    then again at `deep_context` (None: one depth; kept within the target's positions), so the costs
    follow the context a generation reaches (`CostCurve.at`).

    Widths are interleaved in rotating order and each forward is rolled back, so the context stays put;
    the fastest of `repeats` after one untimed pass (kernel compilation, allocator growth).
    """
    block = DEFAULT_BLOCK if draft is None else int(draft.num_drafts)
    rng = random.Random(seed)
    vocab = target.args.vocab_size
    proposer = None if draft is None else DraftProposer(draft, target, greedy=True, temperature=1.0)
    cache = target.make_cache()
    limit = getattr(target.args, "max_position_embeddings", None) or 1 << 30
    widest = max(block + 1, *WIDE_WIDTHS)
    depths = [min(context, limit - widest - 1)]
    if deep_context is not None and min(deep_context, limit - widest - 1) > depths[0]:
        depths.append(min(deep_context, limit - widest - 1))
    candidates = mx.array([[rng.randrange(vocab) for _ in range(widest)]], dtype=mx.int32)
    curves, reached = [], 0
    for depth in depths:
        prompt = [rng.randrange(vocab) for _ in range(depth - reached)]
        logits = prefill(target, cache, prompt, tap_ids=_taps(proposer), proposer=proposer)
        reached = depth
        curve = _measure_at(target, proposer, cache, logits, candidates, block=block, depth=depth, repeats=repeats)
        curves.append(curve)
    if len(curves) == 2:
        return dataclasses.replace(curves[0], deep=curves[1])
    return curves[0]


def measure_chain_curve(
    target: Any, drafter: Any, *, head: str, context: int = SHALLOW_CONTEXT, repeats: int = 3, seed: int = 0,
    chain: int = 4,
) -> CostCurve:
    """The curve of a chained draft (`head`: a head whose cost kind is a chain, its proposer made by name;
    one that reads the target's caches gets the probe's): verify widths as a draft-less pair's, and the chain's cost from proposals of 1 and of `chain`
    drafts (interleaved, the fastest of `repeats`): `draft_step_ms` per further draft, `draft_ms` the rest
    of the first (one context depth)."""
    make = proposer_module(head).make_proposer
    base = measure_cost_curve(target, None, context=context, deep_context=None, repeats=repeats, seed=seed)
    rng = random.Random(seed + 1)
    depth = min(base.context, (getattr(target.args, "max_position_embeddings", None) or 1 << 30) - chain - 2)
    prompt = [rng.randrange(target.args.vocab_size) for _ in range(depth)]
    proposer = make(drafter, target, prompt=prompt, greedy=True, temperature=1.0, block_size=chain)
    cache = target.make_cache()
    logits = prefill(target, cache, prompt, tap_ids=proposer.tap_ids, proposer=proposer)
    anchor = mx.argmax(logits).astype(mx.int32).reshape(1)
    proposer.commit([int(anchor.item())])
    extra = {"target_cache": cache} if proposer.takes_target_cache else {}
    samples: dict[int, list[float]] = {1: [], chain: []}
    for repeat in range(repeats + 1):
        for k in (1, chain) if repeat % 2 else (chain, 1):
            start = time.perf_counter()
            mx.eval(proposer.propose(anchor, position=depth, num_tokens=k, **extra).tokens)
            if repeat:
                samples[k].append(1000 * (time.perf_counter() - start))
    one, full = min(samples[1]), min(samples[chain])
    step = max(0.0, (full - one) / max(chain - 1, 1))
    return dataclasses.replace(base, draft_ms=max(0.0, one - step), draft_step_ms=step, source=f"measured at first use ({head} chain)")


def _measure_at(
    target: Any, proposer: DraftProposer | None, cache: list, logits: mx.array, candidates: mx.array, *, block: int,
    depth: int, repeats: int,
) -> CostCurve:
    """One depth's curve; without a draft (a target-only pair: lookup proposers) the draft block costs 0."""
    context = depth
    anchor = mx.argmax(logits).astype(mx.int32).reshape(1)
    mx.eval(anchor)
    widths = [*range(1, block + 2), *(w for w in WIDE_WIDTHS if w > block + 1)]
    samples: dict[int, list[float]] = {w: [] for w in [0, *widths]}  # 0: the draft block
    for repeat in range(repeats + 1):
        rotation = repeat % len(widths)
        for width in [*([] if proposer is None else [0]), *widths[rotation:], *widths[:rotation]]:
            start = time.perf_counter()
            if width == 0:
                out = proposer.propose(anchor, position=context, num_tokens=block)
                mx.eval(out.tokens, *([] if out.confidence is None else [out.confidence]))
            else:
                verify_logits, features = target(candidates[:, :width], cache=cache, tap_ids=_taps(proposer))
                mx.eval(mx.argmax(verify_logits, axis=-1), *([] if features is None else [features]))
                undo_timed_forward(cache, width)  # a hybrid's width-1 step stays: the context moves on by one
            if repeat:
                samples[width].append(1000 * (time.perf_counter() - start))
    # The fastest of the interleaved repeats: load from other processes only ever adds time, so on a
    # busy machine the minimum is closer to the forwards' own cost than the median.
    return CostCurve.from_measurements(
        draft_ms=min(samples[0]) if samples[0] else 0.0,
        verify_ms=interpolated({w: min(samples[w]) for w in widths}),
        source="measured at first use",
    ).with_context(depth)


def interpolated(measured: dict[int, float]) -> list[float]:
    """Verify times of widths 1 .. the widest measured, linear between the measured widths."""
    widths = sorted(measured)
    out = []
    for low, high in zip(widths, widths[1:]):
        out += [measured[low] + (measured[high] - measured[low]) * (w - low) / (high - low) for w in range(low, high)]
    return out + [measured[widths[-1]]]


def undo_timed_forward(caches: Any, width: int) -> None:
    """After a forward of `width` tokens timed by a cost probe: trimmed away, except a hybrid's width-1
    step (never recorded), which stays: the context moves on by one position as a plain step's would.
    (A snapshot restore instead could not be followed by the ranks of a split target: they roll back by
    trimming, models/distributed/split_target.py.)"""
    if width == 1 and not all(cache_kind(c) == TRIM for c in caches):
        return
    trim_caches(caches, width)
