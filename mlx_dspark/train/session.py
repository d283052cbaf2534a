"""One training run from start to finish: load the frozen target, build or load the draft, read the data,
train (or resume), evaluate on held-out data, save the draft, and optionally calibrate its confidence head.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_dspark.loading.precision import parse_dtype
from mlx_dspark.train.calibration import calibrate_draft, format_report, write_calibration
from mlx_dspark.train.data import Batches, load_chunks
from mlx_dspark.train.drafts import (
    default_tap_ids,
    load_draft_for_training,
    mask_token_id,
    new_draft,
    new_draft_config,
    save_draft,
)
from mlx_dspark.train.distributed import init_world
from mlx_dspark.train.loop import CHECKPOINTS, REPORTING_OPTIONS, Trainer, TrainOptions, evaluate, run_summary

TRAINING_FILE = "training.json"


@dataclass
class DataOptions:
    train: list[str]
    valid: list[str] = field(default_factory=list)
    seq_len: int = 1024
    batch_size: int = 4  # sequences per step


@dataclass
class DraftShape:
    """A new draft (DeepSpec's Qwen3-4B recipe by default: 5 layers, 5 taps, block 7, vanilla Markov rank 256)."""

    num_layers: int = 5
    block_size: int = 7
    target_layer_ids: Optional[list[int]] = None  # default: `num_taps` layers spread over the target
    num_taps: int = 5
    mask_token_id: Optional[int] = None  # default: the tokenizer's mask token
    sliding_window: Optional[int] = 512  # None: full-attention draft layers
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_with_markov: bool = True


@dataclass
class Precision:
    target_dtype: Optional[str] = None  # cast the frozen target ("bfloat16", ...); None keeps the checkpoint's
    target_quantize: Optional[int] = None  # 4 or 8: quantize the frozen target at load time
    draft_dtype: str = "float32"  # the draft's weights, gradients and Adam states while training
    save_dtype: Optional[str] = None  # the saved draft's weights; None: as trained


def _log(message: str) -> None:
    print(f"[train] {message}", file=sys.stderr, flush=True)


def _silent(message: str) -> None:
    pass


def _prepare_out(out: Path, *, resume: bool, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; expected a directory")
    if out.is_dir() and any(out.iterdir()) and not resume:
        if not force:
            raise ValueError(f"--out {out} is not empty; pass --resume to continue its run or --force to start over")
        for name in (CHECKPOINTS,):
            if (out / name).is_dir():
                shutil.rmtree(out / name)
        for path in list(out.glob("*.safetensors")) + [out / n for n in ("config.json", "model.safetensors.index.json", TRAINING_FILE, "calibration.json")]:
            if path.is_file():
                path.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _build_draft(
    pair: Any, *, shape: Optional[DraftShape], init_draft: Optional[str], dtype: mx.Dtype, seed: int
) -> tuple[Any, dict]:
    if init_draft is not None:
        from mlx_dspark.loading.checkpoint import resolve_path

        return load_draft_for_training(
            resolve_path(init_draft, role="draft"), target=pair.target, target_source=str(pair.target_path), dtype=dtype
        )
    shape = shape or DraftShape()
    mask_id = shape.mask_token_id if shape.mask_token_id is not None else mask_token_id(pair.tokenizer)
    if mask_id is None:
        raise ValueError(
            "the tokenizer declares no mask token: pass --mask-token-id (an id the text never uses, e.g. DeepSpec's "
            "151669 for Qwen3)"
        )
    num_target_layers = pair.target_config["num_hidden_layers"]
    config = new_draft_config(
        pair.target_config,
        num_layers=shape.num_layers,
        block_size=shape.block_size,
        target_layer_ids=shape.target_layer_ids or default_tap_ids(num_target_layers, shape.num_taps),
        mask_token_id=mask_id,
        sliding_window=shape.sliding_window,
        markov_rank=shape.markov_rank,
        markov_head_type=shape.markov_head_type,
        confidence_head=shape.confidence_head,
        confidence_with_markov=shape.confidence_with_markov,
    )
    return new_draft(config, dtype=dtype, seed=seed), config


def pad_token_id(tokenizer: Any) -> int:
    """The id that pads batches (never a training target: its loss mask is off)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def train_draft(
    target: str | Path,
    out: str | Path,
    *,
    data: DataOptions,
    options: TrainOptions,
    shape: Optional[DraftShape] = None,
    init_draft: Optional[str] = None,
    precision: Optional[Precision] = None,
    resume: bool = False,
    force: bool = False,
    calibrate: Optional[str] = None,
    log: Callable[[str], None] = _log,
) -> Path:
    """Train a DSpark draft for `target` and save it in `out`; returns `out`.

    `init_draft` fine-tunes an existing draft (its weights and config) instead of building `shape`.
    `calibrate` ("greedy" or "sampled") fits the confidence temperatures on `data.valid` afterwards.
    """
    from mlx_dspark.loading.load import load

    if shape is not None and init_draft is not None:
        raise ValueError("give either a new draft's shape or --init-draft to fine-tune, not both")
    if calibrate is not None and not data.valid:
        raise ValueError("calibration needs held-out data: pass --valid-data")
    out = Path(out).expanduser()
    world = init_world()
    if world.is_main:
        _prepare_out(out, resume=resume, force=force)
    else:
        log = _silent  # rank 0 alone reports
    started = time.perf_counter()
    precision = precision or Precision()
    pair = load(target, dtype=precision.target_dtype, quantize=precision.target_quantize)
    draft, config = _build_draft(
        pair, shape=shape, init_draft=init_draft, dtype=parse_dtype(precision.draft_dtype), seed=options.seed
    )
    chunks = load_chunks(data.train, pair.tokenizer, seq_len=data.seq_len)
    valid = load_chunks(data.valid, pair.tokenizer, seq_len=data.seq_len) if data.valid else []
    pad_id = pad_token_id(pair.tokenizer)
    num_params = sum(v.size for _, v in tree_flatten(draft.parameters()))
    log(
        f"draft: {num_params / 1e6:.2f}M parameters, {draft.args.num_hidden_layers} layers, taps {draft.args.target_layer_ids}; "
        f"data: {len(chunks)} training chunks ({sum(len(c.tokens) for c in chunks)} tokens), {len(valid)} held-out"
        + (f"; {world.size} data-parallel ranks" if world.size > 1 else "")
    )
    fingerprint = {
        "options": {k: v for k, v in asdict(options).items() if k not in REPORTING_OPTIONS},
        "data": {"seq_len": data.seq_len, "batch_size": data.batch_size, "chunks": len(chunks), "tokens": sum(len(c.tokens) for c in chunks)},
        "draft": init_draft if init_draft is not None else asdict(shape or DraftShape()),
    }
    fingerprint = json.loads(json.dumps(fingerprint))  # as it reads back from trainer_state.json
    batches = Batches(chunks, batch_size=data.batch_size, seed=options.seed, pad_id=pad_id)
    trainer = Trainer(draft, pair.target, config, batches, options, out_dir=out, fingerprint=fingerprint, world=world)
    start = trainer.resume() if resume else 0
    if resume:
        log(f"resuming at step {start}" if start else "no checkpoint to resume from: starting at step 0")
    final = trainer.run(start=start, log=log)
    if not world.is_main:
        return out  # the other ranks' work ends with the last step; rank 0 evaluates and saves
    summary = run_summary(
        options, start=start, wall=time.perf_counter() - started, final=final, world_size=world.size,
        history=trainer.history,
    )  # fmt: skip
    summary["draft_parameters"] = num_params
    if valid:
        metrics = evaluate(
            draft, pair.target, valid, batch_size=data.batch_size, anchors=options.anchors, seed=options.seed,
            losses=options.losses, pad_id=pad_id,
        )
        summary["held_out_metrics"] = {k: round(v, 4) for k, v in metrics.items()}
        log("held-out: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    save_draft(draft, config, out, dtype=parse_dtype(precision.save_dtype))
    if calibrate is not None:
        report = calibrate_draft(
            draft, pair.target, valid, kind=calibrate, batch_size=data.batch_size, anchors=options.anchors,
            seed=options.seed, pad_id=pad_id,
        )
        write_calibration(out, report)
        log(format_report(report))
    (out / TRAINING_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    log(f"wrote the draft to {out} ({summary['wall_seconds']} s, peak memory {summary['peak_memory_gb']} GB)")
    return out
