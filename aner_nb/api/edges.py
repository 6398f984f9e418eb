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
  reason and status (400, or 431 for an oversized head).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

__all__ = ["EdgeProtocol", "edge_protocol"]

log = logging.getLogger("aner_nb.api")

BODY_GRACE_S = 1.0  # the Guard's 408 (a JSON answer) comes first; the protocol's close is the net under it
TIMEOUT_HEAD = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def edge_protocol(*, header_timeout_s: float, body_timeout_s: float, linger_s: float = 5.0) -> type:
    """An :class:`EdgeProtocol` class with these bounds, for ``uvicorn.Config(http=...)``."""
    return type("EdgeProtocol", (EdgeProtocol,), {
        "header_timeout_s": float(header_timeout_s),
        "body_timeout_s": float(body_timeout_s),
        "linger_s": float(min(linger_s, body_timeout_s)),
    })


class _Connection(h11.Connection):
    """h11's connection, keeping the last protocol error it raised (uvicorn drops it)."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        size = self.config.h11_max_incomplete_event_size
        self.conn = _Connection(h11.SERVER, size if size is not None else DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)
        self._raw: asyncio.Transport | None = None
        self._phase: str | None = None  # "head", "body", or None (the request is in; the answer is the app's)
        self._deadline: asyncio.TimerHandle | None = None
        self._lingering: asyncio.TimerHandle | None = None

    # -- the connection ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel("_deadline")
        self._cancel("_lingering")
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            return  # the answer is sent and the connection is closing: what still comes is discarded
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

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
        body = json.dumps({"error": {
            "message": f"malformed HTTP request: {reason}", "type": "invalid_request_error", "param": None,
            "code": "header_too_large" if status == 431 else "malformed_request",
        }}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the application reading this body sees http.disconnect; its answer is dropped
            self.cycle.message_event.set()
        try:
            head = h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES.get(status, b""))
            for event in (head, h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # an answer had already started: the connection can only be closed
            pass
        self.transport.close()

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
