"""Attention layer types, as `config.json`'s `layer_types` names them.

Below both the models and the caches: `cache.py` builds one cache per layer type and the model
families read `layer_types` with these names, so neither has to import the other for them.
"""

from __future__ import annotations

from collections.abc import Sequence

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def check_layer_types(layer_types: Sequence[str], num_layers: int, *, source: str) -> list[str]:
    """`layer_types` as a list: one known entry per layer; ValueError naming the field otherwise."""
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
        raise ValueError(
            f"{source}: layer_types must list {num_layers} entries (num_hidden_layers), got {layer_types!r}"
        )
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"{source}: layer_types has unknown entries {unknown}; expected {list(LAYER_TYPES)}")
    return list(layer_types)
