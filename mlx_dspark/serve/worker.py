"""One model in memory, one generation at a time: a worker thread owns the model and a job queue.

All MLX work (loading, then every generation) runs on this one thread, so requests never share a
cache or interleave their steps, and the HTTP threads only pass events. A handler cancels its job
when its client goes away; the worker checks between steps and closes the step generator (whose
`finally` blocks leave the caches valid), or skips the job if it has not started yet. Each job
takes its prompt cache out of the worker's pool (`cache_pool.py`) and gives it back when it ends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from mlx_dspark.api import StepResponse, encode_prompt, stream_generate
from mlx_dspark.serve.cache_pool import PromptCacheBudget, PromptCachePool
from mlx_dspark.serve.protocol import APIError, GenerationRequest

log = logging.getLogger("mlx_dspark.server")

LOADING, READY, FAILED = "loading", "ok", "error"


@dataclass
class Job:
    request: GenerationRequest
    events: queue.Queue = field(default_factory=queue.Queue)  # StepResponse... then nothing, or one APIError
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    steps: int = 0  # steps the worker pulled from the generator
    generated_tokens: int = 0
    finish_reason: str | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def results(self, *, client_gone: Callable[[], bool], poll_s: float = 0.2) -> Iterator[StepResponse]:
        """The job's steps as they come; raises its APIError; cancels it when `client_gone()` says so.

        The client is checked every `poll_s` seconds, busy or not, so a reply nobody waits for stops.
        """
        checked = time.monotonic()
        while True:
            try:
                event = self.events.get(timeout=poll_s)
            except queue.Empty:
                event = None
            if time.monotonic() - checked >= poll_s:
                checked = time.monotonic()
                if client_gone():
                    self.cancel()
                    return
            if event is None:
                continue
            if isinstance(event, APIError):
                raise event
            yield event
            if event.finish_reason is not None:
                return


class ModelWorker:
    """Loads the model with `loader()` on its own thread, then serves submitted jobs in order."""

    def __init__(
        self, loader: Callable[[], Any], *, history: int = 32, prompt_cache: PromptCacheBudget = PromptCacheBudget()
    ) -> None:
        self._loader = loader
        self._cache_budget = prompt_cache
        self.prompt_caches: PromptCachePool | None = None  # built with the model
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="mlx-dspark-worker", daemon=True)
        self.state = LOADING
        self.load_error: str | None = None
        self.loaded = threading.Event()  # set once loading succeeded or failed
        self.model: Any = None
        self.busy = False
        self.recent: deque[Job] = deque(maxlen=history)  # finished jobs, newest last
        self._stopped = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, timeout: float | None = None) -> None:
        """Finish the running and queued jobs (cancel them first to make it short), then stop serving."""
        self._jobs.put(None)
        if self._thread.is_alive():
            self._stopped.wait(timeout)

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    @property
    def speculative(self) -> bool:
        return self.model is not None and self.model.draft is not None

    def submit(self, request: GenerationRequest) -> Job:
        if self.state == LOADING:
            raise APIError(503, "the model is still loading; retry shortly", type="server_error",
                           code="model_loading", headers={"Retry-After": "2"})
        if self.state == FAILED:
            raise APIError(503, f"the model failed to load: {self.load_error}", type="server_error",
                           code="model_load_failed")
        job = Job(request=request)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        self._load_and_serve()
        self._stopped.set()
        # Park rather than return: when a thread that ran MLX work exits, its thread-local MLX state
        # is destroyed, and if that overlaps interpreter exit the process aborts ("terminate called
        # without an active exception", mlx 0.32 on Linux). A daemon thread that never exits never races.
        threading.Event().wait()

    def _load_and_serve(self) -> None:
        start = time.perf_counter()
        try:
            self.model = self._loader()
        # A loader can fail in many ways (a bad path, the hub, a malformed checkpoint): whatever it
        # is, the server reports it on /health and to every request instead of hanging in "loading".
        except Exception as err:  # noqa: BLE001
            if isinstance(err, (ValueError, OSError)):
                log.error("loading the model failed: %s", err)  # a path or checkpoint the user can fix
            else:
                log.exception("loading the model failed")
            self.load_error = f"{type(err).__name__}: {err}"
            self.state = FAILED
            self.loaded.set()
            return
        self.prompt_caches = PromptCachePool(self.model, self._cache_budget)
        self.state = READY
        self.loaded.set()
        log.info("model loaded in %.1f s", time.perf_counter() - start)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not job.cancelled.is_set():
                self.busy = True
                self._serve(job)
                self.busy = False
            job.done.set()
            self.recent.append(job)

    def _serve(self, job: Job) -> None:
        request = job.request
        cache, steps, failed = None, None, True
        try:
            prompt = encode_prompt(
                self.model.tokenizer, request.prompt, chat_template_kwargs=request.options.chat_template_kwargs
            )
            speculative = request.options.speculation.speculative and self.speculative
            cache = self.prompt_caches.checkout(prompt, speculative=speculative)
            steps = stream_generate(self.model, prompt, options=request.options, prompt_cache=cache)
            for step in steps:
                job.steps += 1
                job.generated_tokens = step.generation_tokens
                job.finish_reason = step.finish_reason
                job.events.put(step)
                if step.finish_reason is not None or job.cancelled.is_set():
                    break
            failed = False
        # The worker is the boundary of one request: a bad prompt (ValueError, a chat template's
        # own error) is the client's 400; anything else is a logged 500, and the next job still runs.
        except Exception as err:  # noqa: BLE001
            if isinstance(err, ValueError) or type(err).__module__.startswith("jinja2"):
                job.events.put(APIError(400, str(err), code="invalid_prompt"))
            else:
                log.exception("generation failed")
                job.events.put(APIError(500, f"generation failed: {type(err).__name__}: {err}", type="server_error"))
        finally:
            if steps is not None:
                steps.close()
            self.prompt_caches.checkin(cache, reusable=not failed)  # a failed generation's caches are dropped
        log.info(
            "%s request: %d generated tokens, finish=%s%s",
            request.kind, job.generated_tokens, job.finish_reason, " (client gone, stopped)" if job.cancelled.is_set() else "",
        )
