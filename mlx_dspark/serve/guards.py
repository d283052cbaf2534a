"""Request guards the HTTP handler applies before any model work: Host and Origin names (loopback rules,
--allow-origin values), JSON bodies (depth, valid Unicode) and log-safe text."""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from mlx_dspark.serve.protocol import APIError

MAX_JSON_DEPTH = 64  # request bodies are flat; deeper nesting is an attack on the parser


def host_name(host: str) -> str:
    """The name in a Host header, without the port: "[::1]:8080" -> "::1", "localhost:80" -> "localhost"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback_name(name: str) -> bool:
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


def escape_controls(text: str) -> str:
    """Control characters a client put in its request line, escaped, so they cannot forge log lines."""
    return text.translate(_CONTROL_ESCAPES)
