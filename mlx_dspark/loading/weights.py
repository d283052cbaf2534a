"""Weights into a model built from its config: stored quantization, strict checks, dtype casts.

A missing, unexpected or mis-shaped tensor is one ValueError naming the checkpoint, the tensors and
the files they came from.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten


def apply_stored_quantization(
    model: nn.Module, config: dict, weights: dict[str, mx.array], *, source: str, config_name: str = "config.json"
) -> None:
    """Turn into quantized layers exactly the modules whose `.scales` the checkpoint holds, with the
    `quantization` block of the config (per-layer entries as mlx-lm writes them override it)."""
    quant = config.get("quantization")
    if quant is None:
        if any(k.endswith(".scales") for k in weights):
            raise ValueError(f"{source}: the weights hold quantized tensors (*.scales) but {config_name} has no 'quantization' block")
        return
    if not isinstance(quant, dict) or "group_size" not in quant or "bits" not in quant:
        raise ValueError(f"{source}: {config_name} field 'quantization' must hold 'group_size' and 'bits', got {quant!r}")

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if f"{path}.scales" not in weights or not hasattr(module, "to_quantized"):
            return False
        override = quant.get(path)
        return override if isinstance(override, dict) else True

    nn.quantize(model, quant["group_size"], quant["bits"], mode=quant.get("mode", "affine"), class_predicate=predicate)


def check_tensors(
    expected: dict[str, tuple],
    found: dict[str, tuple],
    origin: dict[str, str],
    *,
    source: str,
    what: str,
    config_name: str = "config.json",
) -> None:
    """Strict: ValueError listing missing / unexpected tensors (with their files) and shape mismatches.

    expected / found: name -> shape; origin: name -> the file it came from."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensor(s) {missing}")
    if unexpected:
        problems.append("unexpected tensor(s) " + ", ".join(f"{k} (in {origin[k]})" for k in unexpected))
    if problems:
        raise ValueError(f"{source}: the {what} weights do not match {config_name}: " + "; ".join(problems))
    wrong = [
        f"{k} in {origin[k]}: found {found[k]}, expected {expected[k]}" for k in sorted(found) if found[k] != expected[k]
    ]
    if len(wrong) > 8:
        wrong = wrong[:8] + [f"and {len(wrong) - 8} more"]
    if wrong:
        raise ValueError(f"{source}: {what} tensor shape mismatch: " + "; ".join(wrong))


def cast_floating(weights: dict[str, mx.array], dtype: Optional[mx.Dtype]) -> dict[str, mx.array]:
    if dtype is None:
        return weights
    return {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}


def fill_model(
    model: nn.Module,
    config: dict,
    weights: dict[str, mx.array],
    origin: dict[str, str],
    *,
    source: str,
    what: str,
    dtype: Optional[mx.Dtype],
    config_name: str = "config.json",
) -> nn.Module:
    """Rename (`model.sanitize`), quantize the layers stored quantized, check strictly, then update.
    The weights stay lazy: nothing is evaluated here."""
    weights = model.sanitize(weights)
    apply_stored_quantization(model, config, weights, source=source, config_name=config_name)
    check_tensors(
        {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())},
        {k: tuple(v.shape) for k, v in weights.items()},
        origin,
        source=source,
        what=what,
        config_name=config_name,
    )
    model.update(tree_unflatten(list(cast_floating(weights, dtype).items())))
    return model
