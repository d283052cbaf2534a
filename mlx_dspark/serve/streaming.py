"""Writing one answer: the whole body, or server-sent events that start at once.

A stream's headers and first event (`message_start`, `response.created`, the chat role chunk) go out
before the prefill, and while no token comes a keep-alive goes out every `keepalive_s` (Anthropic's
`ping` event, an SSE comment for the OpenAI protocols), so clients with a first-byte or idle timeout
keep waiting on a long prompt (Claude Code's watchdog ignores pings: after a minute its stream also
gets empty text deltas); writing to a client that left raises, which cancels the job (as the
handler's poll of the socket does between writes). A writer whose answer is complete before the
generation ends (the one call a named choice allows) stops reading the job; the handler cancels it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from mlx_dspark.serve.errors import APIError

log = logging.getLogger("mlx_dspark.server")

KEEPALIVE_S = 10.0


class AnswerWriting:
    """Mixed into the handler: `_complete` and `_stream` for a job and its protocol's writer."""

    def _warning_headers(self, request: Any) -> dict[str, str]:
        if not request.warnings:
            return {}
        return {"X-DSpark-Warning": "; ".join(request.warnings).encode("ascii", "replace").decode()[:1000]}

    def _complete(self, job: Any, writer: Any) -> None:
        for step in job.results():
            writer.add(step)
            if writer.finished:
                break
        if not writer.finished:
            self.close_connection = True
            return  # the client left while we were generating
        self._send_json(200, writer.body(), self._warning_headers(writer.request))

    def _stream(self, job: Any, writer: Any, prompt_tokens: int) -> None:
        self._start_stream(self._warning_headers(writer.request))
        for name, payload in writer.start_events(prompt_tokens):
            self._send_event(payload, name)
        started, pings = time.monotonic(), 0

        def keep_alive() -> None:
            nonlocal pings
            pings += 1
            if job.steps == 0 and pings % 3 == 1:
                where = "running" if self.server.worker.running(job) else "queued behind other requests"
                log.info("%s request: no token yet after %.0f s, %s (a %d-token prompt)", writer.request.kind,
                         time.monotonic() - started, where, prompt_tokens)
            events = writer.keepalive_events(time.monotonic() - started)
            if not events:
                self._write_chunk(b": keep-alive\n\n")
            for name, payload in events:
                self._send_event(payload, name)

        try:
            for step in job.results(idle_s=self.server.keepalive_s, on_idle=keep_alive):
                for name, payload in writer.add(step):
                    self._send_event(payload, name)
                if writer.finished:
                    self._end_stream()
                    return
            self.close_connection = True  # the client left: the stream stays unfinished
        except APIError as err:
            log.info("%d %s (in the stream): %s", err.status, err.code, err.message)
            for name, payload in writer.error_events(err):  # headers are gone: the error travels as an event
                self._send_event(payload, name)
            self._end_stream()

    def _start_stream(self, headers: dict[str, str] | None = None) -> None:
        self._stream_started = True
        self._chunked = self.request_version == "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")  # reverse proxies: pass events on at once
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self._send_cors_headers()
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True  # HTTP/1.0: the end of the stream is the end of the connection
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.flush()

    def _send_event(self, payload: dict | str, name: str | None = None) -> None:
        """One server-sent event; `name` for the protocols with typed events (Anthropic, Responses)."""
        head = f"event: {name}\n" if name else ""
        data = f"{head}data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
        self._write_chunk(data)

    def _end_stream(self) -> None:
        if self._chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _write_chunk(self, data: bytes) -> None:
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        self.wfile.write(data)
        self.wfile.flush()
