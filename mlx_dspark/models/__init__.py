"""Model families. Every target is mlx-lm's own model of its config's `model_type`
(`models/target/mlx_lm.py`), through a class of ours only where `TARGET_CLASS_OVERRIDES` names one and its
module says, with the measurement, why. A DSpark draft's layer family comes from its tensors
(`models/heads/dspark/args.py`); `FAMILIES` are the layer families a draft is built from."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

# model_type -> module under mlx_dspark.models whose `Model` replaces mlx-lm's class of that model_type
TARGET_CLASS_OVERRIDES = {"spark2_5": "target.spark2_5"}
# draft layer families: `ModelArgs`, `Attention`, `MLP`, `Norm`, `ATTENTION_TENSOR`
FAMILIES = ("qwen3", "spark2_5", "gemma4")


def family_module(family: str) -> ModuleType:
    """The module of a draft layer family: `ModelArgs`, `Attention`, `MLP`, `Norm`, `ATTENTION_TENSOR`."""
    if family not in FAMILIES:
        raise ValueError(f"unknown layer family {family!r}; expected one of {list(FAMILIES)}")
    return importlib.import_module(f"mlx_dspark.models.layers.{family}")


def target_model_class(config: dict) -> Optional[type]:
    """Our class in place of mlx-lm's for a target config, or None (mlx-lm's own)."""
    name = TARGET_CLASS_OVERRIDES.get(config.get("model_type"))
    return None if name is None else importlib.import_module(f"mlx_dspark.models.{name}").Model
