"""The documented entry points stay the functions, whatever submodules get imported."""

from __future__ import annotations

import importlib

import mlx_dspark


def test_api_names_stay_functions_after_their_modules_are_imported():
    for module in ("mlx_dspark.loading.load", "mlx_dspark.api", "mlx_dspark.engine.options", "mlx_dspark.cli.generate", "mlx_dspark.cli.common"):
        importlib.import_module(module)
    assert callable(mlx_dspark.load) and mlx_dspark.load.__module__ == "mlx_dspark.loading.load"
    assert callable(mlx_dspark.generate) and mlx_dspark.generate.__module__ == "mlx_dspark.api"
    assert callable(mlx_dspark.stream_generate) and mlx_dspark.stream_generate.__module__ == "mlx_dspark.api"
    for name in ("GenerationOptions", "SamplingOptions", "SpeculationOptions", "OptionError"):
        assert getattr(mlx_dspark, name).__module__ == "mlx_dspark.engine.options", name


def test_generate_result_has_the_documented_fields(tiny_spark_pair):
    model = mlx_dspark.load(str(tiny_spark_pair[0]), draft=str(tiny_spark_pair[1]))
    res = mlx_dspark.generate(model, "Hi", max_tokens=6)
    for name in (
        "text", "tokens", "acceptance_lengths", "proposal_lengths", "finish_reason", "prompt_tokens",
        "prompt_tps", "generation_tps", "peak_memory_gb", "mean_acceptance_length",
    ):  # fmt: skip
        assert hasattr(res, name), name
    assert res.finish_reason in ("stop", "length")
    assert all(1 <= a <= p + 1 for a, p in zip(res.acceptance_lengths, res.proposal_lengths))
