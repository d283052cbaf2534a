"""The training loop: AdamW with linear warmup and cosine decay, gradient clipping, checkpoints, exact resume.

A step's batch and anchors are pure functions of (seed, step), so `--resume` from the checkpoint of
step s continues exactly as the uninterrupted run (same batches, same anchors, same optimizer state).
Checkpoints live in `out/checkpoints/step-NNNNNN/`: a loadable draft directory (config.json,
model.safetensors) plus `optimizer/state.safetensors` and `trainer_state.json` (the step and the
per-step history so far).

Under `mlx.launch` every rank runs this loop on its share of each global batch (`distributed.py`);
the anchors of a sequence are keyed by its index in the global batch, so a step does not depend on
the number of ranks, and `--resume` works with any number of them. Rank 0 alone logs and writes.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dspark.loading.checkpoint import read_checkpoint
from mlx_dspark.train.data import Batch, Batches, Chunk
from mlx_dspark.train.distributed import World
from mlx_dspark.train.drafts import replace_directory, save_draft
from mlx_dspark.train.forward import block_targets, draft_forward, held_out_blocks, sample_anchors, target_pass
from mlx_dspark.train.losses import LossTotals, LossWeights, dspark_loss, loss_totals
from mlx_dspark.loading.weights import fill_model

CHECKPOINTS = "checkpoints"


@dataclass
class TrainOptions:
    steps: int
    anchors: int = 64  # anchors sampled per sequence
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    checkpoint_every: int = 0  # 0: only the final draft
    keep_checkpoints: int = 2
    grad_checkpoint: bool = False  # recompute each draft layer in the backward pass (mx.checkpoint)
    losses: LossWeights = field(default_factory=LossWeights)
    progress: bool = True
    log_every: int = 50  # a plain log line every N steps (0: none), with or without the progress bar

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.anchors < 1:
            raise ValueError(f"anchors must be >= 1, got {self.anchors}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("checkpoint_every must be >= 0 and keep_checkpoints >= 1")
        if self.log_every < 0:
            raise ValueError(f"log_every must be >= 0, got {self.log_every}")


# Options that change how a run reports, not what it computes: a resumed run may change them.
REPORTING_OPTIONS = ("progress", "checkpoint_every", "keep_checkpoints", "log_every")


def learning_rate_schedule(options: TrainOptions) -> Callable[[mx.array], mx.array]:
    warmup = max(1, round(options.warmup_ratio * options.steps))
    decay = optim.cosine_decay(options.lr, max(options.steps - warmup, 1))
    return optim.join_schedules([optim.linear_schedule(options.lr / warmup, options.lr, warmup), decay], [warmup])


def sequence_anchors_rng(seed: int, step: int, index: int) -> np.random.Generator:
    """The anchors of the `index`-th sequence of step `step`'s global batch (the same on any rank)."""
    return np.random.default_rng([seed, step, 1, index])


class Trainer:
    def __init__(
        self,
        draft: nn.Module,
        target: Any,
        config: dict,
        batches: Batches,
        options: TrainOptions,
        *,
        out_dir: Path,
        fingerprint: dict,
        world: World = World(None),
    ):
        self.draft, self.target, self.config = draft, target, config
        self.batches, self.options, self.out_dir = batches, options, out_dir
        self.fingerprint = fingerprint
        self.world = world
        self.tap_ids = tuple(draft.args.target_layer_ids)
        self.optimizer = optim.AdamW(learning_rate=learning_rate_schedule(options), weight_decay=options.weight_decay)
        self.optimizer.init(draft.trainable_parameters())
        self.history: list[dict[str, float]] = []  # per step: step (1-based), loss, tau_greedy
        if world.size > 1:  # the same starting weights on every rank: rank 0's
            draft.update(world.broadcast_tree(draft.parameters()))

    # -- one step ------------------------------------------------------------------------------------

    def loss_and_grads(
        self, batch: Batch, rng: np.random.Generator | Sequence[np.random.Generator]
    ) -> tuple[dict[str, mx.array], dict]:
        """This rank's metrics (its share of the global means) and the averaged gradients of the global loss."""
        anchors = sample_anchors(batch.loss_mask, num_anchors=self.options.anchors, rng=rng)
        tokens = mx.array(batch.tokens)
        target_logits, features = target_pass(self.target, tokens, self.tap_ids)
        targets = block_targets(batch, anchors, target_logits, block_size=self.draft.args.block_size)
        mx.eval(targets.target_logits)
        del target_logits  # only the (blocks, block_size, V) slice is kept
        totals = None
        if self.world.size > 1:
            local = loss_totals(targets, self.options.losses)
            summed = self.world.all_sum(mx.stack([local.weight, local.blocks]))
            totals = LossTotals(weight=summed[0], blocks=summed[1])
        scale = float(self.world.size)  # average_gradients divides the sum of the rank gradients by N

        def loss_fn(features: mx.array, tokens: mx.array, prev: mx.array):
            outputs = draft_forward(
                self.draft, self.target, features, tokens, anchors, prev, checkpoint=self.options.grad_checkpoint
            )
            loss, metrics = dspark_loss(outputs, targets, self.options.losses, totals=totals)
            return loss * scale if scale != 1 else loss, metrics

        (_, metrics), grads = nn.value_and_grad(self.draft, loss_fn)(features, tokens, targets.prev)
        if self.world.size > 1:
            grads = nn.average_gradients(grads, group=self.world.group)
        return metrics, grads

    def step(self, step: int) -> dict[str, float]:
        share = self.world.share(len(self.batches.picks(step)))
        rngs = [sequence_anchors_rng(self.options.seed, step, i) for i in range(share.start, share.stop)]
        batch = self.batches(step, share)
        metrics, grads = self.loss_and_grads(batch, rngs)
        grads, grad_norm = optim.clip_grad_norm(grads, self.options.max_grad_norm)
        self.optimizer.update(self.draft, grads)
        names = sorted(metrics)
        # the rank metrics are shares of the global means: their sum is the global metric
        tokens = mx.array(float(batch.loss_mask.sum()))  # trained tokens of this rank's sequences
        summed = self.world.all_sum(mx.stack([metrics[k] for k in names] + [tokens]))
        mx.eval(self.draft.parameters(), self.optimizer.state, summed, grad_norm)
        values = summed.tolist()
        out = dict(zip(names, values[:-1]))
        out["grad_norm"] = grad_norm.item()
        out["tokens"] = values[-1]
        return out

    # -- checkpoints ---------------------------------------------------------------------------------

    def checkpoint_dirs(self) -> list[Path]:
        root = self.out_dir / CHECKPOINTS
        return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")) if root.is_dir() else []

    def save_checkpoint(self, step: int) -> Path:
        final = self.out_dir / CHECKPOINTS / f"step-{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        save_draft(self.draft, self.config, tmp)
        (tmp / "optimizer").mkdir(exist_ok=True)
        mx.save_safetensors(str(tmp / "optimizer" / "state.safetensors"), dict(tree_flatten(self.optimizer.state)))
        state = {"step": step, "fingerprint": self.fingerprint, "history": self.history}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        replace_directory(tmp, final)
        for old in self.checkpoint_dirs()[: -self.options.keep_checkpoints]:
            shutil.rmtree(old)
        return final

    def resume(self) -> int:
        """Load the latest checkpoint; returns the step to continue from (0 when there is none).

        Rank 0 reads it and broadcasts the weights and the optimizer state, so the other ranks need
        no copy of the output directory (and the number of ranks may differ from the saving run's)."""
        step, error = 0, None
        if self.world.is_main:
            try:
                step = self._load_latest()
            except (ValueError, FileNotFoundError) as err:
                step, error = -1, err
        step = self.world.broadcast_int(step)
        if error is not None:
            raise error
        if step < 0:
            raise ValueError("rank 0 could not resume from its checkpoint (its log says why)")
        if step > 0 and self.world.size > 1:
            self.draft.update(self.world.broadcast_tree(self.draft.parameters()))
            self.optimizer.state = self.world.broadcast_tree(self.optimizer.state)
        return step

    def _load_latest(self) -> int:
        dirs = self.checkpoint_dirs()
        if not dirs:
            return 0
        latest = dirs[-1]
        state = json.loads((latest / "trainer_state.json").read_text(encoding="utf-8"))
        changed = {
            k: (state["fingerprint"].get(k), v) for k, v in self.fingerprint.items() if state["fingerprint"].get(k) != v
        }
        if changed:
            raise ValueError(
                f"{latest}: cannot resume with other settings (checkpoint vs now): {changed}; "
                "use the same data and options, or start in a new --out directory"
            )
        saved = read_checkpoint(latest)
        fill_model(
            self.draft, saved.config, saved.weights, saved.origin,
            source=str(latest), what="draft checkpoint", dtype=self.draft.hidden_norm.weight.dtype,
        )  # fmt: skip
        self.optimizer.state = tree_unflatten(list(mx.load(str(latest / "optimizer" / "state.safetensors")).items()))
        mx.eval(self.draft.parameters(), self.optimizer.state)
        self.history = [entry for entry in state.get("history", []) if entry["step"] <= state["step"]]
        return int(state["step"])

    # -- the run -------------------------------------------------------------------------------------

    def run(self, *, start: int = 0, log: Callable[[str], None]) -> dict[str, float]:
        from tqdm import tqdm

        main = self.world.is_main
        smoothed: dict[str, float] = {}
        show_bar = self.options.progress and main
        bar = tqdm(total=self.options.steps, initial=start, file=sys.stderr, disable=not show_bar, dynamic_ncols=True)
        say = bar.write if show_bar else log  # plain lines under a live bar would break it
        started, tokens = time.perf_counter(), 0.0
        for step in range(start, self.options.steps):
            metrics = self.step(step)
            tokens += metrics.pop("tokens")
            self.history.append({"step": step + 1, "loss": metrics["loss"], "tau_greedy": metrics["tau_greedy"]})
            for k, v in metrics.items():  # running (exponential) averages for the bar
                smoothed[k] = v if k not in smoothed else 0.9 * smoothed[k] + 0.1 * v
            bar.set_postfix(
                loss=f"{smoothed['loss']:.3f}",
                tau=f"{smoothed['tau_greedy']:.2f}",
                tau_T1=f"{smoothed['tau_sampled']:.2f}",
                lr=f"{self.optimizer.learning_rate.item():.1e}",
                refresh=False,
            )
            bar.update(1)
            done = step + 1
            if main and self.options.log_every and (done % self.options.log_every == 0 or done == self.options.steps):
                say(progress_line(done, self.options.steps, smoothed, tokens, time.perf_counter() - started, done - start))
            if main and self.options.checkpoint_every and done % self.options.checkpoint_every == 0 and done < self.options.steps:
                say(f"checkpoint {self.save_checkpoint(done)}")
        bar.close()
        return smoothed


def progress_line(done: int, steps: int, smoothed: dict[str, float], tokens: float, elapsed: float, ran: int) -> str:
    """`step 50/1000  loss 2.134  tau 2.41  tau_T1 2.87  1520 tok/s  ETA 0:31:12` (smoothed metrics,
    the throughput and the time left of this session's steps)."""
    rate = tokens / elapsed if elapsed > 0 else 0.0
    left = (steps - done) * elapsed / max(ran, 1)
    hours, rest = divmod(int(left), 3600)
    return (
        f"step {done}/{steps}  loss {smoothed['loss']:.4f}  tau {smoothed['tau_greedy']:.2f}  "
        f"tau_T1 {smoothed['tau_sampled']:.2f}  {rate:.0f} tok/s  ETA {hours}:{rest // 60:02d}:{rest % 60:02d}"
    )


def evaluate(
    draft: nn.Module,
    target: Any,
    chunks: list[Chunk],
    *,
    batch_size: int,
    anchors: int,
    seed: int,
    losses: LossWeights,
    pad_id: int,
) -> dict[str, float]:
    """Block-weighted mean metrics over held-out chunks (fixed anchors from `seed`)."""
    rng = np.random.default_rng([seed, 2])
    sums: dict[str, float] = {}
    blocks = 0
    blocks_of = held_out_blocks(draft, target, chunks, batch_size=batch_size, anchors=anchors, rng=rng, pad_id=pad_id)
    for picked, targets, outputs in blocks_of:
        _, metrics = dspark_loss(outputs, targets, losses)
        n = len(picked.pos)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v.item() * n
        blocks += n
    return {k: v / max(blocks, 1) for k, v in sums.items()}


def run_summary(
    options: TrainOptions, *, start: int, wall: float, final: dict[str, float], world_size: int = 1,
    history: Sequence[dict] = (),
) -> dict:
    return {
        "options": {k: v for k, v in asdict(options).items() if k != "progress"},
        "world_size": world_size,
        "resumed_from_step": start,
        "steps": options.steps,
        "wall_seconds": round(wall, 1),
        "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 3),
        "final_train_metrics": {k: round(v, 4) for k, v in final.items()},
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "history": list(history),
    }
