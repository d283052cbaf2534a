"""What a pair's draft showed in earlier generations, kept beside its cost curve (issue 39).

A new generation's length policy (draft_length.AutoLength) starts from a prior acceptance. Without a
memory that prior is a guess, so a policy that parks by it takes one free look (a probe) at once: on a
pair whose draft cannot pay, that look is most of what a parked generation costs over plain decoding.
Each generation that drafted leaves here the acceptance per position it ended with and what one of its
probes really cost (in plain steps); the next one starts from them, takes no free look when they say
the draft does not pay, and charges its probes what they cost last time. A pair whose text changes
still probes within the budget and learns again (the memory is only the prior).

Kept in the cost cache file of the pair and head (`CostCurve.cache_path`, under "acceptance_seen"), so a
fresh cost cache starts fresh; a file the user gave is never written.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mlx_dspark.engine.costs.heal import write_cached

KEY = "acceptance_seen"


@dataclass(frozen=True)
class Memory:
    acceptance: tuple[float, ...]  # q(1), q(2), ...: the chance position k is accepted once 1..k-1 were
    probe_steps: float | None = None  # what a probe after a park cost, in plain steps (None: not measured)


def recall(path: Path | None) -> Memory | None:
    """The memory kept in the cost cache file `path`; None without one (or one this version cannot read)."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8")).get(KEY)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(data, dict):
        return None
    acceptance, probe = data.get("acceptance"), data.get("probe_steps")
    if not (isinstance(acceptance, list) and acceptance and all(_is_fraction(q) for q in acceptance)):
        return None
    if not (probe is None or (isinstance(probe, (int, float)) and math.isfinite(probe) and probe > 0)):
        probe = None
    return Memory(acceptance=tuple(float(q) for q in acceptance), probe_steps=probe)


def remember(path: Path | None, acceptance: Sequence[float], *, probe_steps: float | None) -> None:
    """Keep `acceptance` (and the probe cost) in the cost cache file `path`, beside the curve."""
    if path is None:
        return
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # the cache went away or is being rewritten: nothing to keep it beside
    if not isinstance(data, dict):
        return
    data[KEY] = {"acceptance": [round(float(q), 4) for q in acceptance], "at": time.strftime("%Y-%m-%d %H:%M"),
                 **({} if probe_steps is None else {"probe_steps": round(float(probe_steps), 3)})}  # fmt: skip
    try:
        write_cached(Path(path), data)
    except OSError:
        pass  # a read-only cache: the next generation starts from the prior


def _is_fraction(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0
