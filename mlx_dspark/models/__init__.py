"""Model families. A target's family comes from its config's `architectures` (never `model_type`): our
own modules for the architectures below, mlx-lm's model of the config's `model_type` for any other
(`models/mlx_lm_target.py`). A DSpark draft's layer family comes from its tensors (`models/dspark_args.py`)."""

from __future__ import annotations

import importlib
from types import ModuleType

# architectures entry -> family module under mlx_dspark.models
TARGET_ARCHITECTURES = {
    "Spark2_5ForCausalLM": "spark2_5",
    "Qwen3ForCausalLM": "qwen3",
}
# layer families: a target family module also has `Model`; gemma4 builds draft layers only
FAMILIES = ("qwen3", "spark2_5", "gemma4")


def family_module(family: str) -> ModuleType:
    """The module of a layer family: `ModelArgs`, `Attention`, `MLP`, `Norm`, `ATTENTION_TENSOR` (and `Model` for a target family)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown layer family {family!r}; expected one of {list(FAMILIES)}")
    return importlib.import_module(f"mlx_dspark.models.{family}")


def runs_on_mlx_lm(config: dict) -> bool:
    """Whether a target config is run by mlx-lm's model of its `model_type` (architectures not ours)."""
    architectures = config.get("architectures")
    return not (isinstance(architectures, list) and architectures and architectures[0] in TARGET_ARCHITECTURES)


def target_module(config: dict, *, source: str = "config.json") -> ModuleType:
    """The module (with `ModelArgs` and `Model`) for a target config; ValueError naming the field."""
    architectures = config.get("architectures")
    if not architectures or not isinstance(architectures, list):
        raise ValueError(f"{source}: field 'architectures' is missing; expected one of {sorted(TARGET_ARCHITECTURES)}")
    name = architectures[0]
    if name not in TARGET_ARCHITECTURES:
        raise ValueError(
            f"{source}: architectures {name!r} is not supported; expected one of {sorted(TARGET_ARCHITECTURES)}"
        )
    return family_module(TARGET_ARCHITECTURES[name])
