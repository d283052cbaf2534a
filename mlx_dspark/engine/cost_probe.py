"""The verify schedule's cost curve for the loaded pair on this machine: measured once at first use
(`measure_cost_curve`, a quick interleaved probe of verify widths and a draft block) and cached on disk
under a key of the pair and the machine (`cost_curve_for`). Apart from `schedule.py` because it runs
the round's own prefill and proposer: the schedule stays below `decode`, the probe above it."""

from __future__ import annotations

import hashlib
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from mlx_dspark.engine.decode import prefill
from mlx_dspark.engine.propose import DraftProposer
from mlx_dspark.engine.schedule import CostCurve
from mlx_dspark.models.cache import trim_caches
from mlx_dspark.models.rollback import restore_caches, snapshot_caches

COST_CACHE_DIR = Path.home() / ".cache" / "mlx_dspark" / "cost"


def _machine() -> dict:
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


def cache_key(model: Any) -> str:
    """A hash of what the costs depend on: the pair (paths, configs, weight dtypes) and the machine."""
    from mlx.utils import tree_flatten

    dtypes = {
        name: sorted({str(v.dtype) for _, v in tree_flatten(module.parameters())})
        for name, module in (("target", model.target), ("draft", model.draft))
    }
    identity = {
        "target": str(Path(model.target_path).resolve()),
        "draft": str(Path(model.draft_path).resolve()) if model.draft_path else None,
        "target_config": model.target_config,
        "draft_config": model.draft_config,
        "dtypes": dtypes,
        "machine": _machine(),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cost_curve_for(
    model: Any,
    *,
    cache_dir: Path = COST_CACHE_DIR,
    measure: Callable[[Any, Any], CostCurve] | None = None,
) -> CostCurve:
    """The loaded pair's curve on this machine: read from `cache_dir`, else measured (`measure`) and written there."""
    path = cache_dir / f"{cache_key(model)}.json"
    if path.is_file():
        return CostCurve.from_file(path)
    curve = (measure or measure_cost_curve)(model.target, model.draft)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**curve.to_json(), "source": f"measured at first use, {time.strftime('%Y-%m-%d %H:%M')}"}))
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return CostCurve.from_file(path)


def measure_cost_curve(target: Any, draft: Any, *, context: int = 256, repeats: int = 3, seed: int = 0) -> CostCurve:
    """A quick curve: verify forwards of 1..block_size + 1 tokens and a draft block at `context` positions.

    Widths are interleaved in rotating order and each forward is rolled back, so the context stays put;
    medians over `repeats` after one untimed pass (kernel compilation, allocator growth).
    """
    block = int(draft.num_drafts)
    rng = random.Random(seed)
    vocab = target.args.vocab_size
    proposer = DraftProposer(draft, target, greedy=True, temperature=1.0)
    cache = target.make_cache()
    logits = prefill(target, cache, [rng.randrange(vocab) for _ in range(context)], tap_ids=proposer.tap_ids, proposer=proposer)
    anchor = mx.argmax(logits).astype(mx.int32).reshape(1)
    mx.eval(anchor)
    candidates = mx.array([[rng.randrange(vocab) for _ in range(block + 1)]], dtype=mx.int32)
    widths = list(range(1, block + 2))
    samples: dict[int, list[float]] = {w: [] for w in [0, *widths]}  # 0: the draft block
    for repeat in range(repeats + 1):
        rotation = repeat % len(widths)
        for width in [0, *widths[rotation:], *widths[:rotation]]:
            start = time.perf_counter()
            if width == 0:
                out = proposer.propose(anchor, position=context, num_tokens=block)
                mx.eval(out.tokens, *([] if out.confidence is None else [out.confidence]))
            else:
                saved = snapshot_caches(cache) if width == 1 else None  # a hybrid's width-1 step is not recorded
                if saved is not None:
                    mx.eval([a for s in saved for a in s.arrays()])
                    start = time.perf_counter()
                verify_logits, features = target(candidates[:, :width], cache=cache, tap_ids=proposer.tap_ids)
                mx.eval(mx.argmax(verify_logits, axis=-1), features)
                if saved is None:
                    trim_caches(cache, width)
                else:
                    restore_caches(cache, saved)
            if repeat:
                samples[width].append(1000 * (time.perf_counter() - start))
    return CostCurve.from_measurements(
        draft_ms=statistics.median(samples[0]),
        verify_ms=[statistics.median(samples[w]) for w in widths],
        source="measured at first use",
    )
