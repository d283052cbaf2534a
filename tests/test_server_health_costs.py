"""/health says ok only when a request would start at once (the single-request cost curve is measured
before, not by the first request), says what a loading worker is doing, and a batched request's
prompt_tps counts its prefill from when it was admitted."""

from __future__ import annotations

import threading

import pytest

from mlx_dspark.engine.costs.probe import cost_curve_path
from mlx_dspark.engine.options import GenerationOptions
from tests.test_server import MESSAGES, call, pair_loader, running_server


def test_health_waits_for_the_cost_curve_and_says_what_it_does(tiny_spark_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_COST_DIR", str(tmp_path / "costs"))
    release = threading.Event()
    loader = pair_loader(tiny_spark_pair)

    def slow_loader():
        release.wait(60)
        return loader()

    with running_server(slow_loader, wait=False, max_batch=1) as srv:
        status, _, body = call(srv, "GET", "/health")
        assert status == 503 and body["status"] == "loading" and body["phase"] == "loading the model"
        release.set()
        assert srv.worker.loaded.wait(120)
        assert call(srv, "GET", "/health")[0] == 200
        # ok means measured: the curve the first request reads is on disk already
        assert cost_curve_path(srv.worker.model).is_file()


@pytest.mark.parametrize("max_batch", [1, 2])  # the one-at-a-time worker and the batch
def test_a_requests_prompt_rate_counts_from_its_admission(tiny_spark_pair, tmp_path, monkeypatch, max_batch):
    monkeypatch.setenv("MLX_DSPARK_COST_DIR", str(tmp_path / "costs"))
    with running_server(pair_loader(tiny_spark_pair), defaults=GenerationOptions(max_tokens=4), max_batch=max_batch) as srv:
        status, _, body = call(srv, "POST", "/v1/chat/completions", {"messages": MESSAGES * 8, "max_tokens": 4})
        assert status == 200
        stats, prompt = body["dspark"], body["usage"]["prompt_tokens"]
        # the prefill cannot have been faster than the whole time to the first token allows
        assert stats["prompt_tps"] * stats["time_to_first_token_s"] <= 2 * prompt, stats
