"""Running library requests from the event loop without blocking it.

Every served model is a :class:`Mount`: its lease, its admission gate and a
worker pool of exactly the gate's size.

Admission has one control, the mount's :class:`Gate`: ``capacity`` requests
(a batching lease's sequences plus its waiting queue, one for an ordinary
lease, or ``max_concurrent``) are in flight at once and the next is answered
503 busy. Behind the gate the batching scheduler is never asked to refuse: a
mount creates its streams one at a time (:meth:`Mount.open_stream`), each
once the scheduler's waiting queue has room. With the gate bounding the
requests that room comes within one scheduler step (only admitted requests
can fill the queue, and only while free sequences wait for the scheduler to
take them). The lease itself refuses (``BusyError``, also 503) only when it
is shared with callers outside this service, or when ``max_concurrent`` is
set above what an ordinary lease runs (one request).

An admitted request becomes a :class:`Generation`: a library
:class:`~aner_nb.llm.Stream` read without a worker thread per piece. A
batching stream's outbox is observed from its creation
(:func:`aner_nb.llm.outbox.observing`): the scheduler thread's every piece
and its end schedule ``loop.call_soon_threadsafe`` on an ``asyncio.Event``,
and the event loop reads the waiting pieces with calls that never wait. Any
other stream (its generation runs in the thread that iterates it) is drained
by one worker call that hands each piece to the loop the same way. So a
request takes at most two worker calls whatever its length: the one that
opens its stream (render, tokenize, submit) and either the drain or the last
read (which ends a batching stream and runs its end callback, which may wait
for the scheduler). The pool never queues.

The gate is left only once the stream has really ended (its sequence freed),
so a cancelled or timed-out request's slot is free before the next request
is admitted against it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable

from ..llm import Lease, Response
from ..llm.outbox import Outbox, observing
from .metrics import ModelMetrics, ServiceMetrics

__all__ = ["Gate", "Mount", "Generation", "RequestTimeout", "ClientGone", "capacity_of"]

_END = object()  # the stream has ended
_NOTHING = object()  # no piece is ready yet
_LAST = object()  # a batching stream's outbox is closed and read: its last read ends the stream (on a worker)
_ABORTED = object()  # the generation is being given up: wait for it to close
ROOM_POLL_S = 0.001  # how often an opening request re-reads the scheduler's queue length while it is full


class RequestTimeout(Exception):
    """The request ran past the service's ``timeout_ms``; its generation was cancelled."""


class _GivenUp(Exception):
    """The generation was given up while its stream waited for the scheduler's queue to have room."""


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
        stats = model.stats()
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
        self._submitting = threading.Lock()  # one stream created at a time, so the queue's room is not raced

    @property
    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The worker threads, created on first use (``asgi()`` may run without a lifespan)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.capacity, thread_name_prefix=f"aner-http-{self.name}"[:40]
                )
                _start_every_worker(self._pool, self.capacity)
            return self._pool

    def stats(self) -> Any:
        """The batching scheduler's snapshot (a SchedulerStats), or None for a lease without one."""
        return self.model.stats() if self.batching else None

    def open_stream(self, start: Callable[[], Any], observer: Callable[[Outbox], Any],
                    given_up: Callable[[], bool] = lambda: False) -> Any:
        """Run ``start`` (it creates a stream) on this worker thread, with ``observer`` seeing its outbox.

        On a batching lease streams are created one at a time and only once
        the scheduler's waiting queue has room, so the scheduler never refuses
        what the gate admitted; ``given_up`` ends the wait (the request timed
        out or its client left).
        """
        with observing(observer):
            if not self.batching:
                return start()
            with self._submitting:
                while not self._queue_has_room():
                    if given_up():
                        raise _GivenUp()
                    time.sleep(ROOM_POLL_S)  # a full queue empties at the scheduler's next step
                return start()

    def _queue_has_room(self) -> bool:
        stats = self.model.stats()
        return stats.waiting < stats.queue_limit or stats.closed or not stats.running

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


def _start_every_worker(pool: concurrent.futures.ThreadPoolExecutor, workers: int) -> None:
    """Start all ``workers`` threads now, so the process's thread count is fixed from the first request.

    A ``ThreadPoolExecutor`` starts a thread only when every started one is busy, so without this the
    count creeps up to the bound whenever a burst first reaches it, which a leak check (the soak)
    cannot tell from a leak. Each task waits on one barrier with the caller, so each submit finds every
    started thread busy and starts another.
    """
    barrier = threading.Barrier(workers + 1)
    for _ in range(workers):
        pool.submit(barrier.wait, 30)
    barrier.wait(30)


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


def _retrieved(future: "asyncio.Future") -> None:
    """Mark a future's outcome as seen, so asyncio does not log an exception nobody waits for."""
    if not future.cancelled():
        future.exception()


class _Failed:
    """The drained stream raised ``error``: it is raised where the loop reads it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Generation:
    """One admitted request: its stream, read on the event loop as its pieces arrive.

    ``abort()`` (thread safe, never blocks the caller) cancels the stream: a
    short-lived thread asks the library to stop, waits for any worker call in
    flight and any read of the loop, closes the stream (freeing its sequence)
    and leaves the gate, exactly once. ``wait_closed()`` resolves when that
    has happened.
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
        self._ready = asyncio.Event()  # something to read may have arrived (set on the loop)
        self._outboxes: list[Outbox] = []  # the stream's outbox, when the lease batches
        self._drained: collections.deque[Any] = collections.deque()  # pieces the drain handed over
        self._drain: concurrent.futures.Future | None = None
        self._reading = threading.Lock()  # held while the loop reads the outbox (never waits)

    async def open(self, start: Callable[[], Any]) -> None:
        """Create the stream on a worker (render, tokenize, submit); library errors propagate."""
        self.mount._track(self, True)
        self._opening = True
        try:
            opened = asyncio.wrap_future(self._submit(self.mount.open_stream, start, self._observe, self._given_up))
            await self._until(opened, None)
            with self._lock:  # in one step, so that abort() sees the open call or the stream, never neither
                self._in_flight = None
                if opened.exception() is None:
                    self.stream = opened.result()
            opened.result()  # the library's error, if any, is raised here
            if len(self._outboxes) != 1:  # no scheduler behind it: one worker call drains it
                self._drain = self._submit(self._drain_stream)
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
                piece = await self._next(watch)
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

    # -- reading --------------------------------------------------------------------------
    async def _next(self, watch: "asyncio.Future | None") -> Any:
        """The next piece, or ``_END``; waits on the loop (not on a worker) until one is ready."""
        while True:
            item = self._take()
            if item is _NOTHING:
                self._ready.clear()
                item = self._take()  # what arrived before the clear is seen here, what arrives after sets it
            if item is _LAST:
                return await self._call(_next_piece, self.stream, watch=watch)
            if item is _ABORTED:
                await self.wait_closed()
                return _END
            if item is not _NOTHING:
                return item
            waiter = asyncio.ensure_future(self._ready.wait())
            try:
                await self._until(waiter, watch)
            finally:
                waiter.cancel()

    def _take(self) -> Any:
        """What is ready now, without waiting: a piece, ``_END``, ``_LAST``, ``_ABORTED`` or ``_NOTHING``."""
        if self._drain is not None:
            if not self._drained:
                return _NOTHING
            item = self._drained.popleft()
            if isinstance(item, _Failed):
                raise item.error
            return item
        outbox = self._outboxes[0]
        if self._aborting or not self._reading.acquire(blocking=False):
            return _ABORTED
        try:
            if self.stream.done:
                return _END
            if outbox.pending():
                # The piece is in the outbox: this read takes it without waiting (and may wake the
                # scheduler, whose lock is never held across a decode step).
                return _next_piece(self.stream)
            return _LAST if outbox.ready() else _NOTHING
        finally:
            self._reading.release()

    def _observe(self, outbox: Outbox) -> Callable[[], None]:
        """The outbox observer (on the opening worker): remember it; its pieces wake the loop.

        The outbox holds its wake-up weakly: the library's request (and through its end callback the
        stream's finalizer, which the finalizer registry holds) reaches the outbox, so a strong
        reference back to this generation would keep it and its stream alive for ever.
        """
        self._outboxes.append(outbox)
        wake = weakref.WeakMethod(self._wake)

        def notify() -> None:
            method = wake()
            if method is not None:
                method()

        return notify

    def _wake(self) -> None:
        """Any thread: something may be ready to read."""
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the loop has closed: nobody reads any more
            pass

    def _drain_stream(self) -> None:
        """On one worker: iterate a stream that generates in its caller's thread, handing pieces to the loop."""
        try:
            for piece in self.stream:
                self._hand(piece)
            self._hand(_END)
        except BaseException as exc:  # noqa: BLE001 - raised on the loop, where the request reads it
            self._hand(_Failed(exc))

    def _hand(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self._arrived, item)
        except RuntimeError:  # the loop has closed
            pass

    def _arrived(self, item: Any) -> None:
        self._drained.append(item)
        self._ready.set()

    # -- worker calls, deadline, disconnect ---------------------------------------------------
    def _submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future = self.mount.pool.submit(fn, *args)
        with self._lock:
            self._in_flight = future
        return future

    async def _call(self, fn: Callable[..., Any], *args: Any, watch: "asyncio.Future | None" = None) -> Any:
        future = self._submit(fn, *args)
        wrapped = asyncio.wrap_future(future)
        await self._until(wrapped, watch)
        with self._lock:
            self._in_flight = None
        return wrapped.result()  # the library's error, if any, is raised here

    async def _until(self, awaited: "asyncio.Future", watch: "asyncio.Future | None") -> None:
        """Return once ``awaited`` is done; raise ClientGone or RequestTimeout (generation given up) first."""
        waiting = {awaited} if watch is None else {awaited, watch}
        remaining = max(self.deadline - self.loop.time(), 0.0)
        done, _ = await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        if awaited in done:
            return
        awaited.add_done_callback(_retrieved)  # left behind: its outcome (an error, say) is nobody's now
        if watch is not None and watch in done:
            self.client_gone()
            raise ClientGone()
        self.timed_out = True
        self.mount.metrics.count("timeouts")
        self.abort()
        await self.wait_closed()
        raise RequestTimeout()

    def _given_up(self) -> bool:
        return self._aborting

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
            stream = self.stream
        if in_flight is None and stream is None:
            self._release()  # nothing started: nothing can block
            return
        threading.Thread(target=self._abort_blocking, args=(in_flight, opening), name="aner-http-cancel", daemon=True).start()

    def _abort_blocking(self, in_flight: "concurrent.futures.Future | None", opening: bool) -> None:
        try:
            with self._reading:  # the loop's reads never wait, so this waits at most for one of them
                if self.stream is not None:
                    # While a worker call holds the stream this only sets its cancel flag, so the call
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
            self._wake()  # a reader waiting for pieces sees the generation has ended


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) answer was ready; the generation was cancelled."""
