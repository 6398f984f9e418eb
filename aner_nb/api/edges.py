"""The connection edges uvicorn's h11 protocol leaves open: slow request heads, unread bodies, bad framing.

uvicorn bounds the idle time between requests (``timeout_keep_alive``) but
not the time a request takes to arrive: every received byte resets its
keep-alive timer, so a client that sends a header line every few seconds
holds a connection forever (slow-loris), and a fresh connection that sends
nothing is never closed. After an answer that closes the connection it
closes the socket at once, even while the client is still sending its body:
the kernel then answers the client's next bytes with a reset, and most
clients (which send the whole body before reading) lose the answer, so a
413 reaches them as ECONNRESET. And it answers a framing error (malformed
chunked encoding, an oversized head) in plain text.

:class:`EdgeProtocol` (uvicorn's ``H11Protocol`` with these bounds) adds:

- a head deadline: the request line and headers must arrive within
  ``header_timeout_s`` of the connection opening or of the previous request
  ending; past it the connection is closed (after a bare ``408`` when part of
  a head had arrived);
- a body deadline, a net under the ``Guard``'s (which answers a slow body
  408 when the application reads it): a body still arriving
  ``body_timeout_s`` plus a second after its head closes the connection, so
  a body nothing reads (after an early answer) cannot hold it either;
- a lingering close: closing while the client is still sending half-closes
  the connection (a FIN after the answer) and reads and discards what comes,
  until the client closes or ``linger_s`` passes, so the client reads the
  answer;
- framing errors answered in the service's JSON error shape, with h11's
  reason and status (400, or 431 for an oversized head);
- connection slots (``connections.ConnectionRegistry``, one per server): a
  connection beyond its client's limit is answered ``429`` at once, before
  any request is read, and closed; at the total limit the oldest idle
  connection is closed to make room (``503`` when none is idle).

uvicorn has no public hook for any of this, so ``EdgeProtocol`` subclasses
``uvicorn.protocols.http.h11_impl.H11Protocol``, an internal class. That is
the one private import left: uvicorn is pinned to the tested range in
``pyproject.toml``, and ``tests/test_api_internals.py`` fails with a clear
message when the installed uvicorn or h11 is outside it or the methods and
attributes used here changed shape. h11 is used through its public API only.
"""

from __future__ import annotations

import asyncio
import http
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol  # internal: see the module docstring

from .connections import ConnectionRegistry, client_key
from .envelope import error_json

__all__ = ["EdgeProtocol", "edge_protocol", "MAX_HEAD_BYTES", "UVICORN_HOOKS"]

log = logging.getLogger("aner_nb.api")

BODY_GRACE_S = 1.0  # the Guard's 408 (a JSON answer) comes first; the protocol's close is the net under it
TIMEOUT_HEAD = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
# Our own bound on an incomplete request head (h11's default, which h11 does not export), passed to
# h11.Connection's public max_incomplete_event_size argument.
MAX_HEAD_BYTES = 16 * 1024
REFUSE_LINGER_S = 1.0  # a refused connection reads and drops what its client sends for at most this long
# What EdgeProtocol uses of uvicorn's H11Protocol (checked by tests/test_api_internals.py).
UVICORN_HOOKS = {
    "methods": ("connection_made", "connection_lost", "data_received", "handle_events", "on_response_complete",
                "shutdown", "send_400_response"),
    "attributes": ("config", "conn", "cycle", "transport", "flow", "loop", "connections"),
}
_REFUSALS = {
    "per_client": (429, "too_many_connections", "this client has too many open connections to this service; "
                   "reuse or close some"),
    "capacity": (503, "server_full", "this service has no free connection slot: every connection has a "
                 "request in flight; retry later"),
}


def _phrase(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def edge_protocol(*, header_timeout_s: float, body_timeout_s: float, linger_s: float = 5.0,
                  registry: ConnectionRegistry | None = None, retry_after_s: int = 1) -> type:
    """An :class:`EdgeProtocol` class with these bounds (and, given one, a server's connection registry),
    for ``uvicorn.Config(http=...)``."""
    return type("EdgeProtocol", (EdgeProtocol,), {
        "header_timeout_s": float(header_timeout_s),
        "body_timeout_s": float(body_timeout_s),
        "linger_s": float(min(linger_s, body_timeout_s)),
        "registry": registry,
        "retry_after_s": int(retry_after_s),
    })


class _Connection(h11.Connection):
    """h11's connection, keeping the last protocol error it raised (uvicorn drops it), and bounding whole heads.

    h11's ``max_incomplete_event_size`` bounds only a head still arriving: one that
    arrives whole in a segment passed at any size up to the socket's read (a review
    sent 5,000 headers, 52.7 KiB, in one write). A complete request head over the
    same bound is refused the same way (431).
    """

    last_error: h11.RemoteProtocolError | None = None

    def __init__(self, our_role: Any, *, max_incomplete_event_size: int) -> None:
        super().__init__(our_role, max_incomplete_event_size=max_incomplete_event_size)
        self.max_head_bytes = max_incomplete_event_size

    def next_event(self) -> Any:
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                size = len(event.method) + len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers)
                if size > self.max_head_bytes:
                    raise h11.RemoteProtocolError(
                        f"the request head is {size} bytes, above the {self.max_head_bytes} allowed",
                        error_status_hint=431)
            return event
        except h11.RemoteProtocolError as exc:
            self.last_error = exc
            raise


class _Transport:
    """The connection's transport as uvicorn sees it: ``close()`` may linger (see ``EdgeProtocol._close``)."""

    def __init__(self, transport: asyncio.Transport, protocol: "EdgeProtocol") -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        self._protocol._close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class EdgeProtocol(H11Protocol):
    """uvicorn's h11 protocol with a head deadline, a body deadline, a lingering close and JSON framing errors."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    linger_s: float = 5.0
    registry: ConnectionRegistry | None = None
    retry_after_s: int = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        size = self.config.h11_max_incomplete_event_size
        self.conn = _Connection(h11.SERVER, max_incomplete_event_size=size if size is not None else MAX_HEAD_BYTES)
        self._raw: asyncio.Transport | None = None
        self._phase: str | None = None  # "head", "body", or None (the request is in; the answer is the app's)
        self._deadline: asyncio.TimerHandle | None = None
        self._lingering: asyncio.TimerHandle | None = None

    # -- the connection ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        if self.registry is not None:
            refused = self.registry.admit(self, client_key(transport.get_extra_info("peername")))
            if refused is not None:
                self._refuse(refused)
                return
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel("_deadline")
        self._cancel("_lingering")
        if self.registry is not None:
            self.registry.release(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            return  # the answer is sent and the connection is closing: what still comes is discarded
        super().data_received(data)
        self._watch()
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()
        self._track()

    def shutdown(self) -> None:
        if self._lingering is not None and self._raw is not None:
            self._raw.close()  # the server is stopping: no more waiting for the client to finish sending
            return
        super().shutdown()

    def send_400_response(self, msg: str) -> None:
        """A framing error (uvicorn's ``msg`` is generic): h11's reason and status, in the JSON error shape."""
        error = self.conn.last_error
        status = error.error_status_hint if error is not None else 400
        reason = str(error) if error is not None and str(error) else msg
        body = error_json(f"malformed HTTP request: {reason}", type="invalid_request_error",
                          code="header_too_large" if status == 431 else "malformed_request")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the application reading this body sees http.disconnect; its answer is dropped
            self.cycle.message_event.set()
        try:
            head = h11.Response(status_code=status, headers=headers, reason=_phrase(status))
            for event in (head, h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # an answer had already started: the connection can only be closed
            pass
        self.transport.close()

    # -- connection slots -------------------------------------------------------------------
    def _track(self) -> None:
        """Tell the registry whether a request is in flight here (busy) or not (idle: evictable)."""
        if self.registry is None or self._raw is None or self._raw.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.registry.busy(self)
        else:
            self.registry.idle(self)

    def evict(self) -> None:
        """Close this idle connection to make room for a new one (the registry has already let it go)."""
        raw = self._raw
        if raw is None or raw.is_closing():
            return
        log.info("closing an idle connection to make room for a new one (at the limit of %s connections)",
                 self.registry.max_total if self.registry is not None else "?")
        self._cancel("_deadline")
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        raw.close()

    def _refuse(self, reason: str) -> None:
        """Answer a connection the registry refused (429 or 503, JSON) before reading it, and close it."""
        status, code, message = _REFUSALS[reason]
        body = error_json(message, type="overloaded_error", code=code)
        head = (f"HTTP/1.1 {status} {_phrase(status).decode()}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nretry-after: {self.retry_after_s}\r\nconnection: close\r\n\r\n")
        raw = self._raw
        assert raw is not None
        log.info("refused a connection from %s: %s", self.client[0] if self.client else "?", code)
        raw.write(head.encode() + body)
        if not raw.can_write_eof():
            raw.close()
            return
        # Half-close, and drop what the client sends (its request) until it closes or the bound passes:
        # closing with its request unread would reset the connection before the client reads the answer.
        raw.write_eof()
        self._lingering = self.loop.call_later(min(REFUSE_LINGER_S, self.linger_s), raw.close)

    # -- deadlines --------------------------------------------------------------------------
    def _watch(self) -> None:
        """Arm the deadline of the phase the request is in, when that phase has just begun."""
        state = self.conn.their_state
        phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._phase or self._raw is None or self._raw.is_closing():
            return
        self._phase = phase
        self._cancel("_deadline")
        if phase == "head":
            self._deadline = self.loop.call_later(self.header_timeout_s, self._head_late)
        elif phase == "body":
            self._deadline = self.loop.call_later(self.body_timeout_s + BODY_GRACE_S, self._body_late)

    def _head_late(self) -> None:
        self._deadline = None
        raw = self._raw
        if raw is None or raw.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        partial = bool(self.conn.trailing_data[0])
        log.info("closing a connection whose request head did not arrive within %g s", self.header_timeout_s)
        if partial:
            raw.write(TIMEOUT_HEAD)  # raw bytes: h11 cannot answer a request it has not parsed
        raw.close()

    def _body_late(self) -> None:
        self._deadline = None
        raw = self._raw
        if raw is None or raw.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        log.info("closing a connection whose request body did not arrive within %g s", self.body_timeout_s)
        raw.close()  # what still reads the body gets http.disconnect (uvicorn's connection_lost)

    # -- closing ----------------------------------------------------------------------------
    def _close(self) -> None:
        """Close; while the client is still sending, half-close and discard what comes for up to ``linger_s``."""
        raw = self._raw
        if raw is None or self._lingering is not None:
            return  # already lingering: its own bound, the client's EOF (asyncio then closes) or shutdown ends it
        sending = self.conn.their_state in (h11.SEND_BODY, h11.ERROR)
        if not sending or raw.is_closing() or not raw.can_write_eof():
            raw.close()
            return
        self._cancel("_deadline")
        self._lingering = self.loop.call_later(self.linger_s, raw.close)
        raw.write_eof()  # sent once the answer is flushed; the client sees the answer, then the end
        self.flow.resume_reading()

    def _cancel(self, name: str) -> None:
        handle = getattr(self, name)
        if handle is not None:
            handle.cancel()
            setattr(self, name, None)
