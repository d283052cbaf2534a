"""`GET /metrics`: the server's counters in Prometheus' text format (version 0.0.4).

Every answered request adds its tally (protocol.Tally: the steps its writer streamed) once, from the
handler's thread; the gauges (queue, batch width, memory) are read from the worker when scraped. One
lock: a scrape sees whole requests only.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Iterable

import mlx.core as mx

from mlx_dspark.serve.worker import READY

# acceptance length per verify round counts the bonus token: 1 .. 33 (a lookup block commits up to 32)
ACCEPTANCE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 33)
DRAFT_LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 32)  # drafts verified per round; 0: parked


class Histogram:
    """Cumulative buckets as Prometheus keeps them, plus the sum and count."""

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{name}="{_escape(str(value))}"' for name, value in sorted(labels.items())) + "}"


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class Metrics:
    """The counters of one server since it started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str]] = Counter()  # (api, finish reason) -> requests
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prompt_cache_hits = 0  # requests that reused at least one cached prompt token
        self.generation_tokens = 0
        self.tokens_by_origin: Counter[str] = Counter()  # "draft" / "lookup" / "forced" / "target"
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.rounds = 0
        self.rounds_parked = 0
        self.acceptance = Histogram(ACCEPTANCE_BUCKETS)
        self.draft_lengths = Histogram(DRAFT_LENGTH_BUCKETS)
        self.last_prefill_tps = 0.0
        self.last_decode_tps = 0.0

    def record(self, api: str, tally: Any, finish_reason: str | None) -> None:
        """One answered request: its writer's tally (a protocol.Tally)."""
        last = tally.last
        if last is None:
            return  # nothing generated (refused, or the client left before the first token)
        with self._lock:
            self.requests[(api, finish_reason or "cancelled")] += 1
            self.prompt_tokens += last.prompt_tokens
            self.cached_tokens += last.cached_tokens
            self.prompt_cache_hits += int(last.cached_tokens > 0)
            self.generation_tokens += last.generation_tokens
            self.tokens_by_origin.update(tally.origins)
            prefilled = last.prompt_tokens - last.cached_tokens
            if last.prompt_tps > 0 and prefilled > 0:
                self.prefill_seconds += prefilled / last.prompt_tps
                self.last_prefill_tps = last.prompt_tps
            if last.generation_tps > 0 and last.generation_tokens > 1:
                self.decode_seconds += (last.generation_tokens - 1) / last.generation_tps
                self.last_decode_tps = last.generation_tps
            self.rounds += tally.rounds
            self.rounds_parked += tally.proposal_lengths.count(0)
            for length in tally.acceptance_lengths:
                self.acceptance.observe(length)
            for length in tally.proposal_lengths:
                self.draft_lengths.observe(length)

    def render(self, worker: Any, model_id: str) -> str:
        """The exposition text; `worker` gives the live gauges."""
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            suffix = "_total" if kind == "counter" else ""
            out.extend(f"{name}{suffix}{_labels(labels)} {_number(value)}" for labels, value in samples)

        def histogram(name: str, help_text: str, hist: Histogram) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} histogram")
            for bound, count in zip(hist.bounds, hist.counts):
                out.append(f'{name}_bucket{{le="{_number(float(bound))}"}} {count}')
            out.append(f'{name}_bucket{{le="+Inf"}} {hist.count}')
            out.append(f"{name}_sum {_number(float(hist.total))}")
            out.append(f"{name}_count {hist.count}")

        with self._lock:
            ready = worker.state == READY
            metric("mlx_dspark_up", "gauge", "1 when the model is loaded and takes requests",
                   [({"model": model_id, "state": worker.state}, int(ready))])
            metric("mlx_dspark_speculative", "gauge", "1 when a draft is loaded",
                   [({}, int(bool(ready and worker.speculative)))])
            metric("mlx_dspark_requests", "counter", "answered requests by API and finish reason",
                   [({"api": api, "finish_reason": reason}, n) for (api, reason), n in sorted(self.requests.items())])
            metric("mlx_dspark_prompt_tokens", "counter", "prompt tokens of answered requests", [({}, self.prompt_tokens)])
            metric("mlx_dspark_prompt_cached_tokens", "counter", "prompt tokens reused from the prompt cache",
                   [({}, self.cached_tokens)])
            metric("mlx_dspark_prompt_cache_hits", "counter", "requests that reused cached prompt tokens",
                   [({}, self.prompt_cache_hits)])
            metric("mlx_dspark_generation_tokens", "counter", "generated tokens", [({}, self.generation_tokens)])
            metric("mlx_dspark_generated_tokens_by_origin", "counter",
                   "generated tokens by who wrote them: an accepted draft, lookup or forced token, or the target's own",
                   [({"origin": origin}, n) for origin, n in sorted(self.tokens_by_origin.items())])
            metric("mlx_dspark_prefill_seconds", "counter", "seconds spent prefilling prompts", [({}, self.prefill_seconds)])
            metric("mlx_dspark_decode_seconds", "counter", "seconds spent generating after the first token",
                   [({}, self.decode_seconds)])
            metric("mlx_dspark_prefill_tokens_per_second", "gauge", "the last request's prefill rate",
                   [({}, self.last_prefill_tps)])
            metric("mlx_dspark_decode_tokens_per_second", "gauge", "the last request's decode rate",
                   [({}, self.last_decode_tps)])
            metric("mlx_dspark_rounds", "counter", "speculative rounds (one target forward each)", [({}, self.rounds)])
            metric("mlx_dspark_rounds_parked", "counter", "rounds the draft sat out (the target alone)",
                   [({}, self.rounds_parked)])
            histogram("mlx_dspark_acceptance_length", "tokens committed per round (accepted drafts + the bonus)",
                      self.acceptance)
            histogram("mlx_dspark_draft_length", "draft tokens verified per round (0: parked)", self.draft_lengths)
        work = worker.metrics() if ready else {}
        metric("mlx_dspark_queue_length", "gauge", "requests waiting for the worker", [({}, worker.queued if ready else 0)])
        metric("mlx_dspark_batch_width", "gauge", "requests being generated now", [({}, int(work.get("active", 0)))])
        metric("mlx_dspark_batch_max", "gauge", "requests the worker generates at once", [({}, int(work.get("max_batch", 1)))])
        metric("mlx_dspark_memory_active_bytes", "gauge", "MLX memory in use", [({}, mx.get_active_memory())])
        metric("mlx_dspark_memory_peak_bytes", "gauge", "MLX peak memory since the last reset", [({}, mx.get_peak_memory())])
        metric("mlx_dspark_memory_cache_bytes", "gauge", "MLX's buffer cache", [({}, mx.get_cache_memory())])
        return "\n".join(out) + "\n"
