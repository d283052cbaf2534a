"""Acceptance statistics from a run's per-round counts, and small robust summaries."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Sequence


def acceptance_histogram(acceptance_lengths: Sequence[int], *, block_size: int) -> list[int]:
    """Counts of acceptance lengths 1 .. block_size + 1 (index 0 is length 1)."""
    counts = [0] * (block_size + 1)
    for length in acceptance_lengths:
        if not 1 <= length <= block_size + 1:
            raise ValueError(f"acceptance length {length} is outside 1..{block_size + 1}")
        counts[length - 1] += 1
    return counts


def position_acceptance(
    acceptance_lengths: Sequence[int], proposal_lengths: Sequence[int], *, block_size: int
) -> list[dict]:
    """Per draft position k = 1..block_size: how often it was verified with 1..k-1 accepted (`reached`),
    how often it was then accepted, and their ratio (`rate`, None when never reached)."""
    if len(acceptance_lengths) != len(proposal_lengths):
        raise ValueError("acceptance_lengths and proposal_lengths must have one entry per round")
    rows = []
    for k in range(1, block_size + 1):
        reached = sum(1 for a, l in zip(acceptance_lengths, proposal_lengths) if l >= k and a - 1 >= k - 1)
        accepted = sum(1 for a, l in zip(acceptance_lengths, proposal_lengths) if l >= k and a - 1 >= k)
        rows.append({"position": k, "reached": reached, "accepted": accepted, "rate": accepted / reached if reached else None})
    return rows


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def loadavg() -> str | None:
    """/proc/loadavg's first three fields (Linux), None elsewhere."""
    path = Path("/proc/loadavg")
    if not path.is_file():
        return None
    return " ".join(path.read_text().split()[:3])
