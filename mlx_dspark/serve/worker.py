"""One model in memory, one generation at a time: a worker owns the model and a job queue.

All MLX work (loading, then every generation) runs on one thread, so requests never share a cache
or interleave their steps, and the HTTP threads only pass events. The command line runs the worker
on the main thread (`load()` then `serve_jobs()`); `start()` runs it on a background thread for
in-process use (tests, notebooks). A handler cancels its job when its client goes away; the worker
checks between steps and closes the step generator (whose `finally` blocks leave the caches valid),
and never starts a job whose client has already left. Each job takes its prompt cache out of the worker's pool
(`cache_pool.py`) and gives it back when it ends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from mlx_dspark.api import ContextLengthError, GenerationCancelled, StepResponse, stream_generate
from mlx_dspark.chat_format.prompt import is_template_error
from mlx_dspark.chat_format.turn import OutputCollector
from mlx_dspark.models.target.finite import NonFiniteError
from mlx_dspark.serve.cache_pool import PromptCacheBudget, PromptCachePool
from mlx_dspark.serve.progress import PrefillWatch
from mlx_dspark.serve.protocol import APIError, GenerationRequest

log = logging.getLogger("mlx_dspark.server")

LOADING, READY, FAILED = "loading", "ok", "error"
_IDLE_POLL_S = 0.25


def _never_gone() -> bool:
    return False


@dataclass
class Job:
    request: GenerationRequest
    client_gone: Callable[[], bool] = _never_gone  # asked by the worker before it starts the job
    events: queue.Queue = field(default_factory=queue.Queue)  # StepResponse... then nothing, or one APIError
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    steps: int = 0  # steps the worker pulled from the generator
    generated_tokens: int = 0
    finish_reason: str | None = None
    # chat-like surfaces: the reader of the output, set before the first step (the handler's writer reads it)
    reader: OutputCollector | None = None
    prompt_ids: list[int] | None = None
    answered: bool = False  # the handler's answer was complete before the generation ended (it cancels the rest)

    def cancel(self) -> None:
        self.cancelled.set()

    def results(self, *, poll_s: float = 0.2, idle_s: float | None = None,
                on_idle: Callable[[], None] | None = None) -> Iterator[StepResponse]:
        """The job's steps as they come; raises its APIError; cancels it when `client_gone()` says so.

        The client is checked every `poll_s` seconds, busy or not, so a reply nobody waits for stops;
        `on_idle()` is called each `idle_s` seconds without a step (a stream's keep-alive).
        """
        checked = last = time.monotonic()
        while True:
            try:
                event = self.events.get(timeout=poll_s)
            except queue.Empty:
                event = None
            if time.monotonic() - checked >= poll_s:
                checked = time.monotonic()
                if self.client_gone():
                    self.cancel()
                    return
            if event is None:
                if on_idle is not None and idle_s is not None and time.monotonic() - last >= idle_s:
                    last = time.monotonic()
                    on_idle()
                continue
            last = time.monotonic()
            if isinstance(event, APIError):
                raise event
            yield event
            if event.finish_reason is not None:
                return


def fail_job(job: Job, err: Exception) -> bool:
    """Answer a job that raised `err` with its APIError (400 for the client's mistakes, 500 otherwise);
    returns whether its caches must be dropped (the generation broke off inside the model work)."""
    request = job.request
    if isinstance(err, ContextLengthError):  # before any model work: the cache is untouched
        prompt_field = {"chat": "messages", "anthropic": "messages", "responses": "input"}.get(request.kind, "prompt")
        param = "max_tokens" if err.field == "max_tokens" else prompt_field
        job.events.put(APIError(400, str(err), param=param, code="context_length_exceeded"))
        return False
    if isinstance(err, NonFiniteError):  # the model is broken, not the request
        log.error("generation failed: %s", err)
        job.events.put(APIError(500, str(err), type="server_error", code="non_finite_logits"))
    elif isinstance(err, APIError):
        job.events.put(err)
        return False
    elif type(err).__name__ == "ConstraintError":  # the engine compiling the request's constraint
        job.events.put(APIError(400, str(err), param=request.constraint_field, code="invalid_value"))
    elif isinstance(err, ValueError) and getattr(err, "field", None):  # a tool / reasoning field
        job.events.put(APIError(400, str(err), param=err.field, code="invalid_value"))
    elif is_template_error(err):
        job.events.put(APIError(400, str(err), code="invalid_prompt"))
    else:
        log.exception("generation failed", exc_info=err)
        job.events.put(APIError(500, f"generation failed: {type(err).__name__}: {err}", type="server_error"))
    return True


class ModelWorker:
    """Loads the model with `loader()`, then serves submitted jobs in order, on one thread."""

    def __init__(
        self, loader: Callable[[], Any], *, history: int = 32, prompt_cache: PromptCacheBudget = PromptCacheBudget()
    ) -> None:
        self._loader = loader
        self._cache_budget = prompt_cache
        self.prompt_caches: PromptCachePool | None = None  # built with the model
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.state = LOADING
        self.phase = "loading the model"  # what a LOADING worker is doing (/health says it)
        self.load_error: str | None = None
        self.loaded = threading.Event()  # set once loading succeeded or failed
        self.model: Any = None
        self.current: Job | None = None  # the job being generated
        self.recent: deque[Job] = deque(maxlen=history)  # finished jobs, newest last
        self._stopped = threading.Event()
        # Set by the command line's signal handler beside the KeyboardInterrupt it raises: an interrupt
        # that lands inside code that swallows it (seen under load: a signal during a round, and the
        # round ran on to the end) still stops serving at the next job or round (`check_interrupted`).
        self.interrupted = threading.Event()

    # -- running -------------------------------------------------------------------------------

    def start(self) -> None:
        """Load and serve on a background thread (in-process use; the command line calls `load` and
        `serve_jobs` on its main thread instead, see `_park`)."""
        self._thread = threading.Thread(target=self._run_in_background, name="mlx-dspark-worker", daemon=True)
        self._thread.start()

    def stop(self, *, timeout: float | None = None) -> None:
        """Finish the running and queued jobs (cancel them first to make it short), then stop serving."""
        self._jobs.put(None)
        if self._thread is not None and self._thread.is_alive():
            self._stopped.wait(timeout)

    def abort(self, message: str) -> None:
        """Fail every queued job and the running one with a 503 (the server is going away)."""
        error = APIError(503, message, type="server_error", code="server_shutting_down")
        with self._jobs.mutex:
            pending = [job for job in self._jobs.queue if job is not None]
        current = self.current
        for job in pending + ([current] if current is not None else []):
            job.cancel()
            job.events.put(error)

    def _run_in_background(self) -> None:
        self.load()
        if self.state == READY:
            self.serve_jobs()
        self._stopped.set()
        self._park()

    @staticmethod
    def _park() -> None:
        """Block this thread for good instead of letting it exit.

        MLX's Python binding gives a thread that used `mx.random` or `mx.compile` a thread-local whose
        destructor takes the GIL. A Python thread that exits while the interpreter finalizes is ended
        by `pthread_exit` when it asks for the GIL, and that forced unwind through the (noexcept)
        destructor calls std::terminate ("terminate called without an active exception"). A daemon
        thread blocked on a lock nobody releases never asks for the GIL again, so it never races.
        """
        threading.Event().wait()

    def load(self) -> None:
        """Load the model on this thread; a failure is kept for /health and every request."""
        start = time.perf_counter()
        try:
            self.model = self._loader()
            self._measure_costs()
            problem = self.prepare()
        # A loader can fail in many ways (a bad path, the hub, a malformed checkpoint), and so can what
        # the worker prepares on the loaded model: whatever it is, the server reports it on /health and
        # to every request instead of hanging in "loading".
        except Exception as err:  # noqa: BLE001
            if isinstance(err, (ValueError, OSError)):
                log.error("loading the model failed: %s", err)  # a path or checkpoint the user can fix
            else:
                log.exception("loading the model failed")
            self.load_error, self.model = f"{type(err).__name__}: {err}", None
            self.state = FAILED
            self.loaded.set()
            return
        if problem is not None:  # decided before the load is announced (/health never says ok first)
            log.error("%s", problem)
            self.load_error, self.model, self.state = problem, None, FAILED
            self.loaded.set()
            return
        self.prompt_caches = PromptCachePool(self.model, self._cache_budget)
        self.state = READY
        self.loaded.set()
        log.info("model loaded in %.1f s", time.perf_counter() - start)

    def prepare(self) -> str | None:
        """After loading, before the worker reports ready: why it cannot serve this model (None: it can)."""
        return None

    def _measure_costs(self) -> None:
        """This machine's cost curve for the pair, before the worker says ready: the first request would
        otherwise wait for its measurement (tens of seconds on a busy machine) while /health said ok."""
        if getattr(self.model, "draft", None) is None:
            return
        from mlx_dspark.engine.costs.probe import cost_curve_for

        self.phase = "measuring this machine's draft and verify costs (once; cached)"
        started = time.perf_counter()
        try:
            curve = cost_curve_for(self.model)
        # as the batch worker's packed costs: a cache it cannot write or read, or a measurement MLX cannot
        # run, leaves it to the first request (which says why)
        except (OSError, ValueError, RuntimeError) as err:
            log.warning("no cost curve at load (%s: %s): the first request measures it", type(err).__name__, err)
            return
        log.info("cost curve (%s) read or measured in %.1f s", curve.source, time.perf_counter() - started)
        self.phase = "preparing"

    def check_interrupted(self) -> None:
        """Raise KeyboardInterrupt when a signal asked the server to stop (see `interrupted`)."""
        if self.interrupted.is_set():
            raise KeyboardInterrupt

    def serve_jobs(self) -> None:
        """Run submitted jobs in order on this thread until `stop()`."""
        while True:
            self.check_interrupted()
            try:
                # Wake up now and then: on the main thread, a signal handled by another thread just
                # before an untimed wait would not interrupt it, and Ctrl-C would go unanswered.
                job = self._jobs.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                continue
            if job is None:
                return
            if job.cancelled.is_set() or job.client_gone():
                job.cancel()  # its client left while it waited: it never starts
            else:
                self.current = job  # left set if an interrupt ends serving, so abort() can answer its client
                self._serve(job)
                self.current = None
            job.done.set()
            self.recent.append(job)

    # -- state ---------------------------------------------------------------------------------

    @property
    def cache_budget(self) -> PromptCacheBudget:
        return self._cache_budget

    @property
    def busy(self) -> bool:
        return self.current is not None

    def running(self, job: Job) -> bool:
        """Whether `job` is being generated now (not waiting in the queue)."""
        return self.current is job

    @property
    def queued(self) -> int:
        """Jobs waiting whose client is still there (a cancelled job waits only to be skipped)."""
        with self._jobs.mutex:
            return sum(1 for job in self._jobs.queue if job is not None and not job.cancelled.is_set())

    def metrics(self) -> dict:
        """What /health reports about the work (the batch worker adds its batch and rates)."""
        return {"max_batch": 1, "active": int(self.busy)}

    @property
    def speculative(self) -> bool:
        if self.model is None:
            return False
        return any(module is not None for module in self.model.heads.values())  # any draft head

    def submit(self, request: GenerationRequest, *, client_gone: Callable[[], bool] = _never_gone) -> Job:
        if self.state == LOADING:
            raise APIError(503, "the model is still loading; retry shortly", type="server_error",
                           code="model_loading", headers={"Retry-After": "2"})
        if self.state == FAILED:
            raise APIError(503, f"the model failed to load: {self.load_error}", type="server_error",
                           code="model_load_failed")
        job = Job(request=request, client_gone=client_gone)
        self._jobs.put(job)
        return job

    def _serve(self, job: Job) -> None:
        request = job.request
        cache, steps, failed = None, None, True
        try:
            tokenizer = self.model.tokenizer
            prompt, options = request.prepare(tokenizer)  # the template, reasoning switch and forced calls
            job.prompt_ids = prompt
            if request.kind != "text":
                job.reader = OutputCollector(request.tools.parser(tokenizer, prompt))
            speculative = options.speculation.speculative and self.speculative
            cache = self.prompt_caches.checkout(prompt, speculative=speculative)
            # The job's cancel event stops the prefill between chunks too: a client that left mid-prompt
            # frees the worker within one prefill chunk.
            watch = PrefillWatch(job.cancelled, request.kind, len(prompt), options.prefill_step_size, lambda: job.steps)
            tools = request.tools  # the one call allowed ends the answer on the token completing it (the api's rules)
            steps = stream_generate(self.model, prompt, options=options, prompt_cache=cache, cancel=watch,
                                    tools=tools.tools, tool_choice=tools.choice, parallel_tool_calls=tools.parallel)
            for step in steps:
                self.check_interrupted()
                job.steps += 1
                job.generated_tokens = step.generation_tokens
                job.finish_reason = step.finish_reason
                job.events.put(step)
                if step.finish_reason is not None or job.cancelled.is_set():
                    break
            failed = False
        # The worker is the boundary of one request: a bad prompt (ValueError, a chat template's
        # own error) is the client's 400; anything else is a logged 500, and the next job still runs.
        except GenerationCancelled:
            failed = False  # its client left (or the server is shutting down); the caches stay valid
        except Exception as err:  # noqa: BLE001
            failed = fail_job(job, err)
        finally:
            if steps is not None:
                steps.close()
            self.prompt_caches.checkin(cache, reusable=not failed)  # a failed generation's caches are dropped
        log.info(
            "%s request: %d generated tokens, finish=%s%s",
            request.kind, job.generated_tokens, job.finish_reason,
            " (its one tool call complete, stopped)" if job.answered else " (client gone, stopped)" if job.cancelled.is_set() else "",
        )
