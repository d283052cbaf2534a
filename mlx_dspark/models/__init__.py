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
    "Spark2_5DSparkModel": "spark2_5",
}
# Fields whose presence marks a config as a DSpark draft (its other fields are a copy of the target's).
DSPARK_MARKER_FIELDS = ("block_size", "target_layer_ids", "mask_token_id")


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


def draft_family(config: dict, *, source: str = "config.json") -> str:
    """Layer family ("qwen3" / "spark2_5") of a DSpark draft config; ValueError naming the field.

    A draft config copies its target's, so `architectures` names the family only when it is a DSpark
    architecture; otherwise (e.g. a Spark draft that kept its target's entry) `model_type` does.
    """
    missing = [k for k in DSPARK_MARKER_FIELDS if k not in config]
    if missing:
        raise ValueError(f"{source}: not a DSpark draft config: missing field(s) {missing}")
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures and architectures[0] in DRAFT_ARCHITECTURES:
        return DRAFT_ARCHITECTURES[architectures[0]]
    model_type = config.get("model_type")
    families = sorted(set(DRAFT_ARCHITECTURES.values()))
    if model_type not in families:
        raise ValueError(
            f"{source}: cannot tell the draft's layer family: architectures {architectures!r} is not one of "
            f"{sorted(DRAFT_ARCHITECTURES)} and model_type {model_type!r} is not one of {families}"
        )
    return model_type
