"""DSpark speculative decoding for Spark-X2.6 and Qwen3 targets with MLX.

The entry points are thin functions that import their module on first use, so `import mlx_dspark` stays
cheap and `python -m mlx_dspark.generate` (the CLI module) never shadows the `generate` function.
"""

from __future__ import annotations

__version__ = "0.1.0"


def load(*args, **kwargs):
    """Load a target (and optionally its DSpark draft); see `mlx_dspark.load.load`."""
    from mlx_dspark.load import load as _load

    return _load(*args, **kwargs)


def generate(*args, **kwargs):
    """Generate a whole completion; see `mlx_dspark.api.generate`."""
    from mlx_dspark.api import generate as _generate

    return _generate(*args, **kwargs)


def stream_generate(*args, **kwargs):
    """Stream a completion step by step; see `mlx_dspark.api.stream_generate`."""
    from mlx_dspark.api import stream_generate as _stream_generate

    return _stream_generate(*args, **kwargs)
