"""A Hugging Face checkpoint directory as the Hugging Face exports write it: one `model.safetensors`
(metadata `format: pt`, as PyTorch's `save_file` writes it) and a `config.json`; the weights file is
written under a hidden name and renamed when whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

WEIGHTS_FILE = "model.safetensors"


def weights_dtype(weights: dict[str, mx.array]) -> mx.Dtype:
    """The matrices' one float type (float32 when they mix)."""
    kinds = {v.dtype for v in weights.values() if v.ndim >= 2 and mx.issubdtype(v.dtype, mx.floating)}
    return kinds.pop() if len(kinds) == 1 else mx.float32


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).split(".")[-1]


def draft_fields(args: Any, *, dtype: mx.Dtype) -> dict[str, Any]:
    """The fields a block draft's config.json states from its parsed args whatever the layout: its layers,
    untied (the head is the target's), the weights' dtype, the target depth it was trained on if known."""
    name = dtype_name(dtype)
    fields = {
        "layer_types": list(args.layer_types),
        "num_hidden_layers": args.num_hidden_layers,
        "tie_word_embeddings": False,
        "dtype": name,
        "torch_dtype": name,
    }
    if args.num_target_layers is not None:
        fields["num_target_layers"] = args.num_target_layers
    return fields


def write_checkpoint(out: Path, weights: dict[str, mx.array], config: dict, *, dtype: mx.Dtype) -> None:
    """Write `weights` (every float tensor cast to `dtype`, integer / bool tensors as they are) and
    `config` into the directory `out` (created; the caller checked it may be written)."""
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in sorted(weights.items())}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".export.tmp.safetensors"  # mx.save_safetensors wants the suffix; hidden until it is whole
    mx.eval(list(weights.values()))
    mx.save_safetensors(str(tmp), weights, metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_FILE)
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
