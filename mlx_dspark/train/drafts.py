"""The draft a training run starts from (a new one, or an existing one to fine-tune) and how it is saved.

A new draft's config.json is a copy of its target's plus the DSpark fields, as DeepSpec writes it;
its weights are MLX's default initialization (seeded), except the Markov head's output projection,
which starts at zero so the untrained Markov bias adds nothing to the base logits. Drafts are saved
in our layout: config.json and model.safetensors under DeepSpec's parameter names, without copies of
the target's embedding and LM head (the loader shares the target's).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_dspark.loading.checkpoint import ShardWriter, read_checkpoint
from mlx_dspark.models.target.finite import check_finite_weights
from mlx_dspark.loading.load import build_draft
from mlx_dspark.models.heads.dspark.model import DSparkDraft
from mlx_dspark.models.heads.dspark.args import DraftArgs
from mlx_dspark.loading.pair import check_shared_tensors
from mlx_dspark.models.heads.dspark.packaging import Packaging

DRAFT_ARCHITECTURE = {"qwen3": "Qwen3DSparkModel", "spark2_5": "Spark2_5DSparkModel"}
# Target config fields that describe its files, not its layers.
_DROPPED_FIELDS = ("auto_map", "quantization", "quantization_config", "confidence_temperatures")
# A fine-tuned draft's config drops its old calibration: it does not describe the new head.
_STALE_FIELDS = ("confidence_temperatures", "quantization", "quantization_config")


def default_tap_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` tapped layers spread from layer 1 to layer L-3, as DeepSpec's [1, 9, 17, 25, 33] for 36
    layers; a shallow target uses layers 0 .. L-2 (the last layer is never tapped)."""
    if count < 1:
        raise ValueError(f"the number of tapped layers must be >= 1, got {count}")
    low, high = 1, num_target_layers - 3
    if high - low + 1 < count:
        low, high = 0, max(num_target_layers - 2, 0)
    if count == 1:
        return [high]
    return sorted({round(low + i * (high - low) / (count - 1)) for i in range(count)})


def mask_token_id(tokenizer: Any) -> Optional[int]:
    """The tokenizer's mask token id, when it declares one."""
    token_id = getattr(tokenizer, "mask_token_id", None)
    return int(token_id) if isinstance(token_id, int) else None


def new_draft_config(
    target_config: dict,
    *,
    num_layers: int,
    block_size: int,
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    sliding_window: Optional[int],
    markov_rank: int,
    markov_head_type: str,
    confidence_head: bool,
    confidence_with_markov: bool,
) -> dict:
    """The DSpark config.json of a new draft for the target: a copy of the target's plus the DSpark fields.

    `sliding_window` None makes every draft layer full attention, else every layer slides with it.
    """
    family = target_config.get("model_type")
    if family not in DRAFT_ARCHITECTURE:
        raise ValueError(f"target model_type {family!r} has no DSpark draft layout; expected one of {sorted(DRAFT_ARCHITECTURE)}")
    config = copy.deepcopy(target_config)
    for key in _DROPPED_FIELDS:
        config.pop(key, None)
    layer_type = "full_attention" if sliding_window is None else "sliding_attention"
    config.update(
        {
            "architectures": [DRAFT_ARCHITECTURE[family]],
            "block_size": block_size,
            "confidence_head_with_markov": bool(confidence_head and confidence_with_markov and markov_rank > 0),
            "enable_confidence_head": confidence_head,
            "layer_types": [layer_type] * num_layers,
            "markov_head_type": markov_head_type if markov_rank > 0 else None,
            "markov_rank": markov_rank,
            "mask_token_id": mask_token_id,
            "num_hidden_layers": num_layers,
            "num_target_layers": target_config["num_hidden_layers"],
            "sliding_window": sliding_window,
            "target_layer_ids": list(target_layer_ids),
            "tie_word_embeddings": False,
        }
    )
    if family == "qwen3":
        config["use_sliding_window"] = sliding_window is not None
    if family == "spark2_5" and sliding_window is not None and "sliding_attention" not in (config.get("rope_parameters") or {}):
        raise ValueError("the target's rope_parameters has no 'sliding_attention' entry for sliding draft layers; use --sliding-window 0")
    # every field checked before training starts; a new draft's layers are its target's family
    DraftArgs.from_dict(config, family=family, source="the new draft's config")
    return dict(sorted(config.items()))


def new_draft(config: dict, *, dtype: mx.Dtype, seed: int) -> DSparkDraft:
    mx.random.seed(seed)
    draft = DSparkDraft(DraftArgs.from_dict(config, family=config["model_type"], source="the new draft's config"))
    markov = getattr(draft, "markov_head", None)
    if markov is not None:
        markov.markov_w2.weight = mx.zeros_like(markov.markov_w2.weight)
    draft.set_dtype(dtype)
    mx.eval(draft.parameters())
    return draft


def load_draft_for_training(
    draft_path: Path, *, target: nn.Module, target_source: str, dtype: mx.Dtype
) -> tuple[DSparkDraft, dict]:
    """An existing draft (to fine-tune) as `mlx_dspark.load` reads it: checked against its target
    (the pair, finite weights, its copies of the shared tensors), in `dtype`, without its old calibration.

    Returns the draft and the config to save it with."""
    checkpoint = read_checkpoint(draft_path, role="draft")
    if "quantization" in checkpoint.config:
        raise ValueError(f"{checkpoint.config_source}: a quantized draft cannot be trained; start from a float checkpoint")
    checkpoint.config = {k: v for k, v in checkpoint.config.items() if k not in _STALE_FIELDS}
    draft, shared = build_draft(checkpoint, target=target, target_source=target_source, dtype=dtype)
    check_finite_weights(draft, what=f"draft ({draft_path})")
    if draft.args.packaging != Packaging():
        # the trainer builds DeepSpec's blocks (anchor-first, full vocabulary, no scales)
        raise ValueError(f"{draft_path}: the draft is packaged as {draft.args.packaging}; training supports DeepSpec's layout only")
    if check_shared_tensors(shared, target, draft_source=str(draft_path), storage=checkpoint.storage):
        raise ValueError(f"{draft_path}: the draft's embedding differs from the target's in a few rows; training such a draft is not supported")
    mx.eval(draft.parameters())
    return draft, checkpoint.config


def save_draft(draft: nn.Module, config: dict, directory: Path, *, dtype: Optional[mx.Dtype] = None) -> Path:
    """Write config.json and the weights (cast to `dtype`, default as trained) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in list(directory.glob("*.safetensors")) + [directory / "model.safetensors.index.json"]:
        if old.is_file():
            old.unlink()
    weights = dict(tree_flatten(draft.parameters()))
    dtype = dtype or next(iter(weights.values())).dtype
    writer = ShardWriter(directory)
    for name, array in sorted(weights.items()):
        writer.add(name, array.astype(dtype) if mx.issubdtype(array.dtype, mx.floating) else array)
    writer.finish()
    config = dict(config)
    dtype_name = str(dtype).split(".")[-1]
    config["dtype"] = dtype_name
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype_name
    (directory / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return directory


def replace_directory(source: Path, destination: Path) -> None:
    """Move a finished directory into place (the old one, if any, is removed first)."""
    if destination.exists():
        shutil.rmtree(destination)
    source.rename(destination)
