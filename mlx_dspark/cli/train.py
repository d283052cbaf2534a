"""Command lines: `python -m mlx_dspark.train` (train / fine-tune) and `python -m mlx_dspark.train.calibrate`.

Memory for the real Spark-X2.6-4B pair (estimates from parameter counts; V = 131072, block 7):
- trained draft, 624M parameters: weights + gradients + AdamW moments = 4 copies:
  float32 (`--draft-dtype float32`, the default) 10.0 GB; bfloat16 5.0 GB (Adam moments in bf16: coarser);
- frozen target, 4.1B parameters: bfloat16 8.2 GB; `--target-quantize 4` about 2.3 GB;
- per step: the target's logits of one sequence (S x V in bf16, 0.54 GB at S = 2048), about 22 MB of
  (block x V) float32 tensors per block (blocks = batch size x anchors: 128 blocks = 2.8 GB), and each
  draft layer's gathered context keys/values, 4 MB per block and layer in float32 (`--grad-checkpoint`
  keeps one layer's at a time instead of all five).
So: 4-bit target + float32 draft + 128 blocks with --grad-checkpoint: about 17 GB (a 24 GB Mac);
bfloat16 target instead: about 23 GB (32 GB); 4-bit target + bfloat16 draft + 64 blocks: about 10 GB
(16 GB). Measure with a few --steps first: training.json records the peak memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mlx_dspark.loading.precision import DTYPES, Q_BITS

train_app = typer.Typer(add_completion=False)
calibrate_app = typer.Typer(add_completion=False, help="Calibrate a DSpark draft's confidence head on held-out data.")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def _ids(text: Optional[str], flag: str) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        _fail(f"{flag} must be comma-separated integers, e.g. 1,9,17; got {text!r}")
    return None


# --help ends with the memory guide of the docstring above
_MEMORY_HELP = " ".join(__doc__[__doc__.index("Memory") :].split())


@train_app.command(epilog=_MEMORY_HELP)
def train(
    target: str = typer.Option(..., "--target", help="The frozen target: local directory or Hugging Face repo id."),
    data: list[str] = typer.Option(..., "--data", help="Training text files, .jsonl files or directories (repeatable)."),
    out: Path = typer.Option(..., "--out", help="Output directory: the draft, training.json, checkpoints/."),
    valid_data: list[str] = typer.Option([], "--valid-data", help="Held-out files for evaluation and calibration."),
    init_draft: Optional[str] = typer.Option(None, "--init-draft", help="Fine-tune this draft (starts from its weights)."),
    steps: int = typer.Option(1000, "--steps"),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per step."),
    seq_len: int = typer.Option(1024, "--seq-len", help="Tokens per sequence (documents are cut into chunks)."),
    anchors: int = typer.Option(64, "--anchors", help="Anchors (blocks) sampled per sequence."),
    lr: float = typer.Option(6e-4, "--lr"),
    warmup_ratio: float = typer.Option(0.04, "--warmup-ratio"),
    weight_decay: float = typer.Option(0.0, "--weight-decay"),
    max_grad_norm: float = typer.Option(1.0, "--max-grad-norm"),
    seed: int = typer.Option(0, "--seed"),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", help="Save a resumable checkpoint every N steps (0: never)."),
    keep_checkpoints: int = typer.Option(2, "--keep-checkpoints"),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in --out."),
    force: bool = typer.Option(False, "--force", help="Start over in a non-empty --out."),
    grad_checkpoint: bool = typer.Option(False, "--grad-checkpoint", help="Recompute draft layers in the backward pass."),
    target_dtype: Optional[str] = typer.Option(None, "--target-dtype", help="Cast the frozen target: bfloat16, float16, float32."),
    target_quantize: Optional[int] = typer.Option(None, "--target-quantize", help="Quantize the frozen target: 4 or 8 bits."),
    draft_dtype: str = typer.Option("float32", "--draft-dtype", help="Training dtype of the draft."),
    save_dtype: Optional[str] = typer.Option(None, "--save-dtype", help="dtype of the saved draft (default: as trained)."),
    layers: int = typer.Option(5, "--layers", help="New draft: number of layers."),
    block_size: int = typer.Option(7, "--block-size", help="New draft: tokens per block."),
    target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids", help="New draft: tapped target layers, e.g. 1,9,17,25,33."),
    num_taps: int = typer.Option(5, "--num-taps", help="New draft: taps spread over the target when no ids are given."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="New draft: default the tokenizer's mask token."),
    sliding_window: int = typer.Option(512, "--sliding-window", help="New draft: window of its layers (0: full attention)."),
    markov_rank: int = typer.Option(256, "--markov-rank", help="New draft: 0 for no Markov head."),
    markov_head_type: str = typer.Option("vanilla", "--markov-head", help="New draft: vanilla, gated or rnn."),
    no_confidence_head: bool = typer.Option(False, "--no-confidence-head"),
    ce_weight: float = typer.Option(0.1, "--ce-weight", help="Cross-entropy on the data tokens."),
    l1_weight: float = typer.Option(0.9, "--l1-weight", help="L1 (2 x total variation) to the target's distribution."),
    kl_weight: float = typer.Option(0.0, "--kl-weight", help="KL(target || draft)."),
    confidence_weight: float = typer.Option(1.0, "--confidence-weight"),
    decay_gamma: float = typer.Option(4.0, "--decay-gamma", help="Block position k weighs exp(-(k-1)/gamma); 0: uniform."),
    confidence_target: str = typer.Option("sampled", "--confidence-target", help="sampled (1 - TV, DeepSpec) or greedy."),
    calibrate: bool = typer.Option(False, "--calibrate", help="Fit confidence temperatures on --valid-data afterwards."),
    no_progress: bool = typer.Option(False, "--no-progress"),
    log_every: int = typer.Option(50, "--log-every", help="A plain log line (loss, tokens/s, ETA) every N steps; 0: none."),
) -> None:
    """Train (or fine-tune) a DSpark draft for a frozen target, in MLX.

    Data-parallel on several processes or Macs: `mlx.launch -n 2 -- python -m mlx_dspark.train ...`
    (or `--hostfile`); the global batch is --batch-size, split over the ranks (docs/SCALING.md)."""
    from mlx_dspark.train.loop import TrainOptions
    from mlx_dspark.train.losses import LossWeights
    from mlx_dspark.train.session import DataOptions, DraftShape, Precision, train_draft

    for flag, value in (("--target-dtype", target_dtype), ("--draft-dtype", draft_dtype), ("--save-dtype", save_dtype)):
        if value is not None and value not in DTYPES:
            _fail(f"{flag} must be one of {', '.join(sorted(DTYPES))}, got {value!r}")
    if target_quantize is not None and target_quantize not in Q_BITS:
        _fail(f"--target-quantize must be one of {Q_BITS}, got {target_quantize}")
    try:
        options = TrainOptions(
            steps=steps, anchors=anchors, lr=lr, warmup_ratio=warmup_ratio, weight_decay=weight_decay,
            max_grad_norm=max_grad_norm, seed=seed, checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints, grad_checkpoint=grad_checkpoint, progress=not no_progress,
            log_every=log_every,
            losses=LossWeights(
                ce=ce_weight, l1=l1_weight, kl=kl_weight, confidence=confidence_weight,
                decay_gamma=decay_gamma or None, confidence_target=confidence_target,
            ),
        )  # fmt: skip
        shape = None
        if init_draft is None:
            shape = DraftShape(
                num_layers=layers, block_size=block_size, target_layer_ids=_ids(target_layer_ids, "--target-layer-ids"),
                num_taps=num_taps, mask_token_id=mask_token_id, sliding_window=sliding_window or None,
                markov_rank=markov_rank, markov_head_type=markov_head_type, confidence_head=not no_confidence_head,
            )  # fmt: skip
        train_draft(
            target,
            out,
            data=DataOptions(train=list(data), valid=list(valid_data), seq_len=seq_len, batch_size=batch_size),
            options=options,
            shape=shape,
            init_draft=init_draft,
            precision=Precision(target_dtype, target_quantize, draft_dtype, save_dtype),
            resume=resume,
            force=force,
            calibrate=confidence_target if calibrate else None,
        )
    except (ValueError, FileNotFoundError) as err:
        _fail(str(err))


@calibrate_app.command()
def calibrate(
    target: str = typer.Option(..., "--target", help="The target: local directory or repo id."),
    draft: Path = typer.Option(..., "--draft", help="The draft directory (its config.json is updated)."),
    data: list[str] = typer.Option(..., "--data", help="Held-out text files, .jsonl files or directories."),
    confidence_target: str = typer.Option("greedy", "--confidence-target", help="greedy or sampled acceptance."),
    seq_len: int = typer.Option(1024, "--seq-len"),
    batch_size: int = typer.Option(4, "--batch-size"),
    anchors: int = typer.Option(64, "--anchors"),
    seed: int = typer.Option(0, "--seed"),
    target_quantize: Optional[int] = typer.Option(None, "--target-quantize", help="Quantize the target: 4 or 8 bits."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a reliability diagram (needs matplotlib)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Report only; leave config.json as it is."),
) -> None:
    """Fit one temperature per block position and store them as `confidence_temperatures`."""
    from mlx_dspark.loading.load import load
    from mlx_dspark.train.calibration import calibrate_draft, format_report, write_calibration
    from mlx_dspark.train.data import load_chunks
    from mlx_dspark.train.session import pad_token_id

    try:
        pair = load(target, draft=str(draft), quantize=target_quantize)
        chunks = load_chunks(data, pair.tokenizer, seq_len=seq_len)
        report = calibrate_draft(
            pair.draft, pair.target, chunks, kind=confidence_target, batch_size=batch_size, anchors=anchors,
            seed=seed, pad_id=pad_token_id(pair.tokenizer), plot=plot,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        _fail(str(err))
    typer.echo(format_report(report), err=True)
    if not dry_run:
        write_calibration(draft, report)
        typer.echo(f"wrote confidence_temperatures to {draft / 'config.json'}", err=True)
