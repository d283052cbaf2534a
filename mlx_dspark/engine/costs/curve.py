"""Confidence-scheduled verification (DSPARK.md section 5, the DSpark paper's Alg. 1).

A round verifies `[anchor, x(1..l)]`. With `a(k) = c(1) * ... * c(k)` the probability (by the draft's
confidence head; calibrated when the draft's config carries `confidence_temperatures`, applied inside
the head) that the first k drafts are all accepted, a round of width l yields `E(l) = 1 + a(1) + ... +
a(l)` tokens in expectation and costs `t_draft + t_verify(1 + l)`. `scheduled_length` admits positions
in order and stops at the first that does not raise the expected rate `E(l) / (t_draft + t_verify(1 +
l))`. It reads only draft-side values, and `c(k)` depends on the draft's hidden state and `x(k - 1)`,
never on `x(k)` itself: whether position k is verified is decided before x(k) is looked at, so the
admitted prefix is an ordinary speculative block and sampling stays lossless in both drafting modes.

The cost curve `t_verify(n)`, n = 1 .. block_size + 1, and `t_draft` come, in this order of preference:
1. given (`CostCurve.flat` in tests, `CostCurve.from_file` of a benchmark's `cost_curve.json` via
   `--cost-curve-file`): a careful measurement (context 512, 10 interleaved repeats) beats a quick one;
2. the on-disk cache `~/.cache/mlx_dspark/cost/<key>.json`, keyed by the pair's paths and configs, the
   weights' dtypes and the machine (host, device, MLX version, BLAS), written by
3. `cost_probe.measure_cost_curve`: a quick measurement on the loaded pair at first use (3 interleaved repeats
   after a warm-up, medians; milliseconds on a GPU, a few seconds for the scaled pair on a small CPU).
   Costs depend on the machine, so a curve measured elsewhere would schedule for the wrong hardware.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


VERIFY_SCHEDULES = ("fixed", "confidence")


@dataclass(frozen=True)
class CostCurve:
    """Milliseconds of one draft block and of target verify forwards of 1, 2, ... tokens; a chained draft
    (one forward per draft) adds `draft_step_ms` per draft token."""

    draft_ms: float
    verify_ms: tuple[float, ...]  # verify_ms[n - 1]: a forward of n tokens (the anchor and n - 1 drafts)
    source: str = "given"  # where it came from, for logs and benchmark JSON
    context: int = 0  # the context depth (positions in the caches) it was measured at
    deep: "CostCurve | None" = None  # the same costs at a deeper context, for `at(depth)`; None: depth-free
    checked: int = 0  # rounds of generations that have confirmed or corrected it (engine/costs/heal.py)
    cache_path: "Path | None" = dataclasses.field(default=None, compare=False, repr=False)  # the cost cache file it came from
    draft_step_ms: float = 0.0  # a chained draft's cost per draft token (0 for a block draft)

    def __post_init__(self) -> None:
        object.__setattr__(self, "verify_ms", tuple(float(v) for v in self.verify_ms))
        if self.deep is not None and not (isinstance(self.deep, CostCurve) and self.deep.context > self.context):
            raise ValueError(f"a deeper cost curve must be measured past context {self.context}, got {self.deep!r}")
        values = (self.draft_ms, self.draft_step_ms, *self.verify_ms)
        if not self.verify_ms or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"a cost curve needs finite times >= 0 for a draft block and verify widths 1.., got {values}")
        if any(b < a for a, b in zip(self.verify_ms, self.verify_ms[1:])):
            # A wider forward never costs less; measured curves are made monotone by `from_measurements`.
            raise ValueError(f"verify times must not decrease with the width, got {self.verify_ms}")

    @classmethod
    def flat(cls, *, max_width: int, verify_ms: float = 1.0, draft_ms: float = 0.0) -> "CostCurve":
        """Every verify width costs the same (a GPU far from its compute limit): never cut a confident draft."""
        return cls(draft_ms=draft_ms, verify_ms=(verify_ms,) * max_width, source="flat")

    @classmethod
    def from_measurements(cls, *, draft_ms: float, verify_ms: Sequence[float], source: str) -> "CostCurve":
        """A measured curve with its noise bumps pooled away (isotonic regression, pool adjacent violators)."""
        return cls(draft_ms=draft_ms, verify_ms=tuple(_nondecreasing(verify_ms)), source=source)

    def with_context(self, context: int) -> "CostCurve":
        return dataclasses.replace(self, context=context)

    @property
    def max_width(self) -> int:
        return len(self.verify_ms)

    def at(self, depth: int) -> "CostCurve":
        """The costs at context `depth`: linear in the depth between (and past) the two measured ones.

        Attention reads every cached position, so a forward's cost grows about linearly with the depth;
        below the shallow measurement the shallow costs are kept (never extrapolated towards zero).
        """
        if self.deep is None or depth <= self.context:
            return self
        widths = min(self.max_width, self.deep.max_width)
        share = (depth - self.context) / (self.deep.context - self.context)
        mix = lambda a, b: max(0.0, a + share * (b - a))  # noqa: E731
        return dataclasses.replace(CostCurve.from_measurements(
            draft_ms=mix(self.draft_ms, self.deep.draft_ms),
            verify_ms=[mix(a, b) for a, b in zip(self.verify_ms[:widths], self.deep.verify_ms[:widths])],
            source=f"{self.source} at context {depth}",
        ), draft_step_ms=mix(self.draft_step_ms, self.deep.draft_step_ms))

    def proposal_ms(self, draft_tokens: int) -> float:
        """A proposal of `draft_tokens` drafts: the draft block (and a chain's steps, one per draft)."""
        return self.draft_ms + draft_tokens * self.draft_step_ms

    def round_ms(self, draft_tokens: int) -> float:
        """A round that verifies `draft_tokens` drafts: the proposal and a forward of 1 + that many tokens."""
        return self.proposal_ms(draft_tokens) + self.verify_ms[draft_tokens]

    def to_json(self) -> dict:
        """In the benchmark's `cost_curve.json` key names, so `from_file` reads both."""
        return {
            "draft_block_ms": self.draft_ms,
            "verify_ms": {str(n + 1): ms for n, ms in enumerate(self.verify_ms)},
            "source": self.source,
            "context": self.context,
            **({} if self.deep is None else {"deep": self.deep.to_json()}),
            **({"checked": self.checked} if self.checked else {}),
            **({"draft_step_ms": self.draft_step_ms} if self.draft_step_ms else {}),
        }

    @classmethod
    def from_file(cls, path: str | Path) -> "CostCurve":
        """A benchmark's `cost_curve.json` (or a cached curve): `draft_block_ms` and `verify_ms` {"1": ms, ...}."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"cost curve file {path} does not exist") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"cost curve file {path} is not valid JSON ({err.msg} at line {err.lineno})") from None
        return cls._from_json(data, path)

    @classmethod
    def _from_json(cls, data: Any, path: Path) -> "CostCurve":
        verify = data.get("verify_ms") if isinstance(data, dict) else None
        draft = data.get("draft_block_ms") if isinstance(data, dict) else None
        widths = sorted(int(k) for k in verify) if isinstance(verify, dict) and all(str(k).isdigit() for k in verify) else []
        if not isinstance(draft, (int, float)) or not widths or widths != list(range(1, len(widths) + 1)):
            raise ValueError(
                f"cost curve file {path} needs 'draft_block_ms' (a number) and 'verify_ms' ({{\"1\": ms, \"2\": ms, ...}}, "
                "widths from 1 without gaps), as `python -m mlx_dspark.benchmark --cost-curve` writes"
            )
        context = data.get("context", 0)
        if not (isinstance(context, int) and context >= 0):
            raise ValueError(f"cost curve file {path}: 'context' must be the depth it was measured at (an integer >= 0), got {context!r}")
        deep = None if data.get("deep") is None else cls._from_json(data["deep"], path)
        if deep is not None and deep.context <= context:
            raise ValueError(f"cost curve file {path}: 'deep' must be measured past context {context}, got context {deep.context}")
        shallow = cls.from_measurements(draft_ms=draft, verify_ms=[verify[str(w)] for w in widths], source=str(path))
        checked = data.get("checked", 0)
        if not (isinstance(checked, int) and checked >= 0):
            raise ValueError(f"cost curve file {path}: 'checked' must be a count of rounds (an integer >= 0), got {checked!r}")
        step = data.get("draft_step_ms", 0.0)
        if isinstance(step, bool) or not isinstance(step, (int, float)) or step < 0:
            raise ValueError(f"cost curve file {path}: 'draft_step_ms' must be a number >= 0 (ms per chained draft), got {step!r}")
        return dataclasses.replace(shallow, context=context, deep=deep, checked=checked, draft_step_ms=float(step))


def _nondecreasing(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [mean for mean, count in blocks for _ in range(int(count))]


def scheduled_length(confidence: Sequence[float], curve: CostCurve) -> int:
    """How many of the drafts with confidences c(1..K) to verify: stop at the first that does not raise the rate.

    Admitting position l + 1 raises E/T iff (E + a) / T' > E / T, i.e. a * T > E * (T' - T), written without
    division so that on a flat curve (T' = T) every position with a(l + 1) > 0 is admitted, exactly.
    """
    if len(confidence) + 1 > curve.max_width:
        raise ValueError(f"the cost curve covers verify widths up to {curve.max_width}, a round needs {len(confidence) + 1}")
    expected, prefix = 1.0, 1.0  # E(l), a(l)
    for length, c in enumerate(confidence):
        prefix *= float(c)
        cost, wider = curve.round_ms(length), curve.round_ms(length + 1)
        if not prefix * cost > expected * (wider - cost):
            return length
        expected += prefix
    return len(confidence)


def require_confidence_head(
    draft: Any, *, source: Any = "the draft", need: str = "verify_schedule 'confidence'", fix: str = "use verify_schedule 'fixed'"
) -> None:
    """The confidence schedule (or a confidence threshold) needs c(k): refuse a draft without a
    confidence head, naming the fix."""
    if draft is not None and not getattr(draft.args, "enable_confidence_head", False):
        raise ValueError(
            f"{need} needs a draft with a confidence head; {source} has none (enable_confidence_head is false): {fix}"
        )
