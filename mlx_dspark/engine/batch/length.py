"""How many drafts each batched row proposes: this machine's packed-forward costs, and one plan for the
whole batch.

A batched round is one packed target forward over every row's segment (engine/batch/round.py), so a row's
drafts cost what they add to *that* forward: little while the forward is memory-bound, a lot once the
batch fills the machine. `BatchCost` holds what the packed forwards cost here, at one context depth:
one sequence's forward of n rows, what splitting the attention over w sequences adds, and the packed
draft block of w sequences (measured once per pair, machine and width limit by `measure_batch_cost`,
cached beside the single-request curve by `batch_cost_for`).

`plan_lengths` picks the draft lengths of one round together: from every row at its floor (its fixed
length, 0 for auto rows) it adds one draft at a time where it adds the most expected tokens, and keeps
the point of the path with the highest

    rate = sum_i E_i(l_i) / (t_draft(rows drafting) + t_verify(width, total rows))

with `E_i(l) = 1 + a_i(1) + .. + a_i(l)` over the row's own per-position acceptance (its `AutoLength`'s
estimates). A row that gets 0 is parked for the round (a plain row in the shared forward). Lossless as
any length policy: the lengths are fixed before the round's drafts are looked at.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx

from mlx_dspark.engine.costs.probe import SHALLOW_CONTEXT, cache_key, cost_cache_dir, write_cached
from mlx_dspark.engine.round.decode import prefill
from mlx_dspark.engine.policy.draft_length import expected_tokens
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.costs.curve import _nondecreasing
from mlx_dspark.models.caches.kv import trim_caches
from mlx_dspark.models.packed.forward import packed_block_hidden, packed_target_forward
from mlx_dspark.models.caches.snapshot import restore_caches, snapshot_caches

PROBE_LENGTH = 2  # a row the plan keeps parked drafts this many now and then, so its estimates stay current
PROBE_EVERY, MAX_PROBE_EVERY = 8, 128  # rounds between probes; doubles while the probes do not pay


def _interpolate(points: dict[float, float], x: float) -> float:
    """Piecewise-linear through (x -> ms); past the ends, the nearest segment's slope (never below 0)."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]] * x / xs[0]
    lo, hi = (xs[0], xs[1]) if x <= xs[0] else (xs[-2], xs[-1]) if x >= xs[-1] else next(
        (a, b) for a, b in zip(xs, xs[1:]) if a <= x <= b
    )
    return max(0.0, points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo))


def row_budget_cap(rows: int = 16, *, block_size: int = 7) -> Callable[[int], int]:
    """A fixed draft cap per batch width: keep the packed verify within about `rows` rows
    (`width * (l + 1) <= rows`), and at least 1 draft token per row, at most `block_size`."""

    def cap(width: int) -> int:
        return max(1, min(block_size, rows // max(width, 1) - 1))

    return cap


ROW_POINTS = (16, 32, 64, 128)  # forward widths timed past the verify block's (a newcomer's prefill chunk)


@dataclass(frozen=True)
class BatchCost:
    """Milliseconds of packed forwards on this machine, at context `context`.

    A packed forward of `width` sequences and `rows` rows in all costs what one sequence's forward of
    that many rows costs (`rows_ms[n]`: the matmuls see every row at once) plus what splitting the
    attention over `width` sequences adds (`sequences_ms[w]`: w sequences of one row each, measured);
    `draft_ms[w]`: a packed draft block of `w` sequences (with its heads)."""

    rows_ms: dict[int, float]
    sequences_ms: dict[int, float]
    draft_ms: dict[int, float]
    context: int = SHALLOW_CONTEXT
    source: str = "given"
    bytes_per_token: float = 0.0  # a request's caches (target and draft context) per token of context; 0: unknown

    def __post_init__(self) -> None:
        values = [*self.rows_ms.values(), *self.sequences_ms.values(), *self.draft_ms.values()]
        if not self.rows_ms or any(not isinstance(v, (int, float)) or not v >= 0 for v in values):
            raise ValueError(f"a batch cost needs times >= 0 (rows_ms, sequences_ms, draft_ms), got {self.to_json()}")

    @property
    def max_width(self) -> int:
        return max([1, *self.sequences_ms])

    def verify(self, width: int, rows: float) -> float:
        """A packed forward of `width` sequences with `rows` rows in all."""
        split = 0.0
        if width > 1 and self.sequences_ms:
            split = max(0.0, _interpolate({1: self.rows_ms.get(1, 0.0), **self.sequences_ms}, width) - _interpolate(self.rows_ms, width))
        return _interpolate(self.rows_ms, rows) + split

    def draft(self, width: int) -> float:
        """A packed draft block of `width` sequences (0: no draft forward)."""
        return 0.0 if width <= 0 or not self.draft_ms else _interpolate(self.draft_ms, width)

    def to_json(self) -> dict:
        table = lambda d: {str(k): v for k, v in sorted(d.items())}  # noqa: E731
        return {"context": self.context, "source": self.source, "rows_ms": table(self.rows_ms),
                "sequences_ms": table(self.sequences_ms), "draft_ms": table(self.draft_ms),
                "bytes_per_token": self.bytes_per_token}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict, *, where: str = "a batch cost") -> "BatchCost":
        try:
            table = lambda key: {int(k): float(v) for k, v in data[key].items()}  # noqa: E731
            return cls(rows_ms=table("rows_ms"), sequences_ms=table("sequences_ms"), draft_ms=table("draft_ms"),
                       context=int(data.get("context", SHALLOW_CONTEXT)), source=str(data.get("source", where)),
                       bytes_per_token=float(data.get("bytes_per_token", 0.0)))  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{where}: expected rows_ms, sequences_ms and draft_ms tables {{count: ms}} ({err})") from err


def measured_widths(max_batch: int) -> list[int]:
    """The widths a measurement times: powers of two up to `max_batch`, and `max_batch` itself."""
    widths, w = [], 1
    while w < max_batch:
        widths.append(w)
        w *= 2
    return [*widths, max_batch]


def measure_batch_cost(
    target: Any, draft: Any, *, max_batch: int, context: int = SHALLOW_CONTEXT, repeats: int = 3, seed: int = 0
) -> BatchCost:
    """Time, over `max_batch` sequences prefilled to `context` random tokens: one sequence's forward of
    1..K+1 and `ROW_POINTS` rows, w sequences of one row and packed draft blocks of w sequences (w in
    `measured_widths`). Interleaved in rotating order, every forward rolled back; the fastest of
    `repeats` after one untimed pass."""
    rng = random.Random(seed)
    vocab, block = target.args.vocab_size, int(draft.num_drafts)
    limit = getattr(target.args, "max_position_embeddings", None) or 1 << 30
    context = max(1, min(context, limit - ROW_POINTS[-1] - 2))
    caches, proposers = [], []
    for _ in range(max_batch):
        cache = target.make_cache(max_rollback=ROW_POINTS[-1])  # sliding layers roll back the widest forward
        proposer = DraftProposer(draft, target, greedy=True, temperature=1.0)
        logits = prefill(target, cache, [rng.randrange(vocab) for _ in range(context)], tap_ids=proposer.tap_ids, proposer=proposer)
        mx.eval(logits)
        caches.append(cache)
        proposers.append(proposer)
    held = sum(c.nbytes for c in caches[0]) + sum(c.nbytes for c in proposers[0].context)  # before any forward grows them
    widths = measured_widths(max_batch)
    row_points = [*range(1, block + 2), *(n for n in ROW_POINTS if n > block + 1)]
    jobs = [("draft", w) for w in widths] + [("rows", n) for n in row_points] + [("sequences", w) for w in widths if w > 1]
    samples: dict[tuple, list[float]] = {job: [] for job in jobs}
    tokens = mx.array([rng.randrange(vocab) for _ in range(max(row_points[-1], max_batch))], dtype=mx.int32)
    for repeat in range(repeats + 1):
        turn = repeat * len(jobs) // (repeats + 1)
        for job in jobs[turn:] + jobs[:turn]:
            kind, n = job
            start = time.perf_counter()
            if kind == "draft":
                anchors = tokens[:n]
                block_hidden = packed_block_hidden(draft, anchors, [p.context for p in proposers[:n]], target=target)
                out = draft.propose_from_block(anchors, block_hidden, target=target, greedy=True, temperature=1.0, num_tokens=block)
                mx.eval(out.tokens)
            else:
                width, rows = (1, n) if kind == "rows" else (n, 1)
                # recurrent state (a hybrid's) is restored from a copy rather than rolled back (a one-row
                # forward is never recorded); attention-only caches are trimmed (no copy: None)
                saved = [snapshot_caches(c) for c in caches[:width]]
                if any(s is not None for s in saved):
                    mx.eval([a for s in saved if s is not None for layer in s for a in layer.arrays()])
                    start = time.perf_counter()
                logits, features = packed_target_forward(
                    target, tokens[: width * rows], caches[:width], [rows] * width, tap_ids=proposers[0].tap_ids,
                    head_rows=None if kind == "sequences" or n <= max(block + 1, max_batch) else [n - 1],  # past: a prompt chunk
                )  # fmt: skip
                mx.eval(mx.argmax(logits, axis=-1), *([] if features is None else [features]))
                for cache, state in zip(caches[:width], saved):
                    restore_caches(cache, state) if state is not None else trim_caches(cache, rows)
            if repeat:
                samples[job].append(1000 * (time.perf_counter() - start))
    fastest = lambda kind, points: _nondecreasing([min(samples[(kind, n)]) for n in points])  # noqa: E731
    sequences = [w for w in widths if w > 1]
    return BatchCost(
        rows_ms=dict(zip(row_points, fastest("rows", row_points))),
        sequences_ms=dict(zip(sequences, fastest("sequences", sequences))),
        draft_ms={w: min(samples[("draft", w)]) for w in widths},
        context=context,
        source=f"measured {time.strftime('%Y-%m-%d %H:%M')}",
        bytes_per_token=held / context,
    )


def batch_cost_path(model: Any, max_batch: int, cache_dir: Path | None = None) -> Path:
    return (cache_dir or cost_cache_dir()) / f"{cache_key(model)}-batch{max_batch}.json"


def batch_cost_for(model: Any, max_batch: int, *, cache_dir: Path | None = None, measure=None) -> BatchCost:
    """The loaded pair's packed costs up to `max_batch` sequences on this machine: read from the cost
    cache, else measured (`measure`, default `measure_batch_cost`) and written there."""
    path = batch_cost_path(model, max_batch, cache_dir)
    if path.is_file():
        cached = BatchCost.from_json(json.loads(path.read_text()), where=str(path))
        if cached.bytes_per_token > 0:  # a file from before the caches' size was measured is measured again
            return cached
    cost = (measure or measure_batch_cost)(model.target, model.draft, max_batch=max_batch)
    write_cached(path, cost.to_json())
    return cost


@dataclass
class RowDemand:
    """One row's part of the plan: `rows` it puts in the forward anyway (a prefill chunk; 1 for a
    decoding row's anchor; 0 for a row outside the forward), `floor` drafts it takes whatever the plan
    (a fixed length, a probe), and, for a row the plan may lengthen, its conditional acceptances q(1..)
    and the most drafts it may take (`cap`)."""

    rows: int = 1
    floor: int = 0
    acceptance: Sequence[float] = ()
    cap: int = 0
    tokens: bool = True  # whether its round commits tokens (a middle prefill chunk does not)
    expected: float | None = None  # the tokens its round commits at its floor, when known otherwise (a lookup block)


def plan_lengths(cost: BatchCost, demands: Sequence[RowDemand]) -> list[int]:
    """The draft lengths of one round (module docstring): each row's floor, lengthened one draft at a
    time where it adds the most expected tokens (a row's k-th draft adds a(k) <= a(k - 1), so this path
    holds the most tokens for every total of rows), and the point of the highest tokens per
    millisecond kept. As every drafting row costs the packed draft something, the path is walked once
    for the m rows of highest first-draft acceptance, for every m."""
    floors = [d.floor for d in demands]
    width = len(demands)
    rows0 = sum(d.rows + d.floor for d in demands)
    expected0 = sum(d.expected if d.expected is not None else expected_tokens(d.acceptance, d.floor) if d.acceptance else 1.0
                    for d in demands if d.tokens)  # fmt: skip
    caps = [max(0, min(d.cap, len(d.acceptance))) for d in demands]
    most = rows0 + sum(max(0, c - f) for c, f in zip(caps, floors))
    verify = [cost.verify(width, r) if r >= rows0 else 0.0 for r in range(most + 1)]  # the costs this plan can reach
    draft = [cost.draft(k) for k in range(width + 1)]

    def rate(e: float, r: int, k: int) -> float:
        return e / max(draft[k] + verify[r], 1e-9)

    drafting0 = sum(1 for f in floors if f)
    best, best_lengths = rate(expected0, rows0, drafting0), list(floors)
    growable = [i for i in range(width) if caps[i] > floors[i]]
    # rows by the acceptance of their next draft; the path over the first m of them, for each m
    order = sorted(growable, key=lambda i: -_prefix(demands[i].acceptance, floors[i] + 1))
    for m in range(1, len(order) + 1):
        chosen = order[:m]
        lengths, expected, rows, drafting = list(floors), expected0, rows0, drafting0
        prefix = {i: _prefix(demands[i].acceptance, floors[i]) for i in chosen}
        while True:
            choice, gain = None, -1.0
            for i in chosen:
                n = lengths[i]
                if n < caps[i]:
                    g = prefix[i] * demands[i].acceptance[n]
                    if g > gain:
                        choice, gain = i, g
            if choice is None:
                break
            drafting += lengths[choice] == 0
            lengths[choice] += 1
            prefix[choice] *= demands[choice].acceptance[lengths[choice] - 1]
            expected += prefix[choice]
            rows += 1
            now = rate(expected, rows, drafting)
            if now > best:
                best, best_lengths = now, list(lengths)
    return best_lengths


def _prefix(acceptance: Sequence[float], length: int) -> float:
    out = 1.0
    for q in acceptance[:length]:
        out *= q
    return out


@dataclass
class Probes:
    """When a row the plan keeps parked drafts a short probe (its acceptance may have changed): after
    `interval` parked rounds; the interval doubles while probes do not lead to drafting."""

    interval: int = PROBE_EVERY
    parked: int = 0
    counts: dict = field(default_factory=lambda: {"parked_rounds": 0, "probes": 0})

    def floor(self) -> int:
        """The probe length this round would take if the plan parks the row (0: no probe due)."""
        return PROBE_LENGTH if self.parked + 1 >= self.interval else 0

    def record(self, planned: int, probe: bool) -> None:
        """The plan gave the row `planned` drafts (`probe`: only because a probe was due)."""
        if probe:
            self.parked = 0
            self.interval = min(2 * self.interval, MAX_PROBE_EVERY)
            self.counts["probes"] += 1
        elif planned:
            self.parked = 0
            self.interval = PROBE_EVERY
        else:
            self.parked += 1
            self.counts["parked_rounds"] += 1
