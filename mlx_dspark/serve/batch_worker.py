"""Many requests at once: the model's thread runs continuous batching rounds (engine/batch/round.py).

`BatchWorker` is a `ModelWorker` (same jobs, events, loading, prompt-cache pool) whose `serve_jobs`
keeps up to `max_batch` jobs active. Between rounds it admits queued jobs in order (a newcomer's prompt
is prefilled in chunks inside the following rounds, so running streams keep flowing), drops the jobs
whose client left (their caches stay valid and go back to the pool), and hands each job the
StepResponses of its rounds (`api.stream_rounds`: the stop rules of a single request). Every request
keeps its own sampling settings, seed, penalties, logit_bias, logprobs, constraint (JSON schema, forced
tool call), verify schedule and prompt cache. Draft lengths follow the batch: at load the worker reads
(or measures once, then caches) this machine's packed-forward costs up to `max_batch` sequences
(engine/batch_length.batch_cost_for), and every round plans the `auto` rows' lengths together over them;
`draft_cap(width)`, when given, caps every row's drafts at a width.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_dspark.api import StepResponse, context_length, fit_max_tokens, stream_rounds
from mlx_dspark.chat_format.turn import OutputCollector
from mlx_dspark.engine.batch.round import PREFILL_CHUNK, BatchRow, batch_round
from mlx_dspark.engine.batch.length import BatchCost, batch_cost_for
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.round.request import compile_request
from mlx_dspark.serve.cache_pool import PromptCacheBudget
from mlx_dspark.serve.progress import LOG_EVERY_S
from mlx_dspark.serve.protocol import APIError
from mlx_dspark.models.packed.forward import packing_problem
from mlx_dspark.serve.worker import _IDLE_POLL_S, Job, ModelWorker, fail_job

log = logging.getLogger("mlx_dspark.server")

_RATE_WINDOW_S = 10.0  # tokens per second over the last seconds


@dataclass
class _Active:
    job: Job
    row: BatchRow
    stream: Iterator[StepResponse]
    cache: PromptCache | None
    started: float
    tokens: int = 0  # the context it may reach: prompt + max_tokens (what the token budget counts)
    logged: float = 0.0  # when its prefill progress was last logged

    def log_prefill(self, now: float, width: int) -> None:
        """Every LOG_EVERY_S while its prompt goes in (a long agent prompt takes minutes): how far it is."""
        row = self.row
        if row.prefilling and now - max(self.logged, self.started) >= LOG_EVERY_S:
            self.logged = now
            log.info("%s request: prefill %d of %d prompt tokens done after %.0f s (%d in the batch)",
                     self.job.request.kind, row.prefilled, len(row.prompt), now - self.started, width)  # fmt: skip


MEMORY_SHARE = 0.75  # of the device's memory, what weights, the prompt-cache pool and the batch may use


def device_memory() -> int:
    """Bytes the model's device may use: Metal's recommended working set, else the machine's memory."""
    try:
        if mx.metal.is_available():
            return int(mx.metal.device_info()["max_recommended_working_set_size"])
    except (AttributeError, KeyError, RuntimeError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_token_budget(model: Any, cost: BatchCost | None, pool_bytes: int, *, memory: int | None = None) -> int | None:
    """Context tokens the active requests may hold together: what `MEMORY_SHARE` of the device's memory
    leaves beside the weights and the prompt-cache pool, over the caches' bytes per token (measured with
    the packed costs); None when those are unknown (no draft, no measurement): no limit but --max-batch."""
    if cost is None or cost.bytes_per_token <= 0:
        return None
    weights = sum(v.nbytes for module in (model.target, model.draft) if module is not None
                  for _, v in tree_flatten(module.parameters()))  # fmt: skip
    free = MEMORY_SHARE * (device_memory() if memory is None else memory) - weights - pool_bytes
    return max(1, int(free / cost.bytes_per_token))


class BatchWorker(ModelWorker):
    """A `ModelWorker` that serves up to `max_batch` jobs at once (module docstring)."""

    def __init__(
        self,
        loader: Callable[[], Any],
        *,
        max_batch: int,
        draft_cap: Callable[[int], int] | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        history: int = 32,
        prompt_cache: PromptCacheBudget = PromptCacheBudget(),
        required: bool = True,
        max_tokens: int | None = None,
    ) -> None:
        """`required`: refuse (fail the load of) a pair the packed forwards cannot run; False (the
        server's default width, not asked for): serve that pair one request at a time instead.
        `max_tokens`: the most context tokens (prompt + max_tokens of every active request) the batch
        holds at once, for its caches' memory; a newcomer past it waits (in order) until it fits, a
        request alone always runs. None: from this machine's memory (`memory_token_budget`)."""
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"the batch prefill chunk must be an integer >= 1, got {prefill_chunk!r}")
        super().__init__(loader, history=history, prompt_cache=prompt_cache)
        self.max_batch = max_batch
        self.required = required
        self.one_at_a_time = False  # a pair the packed forwards cannot run, served as ModelWorker does
        self.draft_cap = draft_cap
        self.cost: BatchCost | None = None  # this machine's packed costs, read or measured at load
        self.prefill_chunk = prefill_chunk
        self.active: list[_Active] = []
        self.admitting: Job | None = None  # the job being admitted (taken from the queue, not yet active)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"the batch's token budget must be an integer >= 1, got {max_tokens!r}")
        self.token_budget = max_tokens  # None until prepare() sets it from the memory (or: no limit known)
        self.held: tuple[Job, tuple] | None = None  # the next job, prepared, waiting for room in the budget
        self.rounds = 0
        self.generated_tokens = 0
        self.peak_active = 0  # the widest batch so far
        self._rate: deque[tuple[float, int]] = deque()  # (time, tokens) of recent rounds

    # -- state -------------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return super().busy if self.one_at_a_time else bool(self.active)

    @property
    def queued(self) -> int:
        held = self.held is not None and not self.held[0].cancelled.is_set()
        return super().queued + int(held)

    def running(self, job: Job) -> bool:
        return super().running(job) if self.one_at_a_time else any(a.job is job for a in list(self.active))

    def metrics(self) -> dict:
        if self.one_at_a_time:
            return super().metrics()
        now = time.monotonic()
        recent = [n for t, n in list(self._rate) if now - t <= _RATE_WINDOW_S]
        return {
            "max_batch": self.max_batch,
            "active": len(self.active),
            "token_budget": self.token_budget,  # context tokens the active requests may hold together
            "tokens_held": sum(a.tokens for a in list(self.active)),
            "peak_active": self.peak_active,
            "rounds": self.rounds,
            "generated_tokens": self.generated_tokens,
            "tokens_per_second": round(sum(recent) / _RATE_WINDOW_S, 2),
            "requests": [
                {
                    "prompt_tokens": len(a.row.prompt),
                    "prefilling": a.row.prefilling,
                    "generated_tokens": a.job.generated_tokens,
                    "tokens_per_second": round(a.job.generated_tokens / max(now - a.started, 1e-9), 2),
                    "acceptance": round(a.row.acceptance, 3),  # accepted per verified draft token
                }
                for a in list(self.active)
            ],
        }

    def prepare(self) -> str | None:
        """Refuse a pair the packed forwards cannot run; read (or measure once) this machine's packed costs."""
        problem = packing_problem(self.model)
        if problem is not None and not self.required:
            log.warning("serving one request at a time: %s (batching needs packed forwards)", problem)
            self.one_at_a_time, self.max_batch = True, 1
            return None
        if problem is not None:
            return f"--max-batch {self.max_batch}: {problem}; serve it with --max-batch 1"
        if self.model.draft is None:
            return None
        started = time.monotonic()
        self.phase = f"measuring this machine's packed-forward costs up to {self.max_batch} requests (once; cached)"
        try:
            self.cost = batch_cost_for(self.model, self.max_batch)
        # Serving goes on without the plan when the cost cache cannot be written or read (OSError, a
        # damaged file: ValueError) or MLX fails to run the measurement (RuntimeError: memory): each
        # request then keeps its own draft length policy. Anything else fails the load, said on /health.
        except (OSError, ValueError, RuntimeError) as err:
            log.warning("no packed-forward costs (%s: %s): each request keeps its own draft length", type(err).__name__, err)
            return None
        if self.token_budget is None:
            self.token_budget = memory_token_budget(self.model, self.cost, self.cache_budget.nbytes)
            if self.token_budget is not None:
                log.info("the batch holds at most %d context tokens at once (%.0f KB of caches per token; "
                         "--batch-max-tokens to change)", self.token_budget, self.cost.bytes_per_token / 1e3)  # fmt: skip
        table = lambda d: {k: round(v, 1) for k, v in d.items()}  # noqa: E731
        log.info("packed-forward costs up to %d requests (%s, %.1f s): one request's forward of n rows %s ms, "
                 "w requests %s ms, draft block %s ms", self.max_batch, self.cost.source, time.monotonic() - started,
                 table(self.cost.rows_ms), table(self.cost.sequences_ms), table(self.cost.draft_ms))  # fmt: skip
        return None

    def abort(self, message: str) -> None:
        super().abort(message)
        error = APIError(503, message, type="server_error", code="server_shutting_down")
        admitting = [] if self.admitting is None else [self.admitting]  # an interrupt inside its admission
        if self.held is not None:
            admitting.append(self.held[0])
        for job in [a.job for a in list(self.active)] + admitting:
            job.cancel()
            job.events.put(error)

    # -- serving ------------------------------------------------------------------------------------

    def serve_jobs(self) -> None:
        """Admit, run a round, hand out its steps; until `stop()` and every admitted job is done."""
        if self.one_at_a_time:
            return super().serve_jobs()
        stopping = False
        while True:
            self.check_interrupted()
            while len(self.active) < self.max_batch:
                if self.held is not None:  # in order: nothing passes a job waiting for room
                    job, prepared = self.held
                    if self._dropped(job):
                        self.held = None
                        continue
                    if not self._fits(prepared):
                        break
                    self.held = None
                    self._start(job, prepared)
                    continue
                if stopping:
                    break
                try:
                    # Idle: wait (waking now and then for signals); busy: only take what is there.
                    job = self._jobs.get(timeout=_IDLE_POLL_S) if not self.active else self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                elif not self._dropped(job):  # (a job whose client left while it waited never starts)
                    self.admitting = job  # left set if an interrupt ends serving, so abort() can answer its client
                    prepared = self._prepare(job)
                    if prepared is not None and self._fits(prepared):
                        self._start(job, prepared)
                    elif prepared is not None:
                        self.held = (job, prepared)
                    self.admitting = None
            if self.active:
                self._round()
            elif stopping and self.held is None:
                return

    def _finish(self, job: Job) -> None:
        job.done.set()
        self.recent.append(job)

    def _dropped(self, job: Job) -> bool:
        """A waiting job whose client left (or that was cancelled) never starts: finished, and True."""
        if not (job.cancelled.is_set() or job.client_gone()):
            return False
        job.cancel()
        self._finish(job)
        return True

    def _prepare(self, job: Job) -> tuple | None:
        """The job's prompt, options (max_tokens fitted to the context) and grammar; None: it failed (answered)."""
        request = job.request
        try:
            tokenizer = self.model.tokenizer
            prompt, options = request.prepare(tokenizer)
            job.prompt_ids = prompt
            if request.kind != "text":
                job.reader = OutputCollector(request.tools.parser(tokenizer, prompt))
            grammar = compile_request(self.model, options)
            max_tokens = fit_max_tokens(len(prompt), options, *context_length(self.model, options))
            return prompt, dataclasses.replace(options, max_tokens=max_tokens), grammar
        # The worker is the boundary of one request: its own mistakes are its 400, the batch runs on.
        except Exception as err:  # noqa: BLE001
            fail_job(job, err)
            self._finish(job)
            return None

    def _fits(self, prepared: tuple) -> bool:
        """Whether a prepared job's context fits beside the active ones (alone, it always does)."""
        prompt, options, _ = prepared
        held = sum(a.tokens for a in self.active)
        return not self.active or self.token_budget is None or held + len(prompt) + options.max_tokens <= self.token_budget

    def _start(self, job: Job, prepared: tuple) -> None:
        prompt, options, grammar = prepared
        cache = None
        try:
            cache = self.prompt_caches.checkout(prompt, speculative=options.speculation.speculative and self.speculative)
            started = time.perf_counter()  # its prefill starts with the next round (prompt_tps counts from here)
            row = BatchRow(self.model, prompt, options, prompt_cache=cache, grammar=grammar, cancel=job.cancelled)
            stream = stream_rounds(self.model, prompt, row.steps(), options=options, prompt_cache=cache,
                                   tools=job.request.tools, started=started)
        except Exception as err:  # noqa: BLE001  (as _prepare: this request's)
            failed = fail_job(job, err)
            self.prompt_caches.checkin(cache, reusable=not failed)
            self._finish(job)
            return
        self.active.append(_Active(job=job, row=row, stream=stream, cache=cache, started=time.monotonic(),
                                   tokens=len(prompt) + options.max_tokens))  # fmt: skip
        self.peak_active = max(self.peak_active, len(self.active))

    def _round(self) -> None:
        for active in [a for a in self.active if a.job.cancelled.is_set()]:
            self._retire(active)  # between rounds every row's caches are consistent: reusable
        if not self.active:
            return
        try:
            batch_round(self.model, [a.row for a in self.active], draft_cap=self.draft_cap, cost=self.cost,
                        prefill_chunk=self.prefill_chunk)  # fmt: skip
        # A failure inside the shared forward cannot be pinned on one request: all of them get the 500.
        except Exception as err:  # noqa: BLE001
            for active in list(self.active):
                fail_job(active.job, err)
                self._retire(active, reusable=False)
            return
        self.rounds += 1
        produced, now = 0, time.monotonic()
        for active in self.active:
            active.log_prefill(now, len(self.active))
        for active in list(self.active):
            job = active.job
            try:
                while active.row.rounds and job.finish_reason is None:
                    step = next(active.stream)
                    job.steps += 1
                    job.generated_tokens = step.generation_tokens
                    job.finish_reason = step.finish_reason
                    produced += len(step.tokens)
                    job.events.put(step)
            except Exception as err:  # noqa: BLE001  (the detokenizer, the output parser: this request's)
                self._retire(active, reusable=not fail_job(job, err))
                continue
            if job.finish_reason is not None:
                self._retire(active)
        self.generated_tokens += produced
        now = time.monotonic()
        self._rate.append((now, produced))
        while self._rate and now - self._rate[0][0] > _RATE_WINDOW_S:
            self._rate.popleft()

    def _retire(self, active: _Active, *, reusable: bool = True) -> None:
        self.active.remove(active)
        active.stream.close()
        self.prompt_caches.checkin(active.cache, reusable=reusable)
        self._finish(active.job)
        job = active.job
        log.info(
            "%s request: %d generated tokens, finish=%s, acceptance %.2f%s",
            job.request.kind, job.generated_tokens, job.finish_reason, active.row.acceptance,
            " (its one tool call complete, stopped)" if job.answered else " (client gone, stopped)" if job.cancelled.is_set() else "",
        )  # fmt: skip
