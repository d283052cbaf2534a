"""The server object: the bound socket, connection limits, the worker and the settings every request
reads (`make_server` checks and builds it), on the standard library's `ThreadingHTTPServer`; requests
are `handler.Handler`'s, the model work is the worker's (`worker.py`).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import select
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.engine.batch.round import PREFILL_CHUNK
from mlx_dspark.engine.context_length import context_length
from mlx_dspark.serve.batch_worker import BatchWorker
from mlx_dspark.serve.cache_pool import PromptCacheBudget
from mlx_dspark.serve.protocol import (
    CLIENT_TEMPLATE_KWARGS,
    SERVER_DEFAULTS,
    APIError,
    check_template_kwarg_names,
)
from mlx_dspark.serve.guards import host_name, is_loopback_name, normalize_origin
from mlx_dspark.serve.handler import Handler
from mlx_dspark.serve.metrics import Metrics
from mlx_dspark.serve.responses import ResponseStore
from mlx_dspark.serve.threads import ThreadStore
from mlx_dspark.serve.streaming import KEEPALIVE_S
from mlx_dspark.serve.worker import READY, ModelWorker

log = logging.getLogger("mlx_dspark.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_IDLE_TIMEOUT_S = 60.0
_REFUSE_READ_S = 0.05
_LINGER_S = 1.0  # at most this long, and this much, read from a closing connection
_LINGER_BYTES = 1 << 20


class DSparkHTTPServer(ThreadingHTTPServer):
    """The bound socket, the worker and the settings every request reads.

    Connections: the listen backlog holds a burst of `request_queue_size` pending connects; at most
    `max_connections` are served at once (one thread each), and a connection beyond that gets a fast
    503; a connection that sends or reads nothing for `idle_timeout_s` is closed. Requests that reach
    the model wait in the worker's queue, however many there are.
    """

    daemon_threads = True
    request_queue_size = 512  # the listen backlog (the kernel caps it at net.core.somaxconn)

    def __init__(
        self,
        address: tuple[str, int],
        *,
        worker: ModelWorker,
        model_id: str,
        defaults: GenerationOptions,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        allow_origins: Sequence[str] = (),
        template_kwargs: frozenset[str] = CLIENT_TEMPLATE_KWARGS,
        keepalive_s: float = KEEPALIVE_S,
        force_tool_call: str | None = None,
        metrics: bool = True,
        threads: ThreadStore | None = None,
    ) -> None:
        self.worker = worker
        self.metrics = Metrics()  # what answered requests added (always counted; /metrics serves it when enabled)
        self.metrics_enabled = metrics
        self.force_tool_call = force_tool_call  # --force-tool-call: a trial aid for weak models
        self.keepalive_s = keepalive_s  # a stream waiting for its first token sends a keep-alive this often
        self.model_id = model_id
        self.defaults = defaults
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.allow_origins = frozenset(allow_origins)
        self.template_kwargs = template_kwargs  # the chat template switches clients may set
        # /v1/responses' previous_response_id: as many conversations as the prompt-cache pool keeps warm
        budget = worker.cache_budget
        self.responses = ResponseStore(budget.conversations if budget.enabled else 0)
        self.threads = threads if threads is not None else ThreadStore()  # Anthropic's `thread` (message threads)
        self.created = int(time.time())
        self._serving: threading.Thread | None = None
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open = 0  # connections being served
        self._open_lock = threading.Lock()
        super().__init__(address, Handler)
        self.loopback = ipaddress.ip_address(self.server_address[0]).is_loopback

    def handle_error(self, request, client_address) -> None:
        """A client that went away mid-request is routine (logged at debug); anything else is logged."""
        err = sys.exc_info()[1]
        if isinstance(err, ConnectionError):
            log.debug("client %s went away: %s", client_address, err)
        else:
            log.exception("error while serving %s", client_address)

    # -- connections -----------------------------------------------------------------------------

    @property
    def open_connections(self) -> int:
        return self._open

    def process_request(self, request, client_address) -> None:
        """A thread per connection while a slot is free; otherwise a 503 from this (accepting) thread."""
        if not self._slots.acquire(blocking=False):
            self._refuse(request, client_address)
            return
        with self._open_lock:
            self._open += 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release_slot()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release_slot()

    def shutdown_request(self, request: socket.socket) -> None:
        """Close a served connection gracefully: stop writing, then read and drop what the client is
        still sending (an unread body) for a moment, so the close does not reset the connection and
        lose the reply on its way (Apache's "lingering close")."""
        try:
            request.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + _LINGER_S
            received = 0
            while received < _LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
                if not select.select([request], [], [], left)[0]:
                    break
                piece = request.recv(1 << 16)
                if not piece:
                    break
                received += len(piece)
        except OSError:
            pass  # already closed by the client
        self.close_request(request)

    def _release_slot(self) -> None:
        with self._open_lock:
            self._open -= 1
        self._slots.release()

    def _refuse(self, request: socket.socket, client_address) -> None:
        log.warning("refused %s: %d connections open (the limit)", client_address[0], self.max_connections)
        body = json.dumps(APIError(
            503, f"the server has {self.max_connections} connections open, its limit; retry shortly",
            type="server_error", code="too_many_connections").body()).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            # Read what the client already sent (briefly): closing on unread bytes would reset the
            # connection, and the client could lose the 503 with it.
            if select.select([request], [], [], _REFUSE_READ_S)[0]:
                request.recv(1 << 16)
            request.settimeout(_REFUSE_READ_S * 10)
            request.sendall(head + body)
        except OSError:
            pass
        finally:
            super().shutdown_request(request)  # no lingering on the accepting thread

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        """Load the model and answer requests (503 until loaded), both in background threads."""
        self.worker.start()
        self.start_http()

    def start_http(self) -> None:
        """Answer requests from a background thread; the caller runs the worker (`worker.load()`,
        `worker.serve_jobs()`), as the command line does on its main thread."""
        self._serving = threading.Thread(target=self.serve_forever, name="mlx-dspark-http", daemon=True)
        self._serving.start()

    def close(self, *, wait_s: float = 30.0) -> None:
        """Stop answering, release the port, and give the running generation `wait_s` to end."""
        self._stop_http()
        self.worker.stop(timeout=wait_s)

    def abort(self, *, grace_s: float = 1.0) -> None:
        """Shut down now: every waiting request gets a 503, open connections get `grace_s` to say so."""
        self.worker.abort("the server is shutting down")
        self._stop_http()
        deadline = time.monotonic() + grace_s
        while self._open and time.monotonic() < deadline:
            time.sleep(0.02)
        self.worker.stop(timeout=0)

    def _stop_http(self) -> None:
        if self._serving is not None:
            self.shutdown()  # only after serve_forever started: otherwise it waits forever
            self._serving = None
        self.server_close()

    # -- request checks ----------------------------------------------------------------------------

    def host_allowed(self, host: str | None) -> bool:
        """On a loopback bind, only loopback names: a page whose DNS name was rebound to 127.0.0.1
        sends its own name as the Host."""
        if not self.loopback or host is None:
            return True  # no Host: not a browser (browsers always send one)
        return is_loopback_name(host_name(host))

    def origin_allowed(self, origin: str) -> bool:
        """Loopback pages and the --allow-origin list may call the server from a browser."""
        normalized = origin.strip().rstrip("/").lower()
        if "*" in self.allow_origins or normalized in self.allow_origins:
            return True
        parts = urlsplit(normalized)
        return parts.scheme in ("http", "https") and is_loopback_name(parts.hostname or "")

    def model_card(self) -> dict:
        card = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "mlx-dspark"}
        model = self.worker.model if self.worker.state == READY else None
        if model is not None:  # vLLM's name for the context a request must fit in (the page shows it)
            context, _ = context_length(model, self.defaults)
            if context is not None:
                card["max_model_len"] = context
        return card


def make_server(
    loader: Callable[[], Any],
    *,
    model_id: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    defaults: GenerationOptions = SERVER_DEFAULTS,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    allow_origins: Sequence[str] = (),
    prompt_cache: PromptCacheBudget = PromptCacheBudget(),
    allow_template_kwargs: Sequence[str] = (),
    max_batch: int = 1,
    batch_required: bool = True,
    batch_max_tokens: int | None = None,
    batch_draft_cap: Callable[[int], int] | None = None,
    batch_prefill_chunk: int = PREFILL_CHUNK,
    keepalive_s: float = KEEPALIVE_S,
    force_tool_call: str | None = None,
    metrics: bool = True,
) -> DSparkHTTPServer:
    """Bind the socket (port 0 picks a free one); call `.start()` to load and serve.

    `allow_template_kwargs` names chat template switches clients may set beside the built-in ones.
    `max_batch` > 1 serves that many requests at once (`batch_worker.BatchWorker`, continuous batching;
    `batch_draft_cap(width)` its draft length per batch width, `batch_prefill_chunk` the prompt tokens a
    newcomer prefills per round); 1 serves one at a time (`ModelWorker`). `batch_required=False` serves a
    pair the packed forwards cannot run one at a time instead of failing its load; `batch_max_tokens` bounds the
    context tokens the active requests hold together (None: from the machine's memory).
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    if not idle_timeout_s > 0:
        raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
    if not keepalive_s > 0:
        raise ValueError(f"keepalive_s must be > 0, got {keepalive_s}")
    template_kwargs = check_template_kwarg_names(allow_template_kwargs)
    if max_batch == 1:
        worker = ModelWorker(loader, prompt_cache=prompt_cache)
    else:
        worker = BatchWorker(loader, max_batch=max_batch, draft_cap=batch_draft_cap, prefill_chunk=batch_prefill_chunk,
                             prompt_cache=prompt_cache, required=batch_required, max_tokens=batch_max_tokens)
    return DSparkHTTPServer(
        (host, port),
        worker=worker,
        model_id=model_id,
        defaults=defaults,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        max_connections=max_connections,
        idle_timeout_s=idle_timeout_s,
        allow_origins=[normalize_origin(o) for o in allow_origins],
        template_kwargs=template_kwargs,
        keepalive_s=keepalive_s,
        force_tool_call=force_tool_call,
        metrics=metrics,
    )
