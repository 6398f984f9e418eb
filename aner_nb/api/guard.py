"""The ASGI layer under the ``OriginGuard`` (``origin.py``): API keys, content type, body bounds, request counting.

It runs before routing and before any body is parsed, so an unauthenticated
or oversized request costs at most ``max_body_bytes`` of reading: a declared
``Content-Length`` above the bound is refused without reading at all, a
chunked body is refused as soon as it passes the bound (413). A body that
has not fully arrived ``body_timeout_s`` after its head is answered 408, and
a JSON body that is not UTF-8 (RFC 8259) 400 ``invalid_encoding`` naming the
first bad byte. The accepted body is replayed to the application; later
``receive()`` calls go to the server, so the application still sees
``http.disconnect``.

A token is accepted when it equals one of the service's keys (the bearer
token and the keys of a key file; see ``keys``): the SHA-256 digests of the
token and of every key are compared with ``hmac.compare_digest``, all of
them, so the time depends neither on where a key differs nor on which key
matched. A ``POST`` (``PUT``, ``PATCH``) body must be declared
``application/json`` (a ``charset`` parameter, if any, ``utf-8``), else 415
before the body is read: browsers send ``text/plain``, form and multipart
bodies cross-site without a preflight, JSON only after one.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from typing import Any, Awaitable, Callable

from .envelope import error_json

__all__ = ["Guard"]

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


def _error(status: int, message: str, type_: str, code: str, headers: list[tuple[bytes, bytes]] = ()) -> tuple:
    body = error_json(message, type=type_, code=code)
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
        bearer_token: str | None = None,
        api_keys: tuple[str, ...] = (),
        open_paths: frozenset[str],
        routes: frozenset[str],
        record: Callable[[str, int, float], None],
    ) -> None:
        """``open_paths`` need no token; ``routes`` are the paths ``record`` counts by name (others as ``other``)."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        keys = ((bearer_token,) if bearer_token is not None else ()) + tuple(api_keys)
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in dict.fromkeys(keys))
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
                refusal = _not_json(scope)
                if refusal is None:
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
        if not self._digests or path in self.open_paths:
            return None
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = credentials.strip()
                break
        if given and self._matches(given):
            return None
        return _error(401, "missing or invalid bearer token (send 'Authorization: Bearer <token>')",
                      "authentication_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])

    def _matches(self, given: bytes) -> bool:
        """Whether ``given`` is one of the keys: equal-length digests, every key compared (no early exit)."""
        digest = hashlib.sha256(given).digest()
        found = False
        for key in self._digests:
            found |= hmac.compare_digest(digest, key)
        return found

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
        refusal = _not_utf8(chunks)  # every accepted body is JSON (_not_json)
        if refusal is not None:
            return refusal, receive
        return None, _replay(chunks, None, receive)


def _not_json(scope: Scope) -> tuple | None:
    """A 415 unless the body is declared ``application/json`` (``charset``, if given, ``utf-8``)."""
    declared = None
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            declared = value
            break
    if declared is not None:
        media, *params = declared.decode("latin-1").split(";")
        charset = [p.split("=", 1)[1].strip().strip('"').lower() for p in params
                   if "=" in p and p.split("=", 1)[0].strip().lower() == "charset"]
        if media.strip().lower() == "application/json" and all(c in ("utf-8", "utf8") for c in charset):
            return None
    got = "no Content-Type" if declared is None else f"Content-Type {declared.decode('latin-1')[:100]!r}"
    return _error(415, f"request bodies must be JSON: send 'Content-Type: application/json' (got {got})",
                  "invalid_request_error", "unsupported_media_type", [(b"connection", b"close")])


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
