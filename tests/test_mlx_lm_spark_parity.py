"""Our spark2_5 target against mlx-lm 0.32's own `spark2_5` model on the same checkpoint (the benchmark's baseline)."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_dspark
from mlx_dspark.bench.mlx_lm_baseline import make_mlx_lm_baseline, run_mlx_lm
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.engine.options import SamplingOptions

PROMPT = [1, 5, 9, 20, 33, 7, 100, 250, 3, 64]


@pytest.mark.parametrize("quantize", [None, 4])
def test_our_spark_target_gives_mlx_lms_greedy_tokens(tiny_spark_target, quantize):
    ours = mlx_dspark.load(str(tiny_spark_target), quantize=quantize)
    baseline = make_mlx_lm_baseline(ours, dtype=None, quantize=quantize)
    assert baseline.kind == "mlx_lm.load"
    assert type(baseline.model).__module__ == "mlx_lm.models.spark2_5"
    theirs = run_mlx_lm(baseline, PROMPT, max_tokens=40, sampling=SamplingOptions(), stop_ids=set()).tokens
    no_stop = prepare_model(ours, RunSettings(ignore_eos=True))  # random weights: always 40 tokens
    plain = mlx_dspark.generate(no_stop, PROMPT, max_tokens=40, speculative=False).tokens
    assert len(theirs) == 40 and theirs == plain
    # and the logits themselves agree (float32: to rounding; 4-bit: same quantized weights)
    logits, _ = ours.target(mx.array([PROMPT]))
    assert mx.allclose(logits, baseline.model(mx.array([PROMPT])), atol=1e-4).item()
