"""The caller's side of a batched request: its handle (:class:`Request`) and its stream's :class:`Outbox`.

Both are thread safe. The scheduler thread fills an outbox and ends a
request; callers wait, read, cancel and take the result. A request's state
lives in its :class:`~aner_nb.llm.sequence.SequenceState`; the handle reports
from it.

A consumer that cannot block (an event loop) learns of its outboxes with
:func:`observing`: an outbox created while it is active (in that thread or
context) is passed to the observer, whose returned callable then runs on the
scheduler thread each time a piece arrives or the outbox closes; the consumer
reads with ``ready()`` and a non-waiting ``get()``.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from .response import Response
from .runner import Job
from .sequence import Phase, SequenceState

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["Outbox", "Request", "POLL_S", "observing"]

POLL_S = 0.25  # waits re-check their condition at this period (Ctrl-C stays responsive on every OS)

Observer = Callable[["Outbox"], Optional[Callable[[], None]]]
# Per context, not per process: a worker thread sets it around one call that creates a stream.
_observer: contextvars.ContextVar[Optional[Observer]] = contextvars.ContextVar("aner_outbox_observer", default=None)


@contextlib.contextmanager
def observing(observer: Observer) -> Iterator[None]:
    """Pass every outbox created inside this block (this context) to ``observer``.

    ``observer(outbox)`` returns a callable (or None) that the outbox then
    calls after each ``put`` and on ``close``, on the scheduler thread,
    outside its lock: it must be quick and must not block (e.g. an event
    loop's ``call_soon_threadsafe``).
    """
    token = _observer.set(observer)
    try:
        yield
    finally:
        _observer.reset(token)


class Outbox:
    """Text pieces of one streamed request on their way to its consumer.

    Bounded: the scheduler feeds the sequence another token only while there
    is room, so a slow consumer pauses its own sequence and nobody else's.
    """

    def __init__(self, capacity: int, wake: Callable[[], None], guard: Callable[[str], None]) -> None:
        self.capacity = capacity
        self._items: collections.deque[str] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._wake = wake
        self._guard = guard
        observer = _observer.get()
        self._on_ready: Optional[Callable[[], None]] = observer(self) if observer is not None else None

    def has_room(self) -> bool:
        with self._cv:
            return len(self._items) < self.capacity

    def ready(self) -> bool:
        """A piece is waiting or the request has ended: ``get()`` returns without waiting."""
        with self._cv:
            return bool(self._items) or self._closed

    def pending(self) -> int:
        """Pieces waiting to be read."""
        with self._cv:
            return len(self._items)

    def put(self, piece: str) -> None:
        """Scheduler side; never blocks (the scheduler checked ``has_room``)."""
        with self._cv:
            self._items.append(piece)
            self._cv.notify_all()
        if self._on_ready is not None:
            self._on_ready()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        on_ready, self._on_ready = self._on_ready, None  # the last notice: let go of the consumer
        if on_ready is not None:
            on_ready()

    def get(self) -> str | None:
        """Consumer side: the next piece, or None once the request has ended."""
        self._guard("reading a stream")
        with self._cv:
            while not self._items and not self._closed:
                self._cv.wait(POLL_S)
            if not self._items:
                return None
            was_full = len(self._items) >= self.capacity
            piece = self._items.popleft()
        if was_full:
            self._wake()  # the scheduler may resume this sequence
        return piece


class Request:
    """One submitted request as its caller sees it: wait for it, cancel it, take its result.

    Thread safe. What it reports (``finished``, ``error``, ``phase``) is read
    off its :class:`SequenceState`, which the scheduler thread alone advances.
    """

    def __init__(self, job: Job, *, outbox: Outbox | None = None, on_text: Callable[[str], None] | None = None) -> None:
        self.sequence = SequenceState(job, outbox=outbox, on_text=on_text)
        self._scheduler: "Scheduler | None" = None

    @property
    def job(self) -> Job:
        return self.sequence.job

    @property
    def outbox(self) -> Outbox | None:
        return self.sequence.outbox

    @property
    def finished(self) -> threading.Event:
        """Set once the request has ended (finished, cancelled or failed)."""
        return self.sequence.ended

    @property
    def error(self) -> BaseException | None:
        """The error that failed the request, or None."""
        return self.sequence.error

    @property
    def phase(self) -> Phase:
        return self.sequence.phase

    def __repr__(self) -> str:
        return f"<Request {self.phase.value}>"

    def cancel(self) -> None:
        """Ask the scheduler to end this request with ``finish_reason="cancelled"``."""
        self.job.cancel.set()
        if self._scheduler is not None:
            self._scheduler.wake()

    def wait(self) -> None:
        """Block until the request has ended (finished, cancelled or failed)."""
        while not self.finished.wait(POLL_S):
            pass

    def settle(self, ok: bool) -> None:
        """A stream's end callback: an unfinished request is cancelled and awaited."""
        if ok or self.finished.is_set():
            return
        self.cancel()
        if self._scheduler is not None and not self._scheduler.on_scheduler_thread():
            self.wait()

    def result(self) -> Response:
        """The Response, or the error that failed the request."""
        if self.error is not None:
            raise self.error
        assert self.job.result is not None
        return self.job.result
