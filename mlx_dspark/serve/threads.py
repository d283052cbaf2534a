"""Anthropic's message threads (beta `message-threads-2026-08-12`, which the SDK's tool runner uses by
default): the server holds a conversation under each reply's `id`, so a turn sends only its new messages.

`thread: {"type": "create"}` sends the whole conversation and asks the server to hold it, with the reply,
under the reply's `id`; `{"type": "continue", "previous_message_id": id}` sends only the new messages and
leaves out `system` and `tools`, which the thread keeps from its create. A reply is continued once
(`thread_already_continued`), not while another continue from it runs (`thread_continue_in_flight`). An
id this server does not hold (idle past `ttl_s`, evicted past `capacity`, or never seen) is a 404
`thread_not_found`, after which the SDK replays the whole conversation under a new thread; a
conversation over `max_bytes` is a 400 `thread_unsupported_request`, after which the tool runner goes on
without a thread. The error codes are the SDK's (`anthropic.types.Thread*ErrorDetails`).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from mlx_dspark.serve.errors import APIError, bad_value

DEFAULT_CAPACITY = 64  # conversations held at once (the least recently used goes first)
DEFAULT_MAX_BYTES = 4 * 1024 * 1024  # one held conversation's JSON, at most
DEFAULT_TTL_S = 3600.0  # a conversation nobody continued for this long is dropped
CREATE_ONLY = ("system", "tools")  # kept from the create; a continue that sends other values is refused


@dataclass
class Held:
    """One reply's conversation: the create's `system` and `tools`, and the messages up to the reply."""

    system: Any
    tools: Any
    messages: list[dict]
    size: int
    used: float
    in_flight: bool = False


@dataclass
class ThreadTurn:
    """A threaded request being answered: what it continues from (None: a create) and the conversation sent."""

    previous_id: str | None
    system: Any
    tools: Any
    messages: list[dict]
    done: bool = field(default=False)


def _thread_error(status: int, message: str, error_code: str, **details: Any) -> APIError:
    return APIError(status, message, param="thread", code=error_code, details={"error_code": error_code, **details})


def _size(system: Any, tools: Any, messages: list[dict]) -> int:
    return len(json.dumps([system, tools, messages], default=str))


class ThreadStore:
    """Conversations held between the turns of their threads, least recently used first; shared by the
    handler threads. `capacity` 0 holds none: every threaded request is a `thread_unsupported_request`."""

    def __init__(self, *, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES,
                 ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.max_bytes, self.ttl_s, self._clock = capacity, max_bytes, ttl_s, clock
        self._held: OrderedDict[str, Held] = OrderedDict()
        # replies already continued (each continues once) or whose conversation grew past max_bytes: a
        # continue from one gets the error that says so, not thread_not_found; bounded as the held ones
        self._spent: OrderedDict[str, APIError] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def begin(self, body: dict) -> tuple[dict, ThreadTurn]:
        """The request `body` (with a `thread`) as the whole conversation to answer, and its turn, which
        `finish` or `abandon` must end. Raises the SDK's thread errors."""
        thread = body.get("thread")
        if not isinstance(thread, dict) or thread.get("type") not in ("create", "continue"):
            raise bad_value("thread", "{'type': 'create'} or {'type': 'continue', 'previous_message_id': ...}", thread)
        if self.capacity < 1:
            raise _thread_error(400, "this server holds no threads: send the whole conversation "
                                "without 'thread'", "thread_unsupported_request")
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise bad_value("messages", "a list of messages", messages)
        if thread["type"] == "create":
            turn = ThreadTurn(None, body.get("system"), body.get("tools"), list(messages))
        else:
            turn = self._continue(thread.get("previous_message_id"), body, messages)
        size = _size(turn.system, turn.tools, turn.messages)
        if size > self.max_bytes:
            self.abandon(turn)
            raise self._too_large(size)
        whole = {k: v for k, v in body.items() if k != "thread"}
        whole["messages"] = turn.messages
        for name in CREATE_ONLY:
            whole.pop(name, None)
            if getattr(turn, name) is not None:
                whole[name] = getattr(turn, name)
        return whole, turn

    def _continue(self, previous_id: Any, body: dict, messages: list) -> ThreadTurn:
        if not isinstance(previous_id, str):
            raise bad_value("thread.previous_message_id", "the id of the previous reply in this thread", previous_id)
        with self._lock:
            self._expire()
            held = self._held.get(previous_id)
            if held is None:
                spent = self._spent.get(previous_id)
                if spent is not None:
                    raise spent
                raise _thread_error(404, f"thread: no conversation is held for {previous_id!r} (idle past "
                                    f"{self.ttl_s:g} s, one of more than {self.capacity} held, or not from this "
                                    "server): send it whole with thread {'type': 'create'}", "thread_not_found")
            if held.in_flight:
                raise _thread_error(400, f"thread: another request is continuing from {previous_id!r}; continue "
                                    "from its reply", "thread_continue_in_flight")
            changed = [name for name in CREATE_ONLY if name in body and body[name] != getattr(held, name)]
            if changed:
                raise _thread_error(400, f"thread: {' and '.join(map(repr, changed))} differ from the thread's (kept "
                                    "from its create): leave them out, or start a new thread", "thread_fingerprint_mismatch")
            held.in_flight = True
            held.used = self._clock()
            self._held.move_to_end(previous_id)
            return ThreadTurn(previous_id, held.system, held.tools, [*held.messages, *messages])

    def finish(self, turn: ThreadTurn, reply_id: str, content: list[dict]) -> None:
        """Hold the conversation with the reply (`content`, the message's blocks) under `reply_id`."""
        if turn.done:
            return
        turn.done = True
        messages = [*turn.messages, {"role": "assistant", "content": copy.deepcopy(content)}]
        size = _size(turn.system, turn.tools, messages)
        with self._lock:
            self._expire()
            if turn.previous_id is not None and self._held.pop(turn.previous_id, None) is not None:
                self._spend(turn.previous_id, _thread_error(
                    400, f"thread: {turn.previous_id!r} was continued already (each reply continues once): "
                    "continue from the thread's latest reply", "thread_already_continued"))
            if size > self.max_bytes:  # the next continue says why the thread ends here
                self._spend(reply_id, self._too_large(size))
                return
            self._held[reply_id] = Held(turn.system, turn.tools, messages, size, self._clock())
            while len(self._held) > self.capacity:
                self._held.popitem(last=False)

    def abandon(self, turn: ThreadTurn) -> None:
        """A turn that got no complete reply (an error, a client gone): its previous reply may be continued again."""
        if turn.done:
            return
        turn.done = True
        with self._lock:
            held = self._held.get(turn.previous_id) if turn.previous_id is not None else None
            if held is not None:
                held.in_flight = False

    def _too_large(self, size: int) -> APIError:
        return _thread_error(400, f"thread: the conversation is {size} bytes; this server holds threads of at most "
                             f"{self.max_bytes}: send it whole without 'thread'", "thread_unsupported_request")

    def _spend(self, reply_id: str, err: APIError) -> None:
        self._spent[reply_id] = err
        while len(self._spent) > 4 * max(self.capacity, 1):
            self._spent.popitem(last=False)

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        for reply_id in [k for k, held in self._held.items() if held.used < cutoff and not held.in_flight]:
            del self._held[reply_id]
