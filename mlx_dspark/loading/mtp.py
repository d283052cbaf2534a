"""A target's own MTP layers (`load(target, draft="mtp")`, `--draft mtp`): read from the target's checkpoint.

mlx-lm's qwen3_5 `sanitize` drops every `mtp.*` tensor, so the target model never sees them; they are
taken here from the same checkpoint, before that, into `models/mtp_qwen3_5.MTP`. MLX conversions made by
mlx-lm lack them; ours (`python -m mlx_dspark.convert`) keep them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.loading.checkpoint import Checkpoint, read_header, weight_files
from mlx_dspark.loading.weights import fill_model
from mlx_dspark.models.mtp_qwen3_5 import MODEL_TYPES, MTP, PREFIX, MTPArgs, is_raw_hf, mtp_layer_count

MTP_DRAFT = "mtp"  # the `draft=` / `--draft` value naming the target's own MTP layers


def _model_type(config: dict) -> Optional[str]:
    return config.get("model_type")


def supports_mtp(config: dict) -> bool:
    """Whether a target config declares MTP layers of a family we build."""
    return _model_type(config) in MODEL_TYPES and mtp_layer_count(config) > 0


def how_to_get(source: str) -> str:
    return (
        f"load the original Hugging Face checkpoint instead (its safetensors hold mtp.*), or convert that with "
        f"`python -m mlx_dspark.convert` (which keeps them); an mlx-lm conversion ({source}) drops them"
    )


def build_mtp(checkpoint: Checkpoint, *, dtype: Optional[mx.Dtype] = None) -> MTP:
    """The MTP layers of a target checkpoint (lazy weights); one clear ValueError when there are none."""
    config, source = checkpoint.config, checkpoint.config_source
    model_type = _model_type(config)
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"{source}: draft 'mtp': model_type {model_type!r} has no MTP layers we can run (supported: "
            f"{', '.join(MODEL_TYPES)}); pass a DSpark draft, --draft lookup, or --no-draft"
        )
    if mtp_layer_count(config) < 1:
        raise ValueError(
            f"{source}: draft 'mtp': text_config.mtp_num_hidden_layers is absent or 0, so this target carries no MTP "
            "layers; pass a DSpark draft, --draft lookup, or --no-draft"
        )
    weights = {k: v for k, v in checkpoint.weights.items() if k.startswith(PREFIX)}
    if not weights:
        raise ValueError(
            f"{checkpoint.path}: draft 'mtp': the config declares {mtp_layer_count(config)} MTP layer(s) but the weights "
            f"hold no mtp.* tensors; {how_to_get(str(checkpoint.path))}"
        )
    model = MTP(MTPArgs.from_dict(config, source=source), raw_norms=is_raw_hf({k: v.shape for k, v in checkpoint.weights.items()}))
    origin = {k: v for k, v in checkpoint.origin.items() if k.startswith(PREFIX)}
    model = fill_model(
        model, config, weights, {k[len(PREFIX):]: v for k, v in origin.items()},
        source=str(checkpoint.path), what="MTP layers", dtype=checkpoint.default_dtype if dtype is None else dtype,
        config_name=Path(source).name,
    )  # fmt: skip
    model.eval()
    return model


def quantize_mtp(model: nn.Module, *, bits: int, group_size: int) -> None:
    """The MTP's linear layers at the target's load-time precision (its norms stay in float)."""
    nn.quantize(model, group_size, bits, class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0)


def has_mtp_tensors(path: str | Path) -> bool:
    """Whether a local checkpoint directory's safetensors hold `mtp.*` tensors (file headers only)."""
    try:
        return any(name.startswith(PREFIX) for file in weight_files(Path(path)) for name in read_header(file))
    except (OSError, ValueError):
        return False
