"""mlx-lm's own plain generation on the same weights: the baseline that keeps ours honest.

qwen3 and spark2_5 targets (mlx-lm 0.32 ships both models) and targets of any other family (which we
run through mlx-lm's own model class, `models/target/mlx_lm.py`) are loaded by `mlx_lm.load` with mlx-lm's own
model, cast to `--dtype` and, for `--quantize`, quantized by mlx-lm's own `quantize_model` (the same layers as our
loader uses); a checkpoint stored quantized, a GGUF file (mlx-lm's loader reads directories) or another
family runs our target module under mlx-lm's `generate_step` through `LogitsOnly`, so the loop is mlx-lm's
and only the model is ours.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from mlx_dspark.engine.options import SamplingOptions
from mlx_dspark.models.target.mlx_lm import is_mlx_lm_target


class LogitsOnly:
    """Our target as mlx-lm's `generate_step` calls a model: `model(tokens, cache=...)` -> logits."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        logits, _ = self.target(inputs, cache=cache)
        return logits

    def make_cache(self) -> list:
        return self.target.make_cache()


@dataclass
class MlxLmBaseline:
    model: Any  # what generate_step runs
    kind: str  # "mlx_lm.load" or "our target under mlx_lm.generate_step"


MLX_LM_FAMILIES = ("qwen3", "spark2_5")


def make_mlx_lm_baseline(loaded: Any, *, dtype: str | None, quantize: int | None, q_group_size: int = 64) -> MlxLmBaseline:
    """mlx-lm's own model for float checkpoints of the families it ships; our target through `LogitsOnly` otherwise."""
    family = loaded.target_config.get("model_type")
    from_gguf = Path(loaded.target_path).suffix.lower() == ".gguf"
    # a target we run through mlx-lm's own model class is mlx-lm's model, whatever its family
    if (family in MLX_LM_FAMILIES or is_mlx_lm_target(loaded.target)) and "quantization" not in loaded.target_config and not from_gguf:
        import mlx_lm
        from mlx_lm.utils import quantize_model

        # Only the model is used; the tokenizer must not run the checkpoint's custom code (spark's auto_map).
        model, _ = mlx_lm.load(str(Path(loaded.target_path)), tokenizer_config={"trust_remote_code": False})
        if dtype is not None:
            model.set_dtype(getattr(mx, dtype))
        if quantize is not None:
            # mlx-lm's own choice of layers (its spark2_5 keeps g_proj in float), as our loader follows it
            model, _ = quantize_model(model, {}, q_group_size, quantize)
        mx.eval(model.parameters())
        return MlxLmBaseline(model=model, kind="mlx_lm.load")
    return MlxLmBaseline(model=LogitsOnly(loaded.target), kind="our target under mlx_lm.generate_step")


@dataclass
class MlxLmRun:
    tokens: list[int]
    generation_tps: float
    time_to_first_token: float
    total_time: float
    peak_memory_gb: float


def run_mlx_lm(
    baseline: MlxLmBaseline,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    sampling: SamplingOptions,
    stop_ids: set[int],
) -> MlxLmRun:
    """Plain generation with mlx-lm's `generate_step`, timed like our API (tok/s after the first token)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=sampling.temperature, top_p=sampling.top_p, min_p=sampling.min_p, top_k=sampling.top_k)
    mx.reset_peak_memory()
    tokens: list[int] = []
    start = time.perf_counter()
    first = last = start
    steps = generate_step(mx.array(list(prompt_ids), dtype=mx.int32), baseline.model, max_tokens=max_tokens, sampler=sampler)
    for token, _ in steps:
        last = time.perf_counter()
        if not tokens:
            first = last
        tokens.append(int(token))
        if token in stop_ids:
            break
    elapsed = last - first
    return MlxLmRun(
        tokens=tokens,
        generation_tps=(len(tokens) - 1) / elapsed if len(tokens) > 1 and elapsed > 0 else 0.0,
        time_to_first_token=first - start,
        total_time=time.perf_counter() - start,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
    )
