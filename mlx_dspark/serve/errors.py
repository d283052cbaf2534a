"""The error every surface raises: a status, a message and the field it names; each protocol writes
it in its own shape (OpenAI's `{"error": {...}}`, Anthropic's `{"type": "error", "error": {...}}`)."""

from __future__ import annotations

from typing import Any

# OpenAI error types -> Anthropic's (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class APIError(Exception):
    """An error the client gets as OpenAI's `{"error": {...}}` body with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.details = details  # Anthropic's `error.details` (`error_code`, ...), which its SDK branches on

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        error: dict[str, Any] = {"type": kind, "message": self.message}
        if self.details is not None:
            error["details"] = self.details
        return {"type": "error", "error": error}


def bad_value(name: str, expected: str, value: Any) -> APIError:
    return APIError(400, f"'{name}' must be {expected}, got {value!r}", param=name, code="invalid_value")
