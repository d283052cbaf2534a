"""Self-speculation (`load(target, draft="self")`, `--draft self`, `"self:N"`): the target's own first N layers,
final norm and head as the draft (models/heads/self_draft). Nothing is read besides the target: `self:N` is
checked against the target's layer count here, `self` alone chooses N at first use."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.loading.checkpoint import Checkpoint
from mlx_dspark.models.heads.self_draft.model import SELF_DRAFT, SelfDraft, check_num_layers

# -- the head's loader declarations (loading/heads/__init__.py) ---------------------------------------------
DESCRIPTION = "the target's own first layers (self-speculation)"
HELP = "the target's own first N layers and its head as the draft, no download ('self:N'; 'self' picks N from measured acceptance)"  # --draft's help
FROM_TARGET = True  # named in draft= as "self", read from nothing but the target
TAKES_ARG = True  # "self:N": the number of target layers the draft runs


def detect(config: dict) -> bool:
    return False  # no draft file of its own


def parse_layers(arg: Optional[str]) -> Optional[int]:
    """N of "self:N" (None for "self"); ValueError naming the text and the fix."""
    if arg is None:
        return None
    if not arg.strip().isdigit():
        raise ValueError(f"draft: {SELF_DRAFT}:{arg} is not {SELF_DRAFT}:N with N a whole number of target layers "
                         f"(e.g. {SELF_DRAFT}:8), or '{SELF_DRAFT}' to choose N from measured acceptance")  # fmt: skip
    return int(arg)


def _layer_count(config: dict) -> Optional[int]:
    for fields in (config, config.get("text_config") or {}):
        count = fields.get("num_hidden_layers", fields.get("n_layer", fields.get("num_layers")))
        if isinstance(count, int):
            return count
    return None


def build_from_target(checkpoint: Checkpoint, *, dtype: Optional[mx.Dtype] = None, arg: Optional[str] = None) -> nn.Module:
    num_layers = parse_layers(arg)
    total = _layer_count(checkpoint.config)
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"draft: {SELF_DRAFT}:{num_layers} is out of range: give N of 1 or more target layers")
        if total is not None:  # else checked against the built target at first use
            check_num_layers(num_layers, total, source=f"draft ({checkpoint.config_source})")
    return SelfDraft(num_layers)


def quantize(module: nn.Module, *, bits: int, group_size: int) -> None:
    """Nothing of its own to quantize: the draft is the (quantized) target's own layers."""


def target_weights(config: dict, weights: dict) -> dict:
    """The target keeps every tensor: the draft is its own layers."""
    return weights
