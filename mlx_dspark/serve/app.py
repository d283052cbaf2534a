"""The HTTP side: routes, authentication, body limits, JSON replies and server-sent events.

Built on the standard library's `ThreadingHTTPServer`: one thread per connection that only parses,
waits on its job's events and writes; the model work is the worker's (see `worker.py`).
"""

from __future__ import annotations

import hmac
import json
import logging
import sys
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import urlsplit

from mlx_dspark.options import GenerationOptions
from mlx_dspark.serve.cache_pool import PromptCacheBudget
from mlx_dspark.serve.protocol import SERVER_DEFAULTS, APIError, Envelope, GenerationRequest, Tally, parse_request
from mlx_dspark.serve.worker import READY, Job, ModelWorker

log = logging.getLogger("mlx_dspark.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
_DRAIN_LIMIT = 64 * 1024 * 1024  # an oversize body up to this is read and dropped, so the client sees the 413


class DSparkHTTPServer(ThreadingHTTPServer):
    """The bound socket, the worker and the settings every request reads."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        *,
        worker: ModelWorker,
        model_id: str,
        defaults: GenerationOptions,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.worker = worker
        self.model_id = model_id
        self.defaults = defaults
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.request_timeout_s = request_timeout_s
        self.created = int(time.time())
        self._serving: threading.Thread | None = None
        super().__init__(address, Handler)

    def handle_error(self, request, client_address) -> None:
        """A client that went away mid-request is routine (logged at debug); anything else is logged."""
        err = sys.exc_info()[1]
        if isinstance(err, ConnectionError):
            log.debug("client %s went away: %s", client_address, err)
        else:
            log.exception("error while serving %s", client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        """Start loading the model and answering requests (503 until loaded), both in background threads."""
        self.worker.start()
        self._serving = threading.Thread(target=self.serve_forever, name="mlx-dspark-http", daemon=True)
        self._serving.start()

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C arrives here as KeyboardInterrupt)."""
        while self._serving is not None and self._serving.is_alive():
            self._serving.join(0.5)

    def close(self, *, wait_s: float = 30.0) -> None:
        """Stop answering, release the port, and give the running generation `wait_s` to end."""
        if self._serving is not None:
            self.shutdown()  # only after serve_forever started: otherwise it waits forever
        self.server_close()
        self.worker.stop(timeout=wait_s)

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "mlx-dspark"}


def make_server(
    loader: Callable[[], Any],
    *,
    model_id: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    defaults: GenerationOptions = SERVER_DEFAULTS,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    prompt_cache: PromptCacheBudget = PromptCacheBudget(),
) -> DSparkHTTPServer:
    """Bind the socket (port 0 picks a free one); call `.start()` to load and serve."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    return DSparkHTTPServer(
        (host, port),
        worker=ModelWorker(loader, prompt_cache=prompt_cache),
        model_id=model_id,
        defaults=defaults,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
    )


class Handler(BaseHTTPRequestHandler):
    server: DSparkHTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive; streams use chunked transfer encoding
    server_version = "mlx-dspark"

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s  # a client that stops reading cannot hold a thread forever
        super().setup()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    # -- routing ---------------------------------------------------------------------------------

    def _route(self, path: str) -> dict[str, Callable[[], None]] | None:
        if path == "/health":
            return {"GET": self._health}
        if path == "/v1/models":
            return {"GET": self._models}
        if path.startswith("/v1/models/"):
            return {"GET": lambda: self._model(path[len("/v1/models/"):])}
        if path == "/v1/chat/completions":
            return {"POST": lambda: self._generate("chat")}
        if path == "/v1/completions":
            return {"POST": lambda: self._generate("text")}
        return None

    def _dispatch(self, method: str) -> None:
        self._body: bytes | None = None
        self._stream_started = False
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            routes = self._route(path)
            if routes is None:
                raise APIError(404, f"unknown route: {method} {path}", code="unknown_url")
            if method not in routes:
                allowed = ", ".join(routes)
                raise APIError(405, f"{method} is not allowed on {path}; use {allowed}", code="method_not_allowed",
                               headers={"Allow": allowed})
            if method == "POST":
                self._body = self._read_body()
            if path != "/health":
                self._check_key()
            routes[method]()
        except APIError as err:
            self._send_error(err)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True  # the client went away; nothing to tell it
        # The handler is the boundary of one connection: a bug in one request must be a 500 for that
        # client, not a dropped socket, and never reach the other requests or the server.
        except Exception as err:  # noqa: BLE001
            log.exception("unexpected error on %s %s", method, path)
            if self._stream_started:
                self.close_connection = True  # a half-written stream cannot be resumed
            self._send_error(APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error"))

    def _check_key(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise APIError(411, "chunked request bodies are not supported: send Content-Length", code="length_required")
        raw = self.headers.get("Content-Length")
        try:
            length = int(raw) if raw is not None else 0
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            raise APIError(400, f"bad Content-Length header: {raw!r}", code="invalid_request")
        limit = self.server.max_body_bytes
        if length > limit:
            self._drain(length)
            raise APIError(413, f"the request body is {length} bytes; this server takes at most {limit} (--max-body-bytes)",
                           code="request_too_large")
        return self.rfile.read(length)

    def _drain(self, length: int) -> None:
        """Read an oversize body in pieces and drop it; a huge one closes the connection instead."""
        self.close_connection = True
        if length > _DRAIN_LIMIT:
            return
        while length > 0:
            piece = self.rfile.read(min(length, 1 << 16))
            if not piece:
                return
            length -= len(piece)

    def _json_body(self) -> Any:
        if not self._body:
            raise APIError(400, "the request needs a JSON body", code="invalid_json")
        try:
            return json.loads(self._body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(400, f"the body is not valid JSON: {err}", code="invalid_json") from None

    # -- endpoints -------------------------------------------------------------------------------

    def _health(self) -> None:
        worker = self.server.worker
        body = {"status": worker.state, "model": self.server.model_id}
        if worker.state == READY:
            body.update(speculative=worker.speculative, busy=worker.busy, queued=worker.queued)
        elif worker.load_error:
            body["error"] = worker.load_error
        self._send_json(200 if worker.state == READY else 503, body)

    def _models(self) -> None:
        self._send_json(200, {"object": "list", "data": [self.server.model_card()]})

    def _model(self, name: str) -> None:
        if name != self.server.model_id:
            raise self._unknown_model(name)
        self._send_json(200, self.server.model_card())

    def _unknown_model(self, name: Any) -> APIError:
        return APIError(404, f"model {name!r} is not served here; this server serves {self.server.model_id!r}",
                        param="model", code="model_not_found")

    def _generate(self, kind: str) -> None:
        body = self._json_body()
        request = parse_request(kind, body, defaults=self.server.defaults)
        model = body.get("model")
        if model is not None and model != self.server.model_id:
            raise self._unknown_model(model)
        job = self.server.worker.submit(request)
        try:
            if request.stream:
                self._stream(job, request)
            else:
                self._complete(job, request)
        finally:
            job.cancel()  # no-op once done; stops the generation when we leave early

    def _complete(self, job: Job, request: GenerationRequest) -> None:
        envelope = Envelope.new(request.kind, self.server.model_id)
        tally = Tally(speculative=self.server.worker.speculative)
        pieces, finish_reason = [], None
        for step in job.results(client_gone=self._client_gone):
            tally.add(step)
            pieces.append(step.text)
            finish_reason = step.finish_reason
        if finish_reason is None:
            self.close_connection = True
            return  # the client left while we were generating
        self._send_json(200, envelope.full(text="".join(pieces), finish_reason=finish_reason, tally=tally))

    def _stream(self, job: Job, request: GenerationRequest) -> None:
        envelope = Envelope.new(request.kind, self.server.model_id)
        tally = Tally(speculative=self.server.worker.speculative)
        try:
            for step in job.results(client_gone=self._client_gone):
                tally.add(step)
                first = not self._stream_started
                if first:
                    self._start_stream()  # after the first step, so a bad prompt is still a plain 400
                done = step.finish_reason is not None
                if step.text or first or done:
                    self._send_event(envelope.chunk(text=step.text, finish_reason=step.finish_reason, first=first,
                                                    tally=tally if done else None))
                if done:
                    if request.include_usage:
                        self._send_event(envelope.usage_chunk(tally))
                    self._send_event("[DONE]")
                    self._end_stream()
        except APIError as err:
            if not self._stream_started:
                raise
            self._send_event(err.body())  # headers are gone: the error travels as an event
            self._send_event("[DONE]")
            self._end_stream()

    # -- writing ---------------------------------------------------------------------------------

    def _client_gone(self) -> bool:
        """True when the client closed its side (readable with nothing to read) while we wait."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _send_json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, err: APIError) -> None:
        if self._stream_started:
            return  # a response is already on the wire
        if self._body is None and self.headers.get("Content-Length", "0").strip() not in ("", "0"):
            self.close_connection = True  # an unread body would be taken for the next request
        if err.status >= 500:
            log.warning("%d: %s", err.status, err.message)
        self._send_json(err.status, err.body(), err.headers)

    def _start_stream(self) -> None:
        self._stream_started = True
        self._chunked = self.request_version == "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")  # reverse proxies: pass events on at once
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True  # HTTP/1.0: the end of the stream is the end of the connection
            self.send_header("Connection", "close")
        self.end_headers()

    def _send_event(self, payload: dict | str) -> None:
        data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
        self._write_chunk(data)

    def _end_stream(self) -> None:
        if self._chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _write_chunk(self, data: bytes) -> None:
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        self.wfile.write(data)
        self.wfile.flush()
