"""The HTTP side: routes, authentication, body limits, JSON replies and server-sent events.

Built on the standard library's `ThreadingHTTPServer`: one thread per connection that only parses,
waits on its job's events and writes; the model work is the worker's (see `worker.py`).
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import logging
import select
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from mlx_dspark.options import GenerationOptions
from mlx_dspark.serve.cache_pool import PromptCacheBudget
from mlx_dspark.serve.protocol import (
    CLIENT_TEMPLATE_KWARGS,
    SERVER_DEFAULTS,
    APIError,
    Envelope,
    GenerationRequest,
    Tally,
    check_template_kwarg_names,
    parse_request,
)
from mlx_dspark.serve.worker import READY, Job, ModelWorker

log = logging.getLogger("mlx_dspark.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_IDLE_TIMEOUT_S = 60.0
MAX_JSON_DEPTH = 64  # request bodies are flat; deeper nesting is an attack on the parser
_REFUSE_READ_S = 0.05
_LINGER_S = 1.0  # at most this long, and this much, read from a closing connection
_LINGER_BYTES = 1 << 20
_DRAIN_LIMIT = 64 * 1024 * 1024  # an oversize body up to this is read and dropped, so the client sees the 413


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
    ) -> None:
        self.worker = worker
        self.model_id = model_id
        self.defaults = defaults
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.allow_origins = frozenset(allow_origins)
        self.template_kwargs = template_kwargs  # the chat template switches clients may set
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
        return _is_loopback_name(_host_name(host))

    def origin_allowed(self, origin: str) -> bool:
        """Loopback pages and the --allow-origin list may call the server from a browser."""
        normalized = origin.strip().rstrip("/").lower()
        if "*" in self.allow_origins or normalized in self.allow_origins:
            return True
        parts = urlsplit(normalized)
        return parts.scheme in ("http", "https") and _is_loopback_name(parts.hostname or "")

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "mlx-dspark"}


def _host_name(host: str) -> str:
    """The name in a Host header, without the port: "[::1]:8080" -> "::1", "localhost:80" -> "localhost"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def normalize_origin(origin: str) -> str:
    """An --allow-origin value: "*" or scheme://host[:port] (what browsers send), lower case."""
    value = origin.strip().rstrip("/").lower()
    if value == "*":
        return value
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or parts.fragment:
        raise ValueError(f"--allow-origin must be '*' or an origin like https://example.com:3000, got {origin!r}")
    return value


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
) -> DSparkHTTPServer:
    """Bind the socket (port 0 picks a free one); call `.start()` to load and serve.

    `allow_template_kwargs` names chat template switches clients may set beside the built-in ones.
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    if not idle_timeout_s > 0:
        raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
    template_kwargs = check_template_kwarg_names(allow_template_kwargs)
    return DSparkHTTPServer(
        (host, port),
        worker=ModelWorker(loader, prompt_cache=prompt_cache),
        model_id=model_id,
        defaults=defaults,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        max_connections=max_connections,
        idle_timeout_s=idle_timeout_s,
        allow_origins=[normalize_origin(o) for o in allow_origins],
        template_kwargs=template_kwargs,
    )


def check_json_value(value: Any, *, max_depth: int = MAX_JSON_DEPTH) -> None:
    """A parsed body is at most `max_depth` deep and its strings are valid Unicode (JSON's "\\ud800"
    escape decodes to a lone surrogate, which no tokenizer can encode): a 400 naming the field."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > max_depth:
            raise APIError(400, f"the JSON body is nested more than {max_depth} levels deep", code="invalid_json")
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(item))
        elif isinstance(item, dict):
            for key, v in item.items():
                _check_text(key, path or "body")
                stack.append((v, f"{path}.{key}" if path else key, depth + 1))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        name = path or "body"
        raise APIError(400, f"'{name}' holds an unpaired surrogate ({text[err.start]!r} at character {err.start}); "
                       "send valid UTF-16 pairs or plain UTF-8", param=name, code="invalid_value") from None


_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}


def _escape_controls(text: str) -> str:
    """Control characters a client put in its request line, escaped, so they cannot forge log lines."""
    return text.translate(_CONTROL_ESCAPES)


class Handler(BaseHTTPRequestHandler):
    server: DSparkHTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive; streams use chunked transfer encoding
    server_version = "mlx-dspark"

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout_s  # every socket read and write: an idle client cannot hold a thread
        self._body: bytes | None = None
        self._stream_started = False
        self._cors_origin: str | None = None
        super().setup()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    def __getattr__(self, name: str) -> Any:
        # The standard library answers a method without a do_<METHOD> with an HTML 501: every other
        # method (HEAD, PUT, TRACE, ...) goes through the router instead, which answers a JSON 405.
        if name.startswith("do_"):
            return functools.partial(self._dispatch, name[3:])
        raise AttributeError(name)

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), _escape_controls(format % args))

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own errors (a bad request line, headers too long, a timeout) as JSON."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # an unparsable request line: still answer with a status line
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        self._send_json(code, APIError(code, message or phrase, code="bad_request").body())

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
        self._body = None
        self._stream_started = False
        self._cors_origin = None
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            self._check_host_and_origin()
            routes = self._route(path)
            if routes is None:
                raise APIError(404, f"unknown route: {method} {path}", code="unknown_url")
            if method == "OPTIONS" and self._cors_origin is not None:
                self._preflight(routes)
                return
            if method not in routes:
                allowed = ", ".join(routes)
                raise APIError(405, f"{method} is not allowed on {path}; use {allowed}", code="method_not_allowed",
                               headers={"Allow": allowed})
            if method == "POST":
                self._check_content_type()
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
            log.exception("unexpected error on %s %s", _escape_controls(method), _escape_controls(path))
            if self._stream_started:
                self.close_connection = True  # a half-written stream cannot be resumed
            self._send_error(APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error"))

    # -- checks ----------------------------------------------------------------------------------

    def _check_host_and_origin(self) -> None:
        """Keep browsers off a local server: no page may use it cross-site or through DNS rebinding
        unless its origin was allowed (--allow-origin); the API key, when set, protects instead."""
        host = self.headers.get("Host")
        if self.server.api_key is None and not self.server.host_allowed(host):
            raise APIError(403, f"Host {host!r} is not this server's loopback address (a DNS-rebinding page?); "
                           "use http://127.0.0.1 or http://localhost", type="permission_error", code="host_not_allowed")
        origin = self.headers.get("Origin")
        if origin is None:
            return  # not a cross-origin browser request
        if self.server.origin_allowed(origin):
            self._cors_origin = origin.strip()
        elif self.server.api_key is None:
            raise APIError(403, f"Origin {origin!r} may not call this server; start it with --allow-origin "
                           f"{origin.strip()!r} (or set --api-key)", type="permission_error", code="origin_not_allowed")

    def _preflight(self, routes: dict[str, Callable[[], None]]) -> None:
        """A browser's CORS preflight from an allowed origin: 204 with what it may send."""
        requested = self.headers.get("Access-Control-Request-Headers", "")
        self.send_response(204)
        self.send_header("Access-Control-Allow-Origin", self._cors_origin)
        self.send_header("Vary", "Origin")
        self.send_header("Access-Control-Allow-Methods", ", ".join([*routes, "OPTIONS"]))
        self.send_header("Access-Control-Allow-Headers", requested[:1024] or "Authorization, Content-Type")
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        if self.headers.get("Content-Length", "0").strip() not in ("", "0"):
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()

    def _check_content_type(self) -> None:
        """Without a key, bodies must say they are JSON: a page can POST text/plain cross-site without
        asking the browser first (no preflight), never application/json."""
        if self.server.api_key is not None:
            return
        given = self.headers.get("Content-Type")
        if given is None or given.split(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"the body must be sent with 'Content-Type: application/json', got {given!r}",
                           code="unsupported_media_type")

    def _key_ok(self) -> bool:
        key = self.server.api_key
        if key is None:
            return True
        given = self.headers.get("Authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        return hmac.compare_digest(token.encode(), key.encode())

    def _check_key(self) -> None:
        if not self._key_ok():
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise APIError(411, "chunked request bodies are not supported: send Content-Length", code="length_required")
        raw = self.headers.get("Content-Length")
        if raw is None:
            # Whatever body follows would be read as the next request: answer and hang up.
            self.close_connection = True
            raise APIError(411, "a POST needs a Content-Length header", code="length_required")
        try:
            length = int(raw)
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
            value = json.loads(self._body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(400, f"the body is not valid JSON: {err}", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep",
                           code="invalid_json") from None
        check_json_value(value)
        return value

    # -- endpoints -------------------------------------------------------------------------------

    def _health(self) -> None:
        """Open to monitors without the key; what names the model (an id that may be a local path, a
        load error) only to a caller that could read /v1/models too."""
        worker = self.server.worker
        trusted = self._key_ok()
        body: dict[str, Any] = {"status": worker.state}
        if trusted:
            body["model"] = self.server.model_id
        if worker.state == READY:
            body.update(busy=worker.busy, queued=worker.queued)
            if trusted:
                body["speculative"] = worker.speculative
        elif worker.load_error and trusted:
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
        request = parse_request(kind, body, defaults=self.server.defaults, template_kwargs=self.server.template_kwargs)
        model = body.get("model")
        if model is not None and model != self.server.model_id:
            raise self._unknown_model(model)
        job = self.server.worker.submit(request, client_gone=self._client_gone)
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
        for step in job.results():
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
            for step in job.results():
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
        self._send_cors_headers()
        if self.command == "HEAD":
            self.close_connection = True  # a HEAD reply has no body; simplest to not reuse the connection
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_cors_headers(self) -> None:
        if self._cors_origin is not None:
            self.send_header("Access-Control-Allow-Origin", self._cors_origin)
            self.send_header("Vary", "Origin")

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
        self._send_cors_headers()
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
