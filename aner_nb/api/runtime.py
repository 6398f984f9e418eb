"""Running library requests from the event loop without blocking it.

Every served model is a :class:`Mount`: its lease, an admission gate and a
worker pool of exactly the gate's size. An admitted request becomes a
:class:`Generation`: a library :class:`~aner_nb.llm.Stream` whose pieces are
pulled one call at a time on the pool, so each request holds at most one
worker thread and the pool never queues. The gate is left only once the
stream has really ended (its sequence freed), so a cancelled or timed-out
request's slot is free before the next request is admitted against it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from ..llm import Lease, Response
from .metrics import ModelMetrics, ServiceMetrics

__all__ = ["Gate", "Mount", "Generation", "RequestTimeout", "ClientGone", "capacity_of"]

_END = object()


class RequestTimeout(Exception):
    """The request ran past the service's ``timeout_ms``; its generation was cancelled."""


class Gate:
    """At most ``limit`` requests of one model in flight; the rest are turned away, never queued."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._in_flight = 0

    def try_enter(self) -> bool:
        with self._lock:
            if self._in_flight >= self.limit:
                return False
            self._in_flight += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight


def capacity_of(model: Lease) -> int:
    """Requests a lease can hold at once: sequences plus its waiting queue when it batches, else one."""
    if model.supports("continuous_batching"):
        stats = model.stats()  # type: ignore[attr-defined]
        return stats.max_sequences + stats.queue_limit
    return 1


class Mount:
    """One served model: its route, public id, admission gate, worker pool and counters."""

    def __init__(self, *, path: str, model: Lease, name: str, max_concurrent: int | None,
                 metrics: ModelMetrics | None = None) -> None:
        self.path = path
        self.model: Any = model
        self.name = name
        self.batching = model.supports("continuous_batching")  # it has a scheduler whose stats() we read
        self.capacity = max_concurrent if max_concurrent is not None else capacity_of(model)
        self.gate = Gate(self.capacity)
        self.metrics = metrics if metrics is not None else ServiceMetrics().model(name)
        self.created = int(time.time())
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._live: set[Generation] = set()
        self._live_lock = threading.Lock()

    @property
    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The worker threads, created on first use (``asgi()`` may run without a lifespan)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.capacity, thread_name_prefix=f"aner-http-{self.name}"[:40]
                )
            return self._pool

    def stats(self) -> Any:
        """The batching scheduler's snapshot (a SchedulerStats), or None for a lease without one."""
        return self.model.stats() if self.batching else None

    def cancel_all(self) -> None:
        """Server shutdown: cancel every generation still running."""
        with self._live_lock:
            live = list(self._live)
        for generation in live:
            generation.abort()

    def shutdown(self) -> None:
        """Cancel what runs, join the workers, and let go of the lease (the application is done)."""
        self.cancel_all()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.batching = False
        self.model = _Released(self.model)

    def _track(self, generation: "Generation", live: bool) -> None:
        with self._live_lock:
            (self._live.add if live else self._live.discard)(generation)


class _Released:
    """Stands in for a lease once its service shut down: closed, same metadata, holds no weights."""

    closed = True

    def __init__(self, model: Any) -> None:
        self.name = model.name
        self.fingerprint = model.fingerprint

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        from ..llm.errors import ClosedError

        raise ClosedError("this service has shut down; it no longer holds the lease")


def _next_piece(stream: Any) -> Any:
    try:
        return next(stream)
    except StopIteration:
        return _END


class Generation:
    """One admitted request: its stream, pulled piece by piece on the mount's pool.

    ``abort()`` (thread safe, never blocks the caller) cancels the stream: a
    short-lived thread asks the library to stop, waits for any piece call in
    flight, closes the stream (freeing its sequence) and leaves the gate,
    exactly once. ``wait_closed()`` resolves when that has happened.
    """

    def __init__(self, mount: Mount, timeout_s: float) -> None:
        self.mount = mount
        self.loop = asyncio.get_running_loop()
        self.admitted_at = self.loop.time()
        self.deadline = self.admitted_at + timeout_s
        self.first_piece_s: float | None = None  # seconds from admission to the first text piece
        self.stream: Any = None
        self.timed_out = False
        self.disconnected = False
        self._lock = threading.Lock()
        self._in_flight: concurrent.futures.Future | None = None
        self._aborting = False
        self._opening = False
        self._released = False
        self._closed: concurrent.futures.Future = concurrent.futures.Future()

    async def open(self, start: Callable[[], Any]) -> None:
        """Create the stream on a worker (render, tokenize, submit); library errors propagate."""
        self.mount._track(self, True)
        self._opening = True
        try:
            self.stream = await self._call(start)
        except BaseException:
            self.abort()
            raise
        finally:
            self._opening = False

    async def pieces(self, disconnected: "Awaitable[Any] | None" = None) -> AsyncIterator[str]:
        """Yield text pieces until the stream ends.

        Past the deadline raises :class:`RequestTimeout` once the generation is
        cancelled and its slot freed; when ``disconnected`` resolves first,
        raises :class:`ClientGone`. Task cancellation (a streaming client that
        went away) aborts the generation too.
        """
        watch = asyncio.ensure_future(disconnected) if disconnected is not None else None
        try:
            while True:
                piece = await self._call(_next_piece, self.stream, watch=watch)
                if piece is _END:
                    self._release()
                    return
                if self.first_piece_s is None:
                    self.first_piece_s = self.loop.time() - self.admitted_at
                yield piece
        except asyncio.CancelledError:  # the server cancelled the task: its streaming client went away
            self.client_gone()
            raise
        except BaseException:
            self.abort()
            raise
        finally:
            if watch is not None:
                watch.cancel()

    async def collect(self, disconnected: "Awaitable[Any] | None" = None) -> Response:
        """Run the stream to its end and return its Response."""
        async for _ in self.pieces(disconnected):
            pass
        return self.response

    @property
    def response(self) -> Response:
        return self.stream.response

    async def wait_closed(self) -> None:
        """Wait (shielded) until the stream has ended and the gate was left."""
        await asyncio.shield(asyncio.wrap_future(self._closed))

    # -- internals --------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Any], *args: Any, watch: "asyncio.Future | None" = None) -> Any:
        future = self.mount.pool.submit(fn, *args)
        with self._lock:
            self._in_flight = future
        wrapped = asyncio.wrap_future(future)
        waiting = {wrapped} if watch is None else {wrapped, watch}
        remaining = max(self.deadline - self.loop.time(), 0.0)
        done, _ = await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        if wrapped in done:
            with self._lock:
                self._in_flight = None
            return wrapped.result()  # the library's error, if any, is raised here
        if watch is not None and watch in done:
            self.client_gone()
            raise ClientGone()
        self.timed_out = True
        self.mount.metrics.count("timeouts")
        self.abort()
        await self.wait_closed()
        raise RequestTimeout()

    def client_gone(self) -> None:
        """The client went away: counted once, unless the generation had already ended or been given up
        (a timeout, an error); then cancelled. Safe to call from every place that notices it."""
        with self._lock:
            noticed = not (self.disconnected or self._released or self._aborting)
            if noticed:
                self.disconnected = True
        if noticed:
            self.mount.metrics.count("disconnects")
        self.abort()

    def abort(self) -> None:
        """Cancel the generation; the stream is closed and the gate left on a helper thread."""
        with self._lock:
            if self._released or self._aborting:
                return
            self._aborting = True
            in_flight = self._in_flight
            opening = self._opening
        if in_flight is None and self.stream is None:
            self._release()  # nothing started: nothing can block
            return
        threading.Thread(target=self._abort_blocking, args=(in_flight, opening), name="aner-http-cancel", daemon=True).start()

    def _abort_blocking(self, in_flight: "concurrent.futures.Future | None", opening: bool) -> None:
        try:
            if self.stream is not None:
                # While a piece call holds the stream this only sets its cancel flag, so the call
                # returns within one step; otherwise it ends the stream at once.
                self.stream.cancel()
            if in_flight is not None:
                concurrent.futures.wait([in_flight])
                if self.stream is None and opening and not in_flight.cancelled() and in_flight.exception() is None:
                    self.stream = in_flight.result()  # opened just as the request was given up
        finally:
            self._release()

    def _release(self) -> None:
        """End the stream if it still runs, then leave the gate (once)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        try:
            if self.stream is not None and not self.stream.done:
                self.stream.cancel()  # no call in flight now: closes the stream and frees its sequence
        finally:
            self.mount.gate.leave()
            self.mount._track(self, False)
            self._closed.set_result(None)


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) answer was ready; the generation was cancelled."""
