"""The HTTP handler: routes, authentication, body limits, JSON replies and server-sent events, one
connection per thread; it only parses, waits on its job's events and writes (the model work is the
worker's, see `worker.py`)."""

from __future__ import annotations

import functools
import hmac
import json
import logging
import select
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from mlx_dspark.serve import anthropic, responses
from mlx_dspark.serve.admission import admit, force_tool_call
from mlx_dspark.serve.errors import APIError
from mlx_dspark.serve.openai_writer import OpenAIWriter
from mlx_dspark.serve.page import PAGE_CSP, PAGE_FILES, page_file, wants_page
from mlx_dspark.serve.protocol import parse_request
from mlx_dspark.serve.streaming import AnswerWriting
from mlx_dspark.serve.worker import READY

from mlx_dspark.serve.guards import MAX_JSON_DEPTH, check_json_value, escape_controls

if TYPE_CHECKING:
    from mlx_dspark.serve.app import DSparkHTTPServer

log = logging.getLogger("mlx_dspark.server")

_DRAIN_LIMIT = 64 * 1024 * 1024  # an oversize body up to this is read and dropped, so the client sees the 413


class Handler(AnswerWriting, BaseHTTPRequestHandler):
    server: "DSparkHTTPServer"
    protocol_version = "HTTP/1.1"  # keep-alive; streams use chunked transfer encoding
    server_version = "mlx-dspark"

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout_s  # every socket read and write: an idle client cannot hold a thread
        self._body: bytes | None = None
        self._stream_started = False
        self._cors_origin: str | None = None
        self._anthropic = False
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
        log.info("%s %s", self.address_string(), escape_controls(format % args))

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
        if path == "/":  # clients probe the base URL (Claude Code sends HEAD /); a browser gets the page
            return {"GET": self._root, "HEAD": self._root}
        if path in PAGE_FILES:
            return {"GET": lambda: self._page_file(path)}
        if path == "/health":
            return {"GET": self._health}
        if path == "/metrics" and self.server.metrics_enabled:
            return {"GET": self._metrics}
        if path == "/v1/models":
            return {"GET": self._models}
        if path.startswith("/v1/models/"):
            return {"GET": lambda: self._model(path[len("/v1/models/"):])}
        if path == "/v1/chat/completions":
            return {"POST": lambda: self._generate("chat")}
        if path == "/v1/completions":
            return {"POST": lambda: self._generate("text")}
        if path == "/v1/messages":
            return {"POST": lambda: self._generate("anthropic")}
        if path == "/v1/messages/count_tokens":
            return {"POST": self._count_tokens}
        if path == "/v1/responses":
            return {"POST": lambda: self._generate("responses")}
        return None

    def _dispatch(self, method: str) -> None:
        self._body = None
        self._stream_started = False
        self._cors_origin = None
        path = urlsplit(self.path).path.rstrip("/") or "/"
        self._anthropic = path.startswith("/v1/messages")  # errors in Anthropic's shape
        # the access line when the request starts (the standard one comes with the reply's status)
        log.log(logging.INFO if method == "POST" else logging.DEBUG, "%s \"%s %s\" started", self.address_string(),
                escape_controls(method), escape_controls(self.path[:300]))
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
            # probes of the base URL carry no key (Claude Code's HEAD /); the page's files hold no data
            if path not in ("/health", "/") and path not in PAGE_FILES:
                self._check_key()
            routes[method]()
        except APIError as err:
            self._send_error(err)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True  # the client went away; nothing to tell it
        # The handler is the boundary of one connection: a bug in one request must be a 500 for that
        # client, not a dropped socket, and never reach the other requests or the server.
        except Exception as err:  # noqa: BLE001
            log.exception("unexpected error on %s %s", escape_controls(method), escape_controls(path))
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
        token = token or self.headers.get("x-api-key", "").strip()  # Anthropic's clients send the key so
        return hmac.compare_digest(token.encode(), key.encode())

    def _check_key(self) -> None:
        if not self._key_ok():
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
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
                body.update(speculative=worker.speculative, work=worker.metrics())
        elif worker.load_error and trusted:
            body["error"] = worker.load_error
        elif worker.state != READY:
            body["phase"] = getattr(worker, "phase", "loading")  # loading the model, measuring costs, ...
        self._send_json(200 if worker.state == READY else 503, body)

    def _root(self) -> None:
        if self.command == "GET" and wants_page(self.headers.get("Accept")):
            return self._page_file("/")
        self._send_json(200, {"object": "server", "name": "mlx-dspark", "status": self.server.worker.state,
                              "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                                            "/v1/models", "/health"]})

    def _page_file(self, path: str) -> None:
        data, content_type = page_file(path)
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Security-Policy", PAGE_CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-cache")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _metrics(self) -> None:
        data = self.server.metrics.render(self.server.worker, self.server.model_id).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _models(self) -> None:
        self._send_json(200, {"object": "list", "data": [self.server.model_card()]})

    def _model(self, name: str) -> None:
        if name != self.server.model_id:
            raise self._unknown_model(name)
        self._send_json(200, self.server.model_card())

    def _unknown_model(self, name: Any) -> APIError:
        return APIError(404, f"model {name!r} is not served here; this server serves {self.server.model_id!r}",
                        param="model", code="model_not_found")

    def _parse(self, kind: str, body: Any):
        server = self.server
        if kind == "anthropic":
            return anthropic.parse_request(body, defaults=server.defaults, template_kwargs=server.template_kwargs)
        if kind == "responses":
            return responses.parse_request(body, defaults=server.defaults, template_kwargs=server.template_kwargs,
                                           store=server.responses)
        return parse_request(kind, body, defaults=server.defaults, template_kwargs=server.template_kwargs)

    def _writer(self, kind: str, request: Any, job: Any) -> Any:
        server, worker = self.server, self.server.worker
        args = dict(model_id=server.model_id, speculative=worker.speculative, tokenizer=worker.model.tokenizer)
        if kind == "anthropic":
            return anthropic.AnthropicWriter(request, job, **args)
        if kind == "responses":
            return responses.ResponsesWriter(request, job, store=server.responses, **args)
        return OpenAIWriter(request, job, **args)

    def _generate(self, kind: str) -> None:
        body = self._json_body()
        if kind == "anthropic" and isinstance(body, dict) and body.get("thread") not in (None, False):
            body, turn = self.server.threads.begin(body)  # the whole conversation the thread holds
            try:
                writer = self._answer(kind, body)
                if writer.finished:
                    self.server.threads.finish(turn, writer.id, writer.blocks)
            finally:
                self.server.threads.abandon(turn)  # no-op once finished
            return
        self._answer(kind, body)

    def _answer(self, kind: str, body: Any) -> Any:
        """Parse, admit, submit and write one generation request; the writer, once answered."""
        request = self._parse(kind, body)
        model = body.get("model")
        if model is not None and model != self.server.model_id and kind != "anthropic":
            raise self._unknown_model(model)  # Anthropic clients name Claude models: one model answers them all
        if self.server.force_tool_call and kind != "text":
            force_tool_call(request, self.server.force_tool_call)
        prompt = admit(self.server.worker, request)  # a prompt that cannot run is a 400 before any byte of the answer
        log.info("%s request: %d prompt tokens%s", kind, len(prompt),
                 "".join(f"; warning: {w}" for w in request.warnings))
        if self.headers.get("X-DSpark-Marks", "").strip() == "1":
            request.extra["marks"] = True  # the page's view of speculation (openai_writer.step_marks)
        job = self.server.worker.submit(request, client_gone=self._client_gone)
        writer = self._writer(kind, request, job)
        try:
            if request.stream:
                self._stream(job, writer, len(prompt))
            else:
                self._complete(job, writer)
        finally:
            job.answered = bool(getattr(job.reader, "ended", False))  # its one call was the whole answer
            job.cancel()  # no-op once done; stops the generation when we leave early (or the answer ended)
            self.server.metrics.record(kind, writer.tally, getattr(writer, "finish_reason", None) or job.finish_reason)
        return writer

    def _count_tokens(self) -> None:
        """Anthropic's /v1/messages/count_tokens: the prompt the request would render, counted."""
        request = anthropic.parse_request(self._json_body(), defaults=self.server.defaults,
                                          template_kwargs=self.server.template_kwargs, count_only=True)
        worker = self.server.worker
        if worker.state != READY:
            worker.submit(request)  # raises the 503 saying why
        try:
            ids, _ = request.prepare(worker.model.tokenizer)
        except ValueError as err:
            raise APIError(400, str(err), param=getattr(err, "field", None), code="invalid_prompt") from None
        self._send_json(200, {"input_tokens": len(ids)})

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
        else:  # why a request was refused, for whoever reads the server's log
            log.info("%d %s%s: %s", err.status, err.code or err.type,
                     f" ({err.param})" if err.param else "", escape_controls(err.message[:500]))
        self._send_json(err.status, err.anthropic_body() if self._anthropic else err.body(), err.headers)
