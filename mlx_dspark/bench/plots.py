"""PNG plots (speedup per dataset, acceptance-length histogram) when matplotlib is installed.

matplotlib is the optional `plots` extra; without it `write_plots` returns a note instead of files.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from typing import Sequence


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write_plots(results: dict, out_dir: Path) -> tuple[list[Path], str | None]:
    """(written files, note): the note says why nothing was written."""
    if not matplotlib_available():
        return [], "plots skipped: matplotlib is not installed (pip install 'mlx-dspark[plots]')"
    if not results["rows"]:
        return [], "plots skipped: no dataset rows"
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [*results["rows"], results["average"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([r["dataset"] for r in rows], [r["speedup"] for r in rows], color="#4c72b0")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("speedup over the faster baseline")
    ax.set_title("DSpark speedup per dataset")
    fig.tight_layout()
    speedup_path = out_dir / "speedup.png"
    fig.savefig(speedup_path, dpi=120)
    plt.close(fig)

    histogram = _pooled_histogram(results["prompts"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(i + 1) for i in range(len(histogram))], histogram, color="#55a868")
    ax.set_xlabel("acceptance length (accepted drafts + 1)")
    ax.set_ylabel("rounds")
    ax.set_title("Acceptance-length histogram (all prompts)")
    fig.tight_layout()
    histogram_path = out_dir / "acceptance_histogram.png"
    fig.savefig(histogram_path, dpi=120)
    plt.close(fig)
    return [speedup_path, histogram_path], None


def _pooled_histogram(records: Sequence[dict]) -> list[int]:
    histograms = [r["dspark"]["acceptance_histogram"] for r in records]
    # prompts whose rounds verified longer blocks (lookup) have longer histograms
    return [sum(column) for column in itertools.zip_longest(*histograms, fillvalue=0)]
