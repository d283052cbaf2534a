"""DeepSpec's DSpark objective, in MLX.

Per block position k (weight `exp(-(k-1) / decay_gamma)` on the positions that are inside the sequence
and trainable):
- `ce`: cross-entropy of the draft (Markov-corrected, teacher-forced) at the data token;
- `l1`: the L1 distance `sum |q - P|` between the draft's distribution `q` and the target's `P` at the
  same position: twice the total variation, so `1 - l1 / 2` is the probability that a token drawn from
  the draft is accepted by speculative sampling (distillation from the target; DeepSpec's default
  weights are 0.1 ce + 0.9 l1);
- `kl` (optional, weight 0 by default): forward KL(P || q), the cross-entropy to the target's
  distribution minus its entropy;
- `confidence`: binary cross-entropy of the confidence head's logit against "this draft token is
  accepted": `sampled` (DeepSpec) uses the acceptance probability `1 - TV(q, P)` as a soft label,
  `greedy` uses `argmax q == argmax P` (acceptance under greedy decoding with greedy drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.train.forward import BlockTargets, DraftOutputs

CONFIDENCE_TARGETS = ("sampled", "greedy")


@dataclass
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    kl: float = 0.0
    confidence: float = 1.0
    decay_gamma: Optional[float] = 4.0  # None or 0: every block position weighs the same
    confidence_target: str = "sampled"

    def __post_init__(self) -> None:
        for name in ("ce", "l1", "kl", "confidence"):
            if getattr(self, name) < 0:
                raise ValueError(f"loss weight {name} must be >= 0, got {getattr(self, name)}")
        if self.ce + self.l1 + self.kl <= 0:
            raise ValueError("at least one of the ce, l1 and kl loss weights must be > 0")
        if self.confidence_target not in CONFIDENCE_TARGETS:
            raise ValueError(f"confidence target must be one of {CONFIDENCE_TARGETS}, got {self.confidence_target!r}")


def acceptance(draft_logits: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """(sampled acceptance probability 1 - TV, greedy hit argmax == argmax), both (N, bs) float32, no gradient."""
    draft_probs = mx.softmax(draft_logits, axis=-1)
    target_probs = mx.softmax(target_logits, axis=-1)
    rate = mx.clip(1.0 - 0.5 * mx.abs(draft_probs - target_probs).sum(axis=-1), 0.0, 1.0)
    hit = (mx.argmax(draft_logits, axis=-1) == mx.argmax(target_logits, axis=-1)).astype(mx.float32)
    return mx.stop_gradient(rate), mx.stop_gradient(hit)


def confidence_labels(rate: mx.array, hit: mx.array, *, kind: str) -> mx.array:
    return rate if kind == "sampled" else hit


def position_weights(valid: mx.array, decay_gamma: Optional[float]) -> mx.array:
    if not decay_gamma:
        return valid
    positions = mx.arange(valid.shape[1], dtype=mx.float32)
    return valid * mx.exp(-positions / decay_gamma)[None]


@dataclass
class LossTotals:
    """The normalizers of the weighted means: the sum of the position weights and the number of blocks.

    A data-parallel rank passes the global sums (over every rank's blocks), so that its loss is its
    share of the global mean and the rank losses add up to the single-process loss."""

    weight: mx.array  # scalar
    blocks: mx.array  # scalar


def loss_totals(targets: BlockTargets, weights: LossWeights) -> LossTotals:
    w = position_weights(targets.valid, weights.decay_gamma)
    return LossTotals(weight=w.sum(), blocks=(targets.valid[:, 0] > 0).sum().astype(mx.float32))


def dspark_loss(
    outputs: DraftOutputs, targets: BlockTargets, weights: LossWeights, *, totals: Optional[LossTotals] = None
) -> tuple[mx.array, dict[str, mx.array]]:
    """(scalar loss, metrics) for one batch of blocks; metrics are weighted means, without gradient.

    `totals` (default: this batch's own) are the normalizers of the means."""
    w = position_weights(targets.valid, weights.decay_gamma)  # (N, bs)
    totals = totals or loss_totals(targets, weights)
    total_weight = mx.maximum(totals.weight, 1e-6)

    def mean(per_position: mx.array) -> mx.array:
        return (per_position * w).sum() / total_weight

    log_draft = outputs.logits - mx.logsumexp(outputs.logits, axis=-1, keepdims=True)
    target_log = targets.target_logits - mx.logsumexp(targets.target_logits, axis=-1, keepdims=True)
    target_probs = mx.exp(target_log)
    ce = -mx.take_along_axis(log_draft, targets.labels[..., None], axis=-1)[..., 0]
    l1 = mx.abs(mx.exp(log_draft) - target_probs).sum(axis=-1)
    metrics = {"ce": mean(ce), "l1": mean(l1)}
    loss = weights.ce * metrics["ce"] + weights.l1 * metrics["l1"]
    if weights.kl > 0:
        metrics["kl"] = mean((target_probs * (target_log - log_draft)).sum(axis=-1))
        loss = loss + weights.kl * metrics["kl"]

    # as `acceptance`, from the L1 distance already computed (the softmaxes over V dominate a step on CPU)
    rate = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    hit = (mx.argmax(outputs.logits, axis=-1) == mx.argmax(targets.target_logits, axis=-1)).astype(mx.float32)
    if outputs.confidence_logits is not None and weights.confidence > 0:
        labels = confidence_labels(rate, hit, kind=weights.confidence_target)
        bce = nn.losses.binary_cross_entropy(outputs.confidence_logits, labels, with_logits=True, reduction="none")
        metrics["confidence"] = mean(bce)
        loss = loss + weights.confidence * metrics["confidence"]
    metrics.update(acceptance_metrics(rate, hit, targets.valid, blocks=totals.blocks))
    metrics["loss"] = loss
    return loss, {k: mx.stop_gradient(v) for k, v in metrics.items()}


def acceptance_metrics(
    rate: mx.array, hit: mx.array, valid: mx.array, *, blocks: Optional[mx.array] = None
) -> dict[str, mx.array]:
    """Teacher-forced estimates of the mean acceptance length (accepted drafts + 1) of a full block.

    `tau_greedy`: 1 + the number of leading positions whose draft argmax is the target's argmax;
    `tau_sampled`: 1 + sum_k prod_{j<=k} (1 - TV(j)) (DeepSpec's `tau_probabilistic`). A block counts
    only its valid positions (near the end of a sequence it is shorter). `blocks` (default: the blocks
    of this batch) normalizes the means.
    """
    blocks = mx.maximum((valid[:, 0] > 0).sum() if blocks is None else blocks, 1)
    tau_greedy = 1.0 + mx.cumprod(hit * valid, axis=1).sum(axis=1)
    tau_sampled = 1.0 + mx.cumprod(rate * valid, axis=1).sum(axis=1)
    return {
        "tau_greedy": (tau_greedy * (valid[:, 0] > 0)).sum() / blocks,
        "tau_sampled": (tau_sampled * (valid[:, 0] > 0)).sum() / blocks,
    }
