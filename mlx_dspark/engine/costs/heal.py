"""A cost curve corrected by the times the rounds of a generation really take (issue 33.2).

A curve measured while the machine was busy (a build, a video call) is too slow, and a cached curve is
read again by every later run: `auto` then parks where drafting pays. Every generation times its rounds
anyway, so `CurveHealer` compares them with the curve as they come:
- plain (parked) steps measure a verify of width 1: their median ratio to the curve scales the verify times;
- drafting rounds (probes included) measure a draft block plus a verify of 1 + n: less the scaled verify,
  their median is the draft block's time.
A component is replaced only when it is off by more than `tolerance` (noise does not move it). The
corrected curve goes back to the cost cache it came from (`CostCurve.cache_path`; never a file the user
gave), with what healed it, so the next run starts from it; a curve that the rounds confirmed is marked
`checked` there too, and the policy then skips its check probe (draft_length.AutoLength).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections import deque
from pathlib import Path

from mlx_dspark.engine.costs.curve import CostCurve

ENABLED = True  # tests that must not time anything turn it off (tests/conftest.py)
MIN_PLAIN_STEPS = 8  # plain steps before their median scales the verify times
SAVE_EVERY = 64  # observations between writes of a changed curve to the cache


class CurveHealer:
    """Observed round times -> `curve`, the base curve with its verify and draft times corrected."""

    def __init__(self, base: CostCurve, *, tolerance: float = 0.25) -> None:
        self.base = base
        self.tolerance = tolerance
        self._plain: deque[float] = deque(maxlen=64)  # observed / curve verify(1)
        self._rounds: deque[tuple[int, float]] = deque(maxlen=16)  # (drafts verified, ms)
        self._curve = base
        self._observed = 0
        self._saved_at = 0

    @property
    def curve(self) -> CostCurve:
        return self._curve

    @property
    def checked(self) -> bool:
        """Whether round times have confirmed (or corrected) the draft block's cost, here or in an earlier run."""
        return bool(self.base.checked) or bool(self._rounds)

    def observe(self, *, proposed: int, ms: float) -> None:
        """A round of `proposed` drafts (0: a plain step) took `ms` milliseconds, start to end."""
        if not ms > 0:
            return
        self._observed += 1
        if proposed == 0:
            self._plain.append(ms / max(self.base.verify_ms[0], 1e-9))
        elif proposed < self.base.max_width:
            self._rounds.append((proposed, ms))
        else:
            return
        if proposed or self._observed % 8 == 0:
            self._curve = self._healed()
        if self._observed - self._saved_at >= SAVE_EVERY or (proposed and len(self._rounds) == 1):
            self.save()

    def _verify_scale(self) -> float:
        if len(self._plain) >= MIN_PLAIN_STEPS:
            scale = statistics.median(self._plain)
        elif len(self._rounds) >= 4:
            scale = statistics.median(ms / self.base.round_ms(n) for n, ms in self._rounds)
        else:
            return 1.0
        return scale if abs(scale - 1.0) > self.tolerance else 1.0

    def _healed(self) -> CostCurve:
        scale = self._verify_scale()
        draft = self.base.draft_ms
        if self._rounds:
            observed = max(0.0, statistics.median(ms - scale * self.base.verify_ms[n] for n, ms in self._rounds))
            if abs(observed - draft) > self.tolerance * max(draft, self.base.verify_ms[0]):
                draft = observed
        if scale == 1.0 and draft == self.base.draft_ms:
            return self.base
        return _scaled(self.base, verify=scale, draft_ms=draft)

    def save(self) -> None:
        """Write the curve (healed or confirmed) back to the cost cache it was read from, if any."""
        path = self.base.cache_path
        self._saved_at = self._observed
        if path is None or not (self._rounds or self._curve is not self.base):
            return
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # the cache went away or is being rewritten: the next run measures or reads it again
        curve = self._curve
        stamp = time.strftime("%Y-%m-%d %H:%M")
        data.update({k: v for k, v in curve.to_json().items() if k != "source"})
        data["checked"] = int(self.base.checked) + self._observed
        data["healing"] = {"at": stamp, "rounds": len(self._rounds), "plain_steps": len(self._plain),
                           "healed": curve is not self.base, "verify_scale": round(self._verify_scale(), 3),
                           "draft_block_ms_before": self.base.draft_ms}  # fmt: skip
        try:
            write_cached(Path(path), data)
        except OSError:
            pass  # a read-only cache: the correction holds for this generation only


def write_cached(path: Path, data: dict) -> None:
    """Write a measurement into the cost cache as JSON, atomically: a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _scaled(curve: CostCurve, *, verify: float, draft_ms: float) -> CostCurve:
    """`curve` with verify times times `verify` and the draft block `draft_ms` (its deep curve likewise)."""
    ratio = draft_ms / curve.draft_ms if curve.draft_ms > 0 else 1.0
    deep = None if curve.deep is None else _scaled(curve.deep, verify=verify, draft_ms=curve.deep.draft_ms * ratio)
    return dataclasses.replace(
        curve, draft_ms=draft_ms, verify_ms=tuple(v * verify for v in curve.verify_ms), deep=deep,
        source=f"{curve.source}, healed by observed rounds",
    )  # fmt: skip
