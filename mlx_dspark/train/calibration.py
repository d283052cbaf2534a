"""Calibrate a draft's confidence head: one temperature per block position, fitted on held-out data.

`python -m mlx_dspark.train.calibrate --target T --draft D --data HELD_OUT [--plot reliability.png]`

The confidence `c(k)` is read as P(draft token k is accepted | tokens 1..k-1 were), so the samples of
position k are the blocks whose earlier draft tokens were accepted: teacher-forced blocks on held-out
text, each position weighted by its earlier positions' acceptance (0/1 for `greedy`, their acceptance
probabilities for `sampled`). For each position, `T(k)` minimizes the weighted negative log-likelihood
of `sigmoid(logit / T(k))` (convex in 1/T: a golden-section search). The temperatures go into the
draft's config.json as `confidence_temperatures` (the draft applies them when present); the report
(expected calibration error per position before and after, 10 equal-width bins) goes beside it in
calibration.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from mlx_dspark.train.data import Chunk
from mlx_dspark.train.forward import held_out_blocks
from mlx_dspark.train.losses import CONFIDENCE_TARGETS, acceptance, confidence_labels

CALIBRATION_FILE = "calibration.json"
_BETA_RANGE = (1e-3, 100.0)  # 1 / T


@dataclass
class CalibrationData:
    logits: np.ndarray  # (M, bs) uncalibrated confidence logits
    labels: np.ndarray  # (M, bs) accepted: 1/0 (greedy) or the acceptance probability (sampled)
    weights: np.ndarray  # (M, bs) valid position whose earlier draft tokens were accepted


@dataclass
class CalibrationReport:
    confidence_target: str
    temperatures: list[float]
    ece_before: list[float]
    ece_after: list[float]
    nll_before: list[float]
    nll_after: list[float]
    samples: list[float]  # effective samples (sum of weights) per position
    blocks: int


def collect(
    draft: Any,
    target: Any,
    chunks: list[Chunk],
    *,
    kind: str,
    batch_size: int,
    anchors: int,
    seed: int,
    pad_id: int,
) -> CalibrationData:
    if kind not in CONFIDENCE_TARGETS:
        raise ValueError(f"confidence target must be one of {CONFIDENCE_TARGETS}, got {kind!r}")
    if getattr(draft, "confidence_head", None) is None:
        raise ValueError("the draft has no confidence head (enable_confidence_head is false): nothing to calibrate")
    rng = np.random.default_rng([seed, 3])
    parts: list[tuple[np.ndarray, ...]] = []
    blocks_of = held_out_blocks(draft, target, chunks, batch_size=batch_size, anchors=anchors, rng=rng, pad_id=pad_id)
    for _, targets, outputs in blocks_of:
        rate, hit = acceptance(outputs.logits, targets.target_logits)
        labels = confidence_labels(rate, hit, kind=kind)
        earlier = mx.concatenate([mx.ones_like(labels[:, :1]), mx.cumprod(labels, axis=1)[:, :-1]], axis=1)
        weights = targets.valid * earlier
        mx.eval(outputs.confidence_logits, labels, weights)
        parts.append(tuple(np.array(a, dtype=np.float64) for a in (outputs.confidence_logits, labels, weights)))
    if not parts:
        raise ValueError("no held-out data to calibrate on")
    return CalibrationData(*(np.concatenate([p[i] for p in parts]) for i in range(3)))


def _nll(beta: float, logits: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> float:
    z = beta * logits
    # -[y log s(z) + (1-y) log(1-s(z))] = softplus(z) - y z
    return float((weights * (np.logaddexp(0.0, z) - labels * z)).sum() / max(weights.sum(), 1e-12))


def fit_temperature(logits: np.ndarray, labels: np.ndarray, weights: np.ndarray, *, iterations: int = 80) -> float:
    """T minimizing the weighted NLL of sigmoid(logits / T); 1.0 when there are no samples."""
    if weights.sum() <= 0:
        return 1.0
    lo, hi = _BETA_RANGE
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo + (1 - ratio) * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = _nll(a, logits, labels, weights), _nll(b, logits, labels, weights)
    for _ in range(iterations):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = lo + (1 - ratio) * (hi - lo)
            fa = _nll(a, logits, labels, weights)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = _nll(b, logits, labels, weights)
    return 1.0 / ((lo + hi) / 2)


def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, weights: np.ndarray, *, bins: int = 10) -> float:
    """Weighted ECE: sum over equal-width confidence bins of |mean label - mean confidence| x bin weight."""
    total = weights.sum()
    if total <= 0:
        return 0.0
    index = np.minimum((probs * bins).astype(int), bins - 1)
    error = 0.0
    for b in range(bins):
        sel = index == b
        w = weights[sel].sum()
        if w > 0:
            error += abs((weights[sel] * labels[sel]).sum() - (weights[sel] * probs[sel]).sum())
    return float(error / total)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def fit(data: CalibrationData, *, kind: str) -> CalibrationReport:
    report = CalibrationReport(kind, [], [], [], [], [], [], blocks=int(data.logits.shape[0]))
    for k in range(data.logits.shape[1]):
        z, y, w = data.logits[:, k], data.labels[:, k], data.weights[:, k]
        temperature = fit_temperature(z, y, w)
        report.temperatures.append(round(temperature, 6))
        report.ece_before.append(expected_calibration_error(_sigmoid(z), y, w))
        report.ece_after.append(expected_calibration_error(_sigmoid(z / temperature), y, w))
        report.nll_before.append(_nll(1.0, z, y, w))
        report.nll_after.append(_nll(1.0 / temperature, z, y, w))
        report.samples.append(float(w.sum()))
    return report


def apply_temperatures(draft: Any, temperatures: Sequence[float]) -> None:
    """Make a loaded draft's confidence head use the temperatures (as loading them from config.json does)."""
    values = tuple(float(t) for t in temperatures)
    draft.confidence_head.temperatures = values
    draft.args = dataclasses.replace(draft.args, confidence_temperatures=values)


def write_calibration(draft_dir: Path, report: CalibrationReport) -> None:
    """Store the temperatures in the draft's config.json and the report in calibration.json."""
    config_path = draft_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["confidence_temperatures"] = report.temperatures
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (draft_dir / CALIBRATION_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n", encoding="utf-8")


def format_report(report: CalibrationReport) -> str:
    lines = [
        f"confidence calibration ({report.confidence_target} acceptance, {report.blocks} held-out blocks)",
        "position  samples  temperature  ECE before  ECE after  NLL before  NLL after",
    ]
    for k, t in enumerate(report.temperatures):
        lines.append(
            f"{k + 1:>8}  {report.samples[k]:>7.0f}  {t:>11.3f}  {report.ece_before[k]:>10.4f}  "
            f"{report.ece_after[k]:>9.4f}  {report.nll_before[k]:>10.4f}  {report.nll_after[k]:>9.4f}"
        )
    return "\n".join(lines)


def reliability_plot(data: CalibrationData, report: CalibrationReport, path: Path, *, bins: int = 10) -> None:
    """Reliability diagram per block position, before and after scaling (needs the `plots` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ValueError("the reliability plot needs matplotlib: pip install 'mlx-dspark[plots]'") from err
    size = len(report.temperatures)
    fig, axes = plt.subplots(1, size, figsize=(2.6 * size, 2.8), sharey=True, squeeze=False)
    centers = (np.arange(bins) + 0.5) / bins
    for k, ax in enumerate(axes[0]):
        z, y, w = data.logits[:, k], data.labels[:, k], data.weights[:, k]
        for probs, style, name in (
            (_sigmoid(z), "o--", f"raw (ECE {report.ece_before[k]:.3f})"),
            (_sigmoid(z / report.temperatures[k]), "s-", f"T={report.temperatures[k]:.2f} (ECE {report.ece_after[k]:.3f})"),
        ):
            index = np.minimum((probs * bins).astype(int), bins - 1)
            acc = [np.average(y[index == b], weights=w[index == b]) if w[index == b].sum() > 0 else np.nan for b in range(bins)]
            ax.plot(centers, acc, style, markersize=3, label=name)
        ax.plot([0, 1], [0, 1], color="gray", linewidth=0.5)
        ax.set_title(f"position {k + 1}")
        ax.set_xlabel("confidence")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("accepted")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def calibrate_draft(
    draft: Any,
    target: Any,
    chunks: list[Chunk],
    *,
    kind: str = "greedy",
    batch_size: int = 4,
    anchors: int = 64,
    seed: int = 0,
    pad_id: int = 0,
    plot: Optional[Path] = None,
) -> CalibrationReport:
    """Fit the temperatures on held-out chunks, apply them to `draft`, and return the report."""
    data = collect(draft, target, chunks, kind=kind, batch_size=batch_size, anchors=anchors, seed=seed, pad_id=pad_id)
    report = fit(data, kind=kind)
    apply_temperatures(draft, report.temperatures)
    if plot is not None:
        reliability_plot(data, report, plot)
    return report
