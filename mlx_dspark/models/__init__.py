"""Model families, chosen by a config's `architectures` (never by `model_type`)."""

from __future__ import annotations

import importlib
from types import ModuleType

# architectures entry -> module under mlx_dspark.models
TARGET_ARCHITECTURES = {
    "Spark2_5ForCausalLM": "spark2_5",
    "Qwen3ForCausalLM": "qwen3",
}
DRAFT_ARCHITECTURES = {
    "Qwen3DSparkModel": "qwen3",
}


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
    return importlib.import_module(f"mlx_dspark.models.{TARGET_ARCHITECTURES[name]}")
