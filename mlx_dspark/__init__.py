"""DSpark speculative decoding for Spark-X2.6 and Qwen3 targets with MLX."""

from __future__ import annotations

__version__ = "0.1.0"


def load(*args, **kwargs):
    """Load a target (and optionally its DSpark draft); see `mlx_dspark.load.load`."""
    from mlx_dspark.load import load as _load

    return _load(*args, **kwargs)


def generate(*args, **kwargs):
    """Generate a completion; see `mlx_dspark.generate.generate`."""
    from mlx_dspark.generate import generate as _generate

    return _generate(*args, **kwargs)


def stream_generate(*args, **kwargs):
    """Stream a completion; see `mlx_dspark.generate.stream_generate`."""
    from mlx_dspark.generate import stream_generate as _stream_generate

    return _stream_generate(*args, **kwargs)
