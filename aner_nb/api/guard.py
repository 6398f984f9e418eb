"""The outermost ASGI layer: bearer-token check, request-body bounds, request counting.

It runs before routing and before any body is parsed, so an unauthenticated
or oversized request costs at most ``max_body_bytes`` of reading: a declared
``Content-Length`` above the bound is refused without reading at all, a
chunked body is refused as soon as it passes the bound (413). A body that
has not fully arrived ``body_timeout_s`` after its head is answered 408, and
a JSON body that is not UTF-8 (RFC 8259) 400 ``invalid_encoding`` naming the
first bad byte. The accepted body is replayed to the application; later
``receive()`` calls go to the server, so the application still sees
``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any, Awaitable, Callable

__all__ = ["Guard"]

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


def _error(status: int, message: str, type_: str, code: str, headers: list[tuple[bytes, bytes]] = ()) -> tuple:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    return status, head, body


class Guard:
    """ASGI middleware: auth (constant-time), body bound, per-route request counts and durations."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        body_timeout_s: float = 30.0,
        bearer_token: str | None,
        open_paths: frozenset[str],
        routes: frozenset[str],
        record: Callable[[str, int, float], None],
    ) -> None:
        """``open_paths`` need no token; ``routes`` are the paths ``record`` counts by name (others as ``other``)."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self._token = bearer_token.encode() if bearer_token is not None else None
        self.open_paths = open_paths
        self.routes = routes
        self.record = record

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        path = scope.get("path", "")
        route = path if path in self.routes else "other"
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._authorize(scope, path)
            if refusal is None and scope.get("method") in ("POST", "PUT", "PATCH"):
                refusal, receive = await self._bounded_body(scope, receive)
            if refusal is not None:
                code, headers, body = refusal
                await counting_send({"type": "http.response.start", "status": code, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            await self.app(scope, receive, counting_send)
        finally:
            self.record(route, status, time.perf_counter() - started)

    def _authorize(self, scope: Scope, path: str) -> tuple | None:
        if self._token is None or path in self.open_paths:
            return None
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = credentials.strip()
                break
        # compare_digest's time does not depend on where the bytes differ.
        if given and hmac.compare_digest(given, self._token):
            return None
        return _error(401, "missing or invalid bearer token (send 'Authorization: Bearer <token>')",
                      "authentication_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])

    async def _bounded_body(self, scope: Scope, receive: Callable[[], Awaitable[Message]]) -> tuple[Any, Any]:
        limit = self.max_body_bytes
        too_large = _error(413, f"the request body is larger than this service's limit of {limit} bytes",
                           "invalid_request_error", "request_too_large", [(b"connection", b"close")])
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return _error(400, "Content-Length is not an integer", "invalid_request_error",
                                  "bad_content_length"), receive
                if declared > limit:
                    return too_large, receive
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                return _error(408, f"the request body did not arrive within this service's body timeout of "
                              f"{self.body_timeout_s:g} s", "invalid_request_error", "request_timeout",
                              [(b"connection", b"close")]), receive
            if message["type"] == "http.disconnect":
                return None, _replay([], message, receive)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return too_large, receive
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if _is_json(scope):
            refusal = _not_utf8(chunks)
            if refusal is not None:
                return refusal, receive
        return None, _replay(chunks, None, receive)


def _is_json(scope: Scope) -> bool:
    """Whether the application parses the body as JSON: no content type, or application/json or */*+json."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return True


def _not_utf8(chunks: list[bytes]) -> tuple | None:
    """A 400 naming the first byte that is not UTF-8, or None. JSON exchanged between systems is UTF-8 (RFC 8259)."""
    body = b"".join(chunks)
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _error(400, f"the request body is not valid UTF-8: byte 0x{body[exc.start]:02x} at offset {exc.start} "
                      f"({exc.reason}); JSON request bodies must be UTF-8 encoded", "invalid_request_error",
                      "invalid_encoding")
    return None


def _replay(chunks: list[bytes], first: Message | None, receive: Callable[[], Awaitable[Message]]) -> Callable[[], Awaitable[Message]]:
    """A receive() that yields the buffered body once, then defers to the server's receive()."""
    pending: list[Message] = [first] if first is not None else [
        {"type": "http.request", "body": b"".join(chunks), "more_body": False}
    ]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
