"""The lifetime of a lease: open or closed, its one active request, and its native resources.

A lease acquires its resources in order (a hold on the weights, the adapter,
its contexts or scheduler) and pushes each release on one
:class:`contextlib.ExitStack` right after acquiring it. Releasing unwinds the
stack once, in reverse order, so a half-built lease (a failure in its
constructor) frees exactly what it had taken, and a finished one frees its
contexts before the adapter they apply and the adapter before the weights.
A ``weakref.finalize`` on the lease runs the same release when the lease
becomes unreachable (``del``, ``%reset``, a failed cell), as llama-cpp-python's
``_internals.py`` does for its model and context wrappers, without ``__del__``.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

from .errors import BusyError, ClosedError

__all__ = ["Lifetime"]


class Lifetime:
    """Open/closed state, the single active request of an exclusive lease, and the resource stack.

    ``exclusive`` leases (ordinary, latency, adapter, session) run one request
    at a time: a second ``begin`` is a :class:`BusyError`. Closing while a
    request runs lets it finish; its ``end`` then releases.
    """

    def __init__(self, noun: str, *, exclusive: bool = True, busy_advice: str = "") -> None:
        self.noun = noun
        self.exclusive = exclusive
        self.busy_advice = busy_advice
        self.stack = ExitStack()
        self._lock = threading.Lock()
        self._closed = False
        self._active = False
        self._released = False

    @contextmanager
    def building(self, *holds: Any) -> Iterator[ExitStack]:
        """Acquire resources inside this block; on any failure everything pushed so far is released.

        ``holds`` (the shared weights, an adapter; None is skipped) are retained first, so they are
        released last, after every context that uses them.
        """
        try:
            for hold in holds:
                if hold is not None:
                    hold.retain()
                    self.stack.callback(hold.release)
            yield self.stack
        except BaseException:
            self.release()
            raise

    def watch(self, owner: Any) -> weakref.finalize:
        """Release when ``owner`` is collected, or at interpreter exit."""
        finalizer = weakref.finalize(owner, self.release)
        finalizer.atexit = True
        return finalizer

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"this {self.noun} is closed; {what} is not accepted (load or derive a new lease)")

    def begin(self, what: str) -> None:
        """A request starts: refused when closed, or (exclusive leases) while another one runs."""
        with self._lock:
            self.check_open(what)
            if self.exclusive:
                if self._active:
                    raise BusyError(
                        f"this {self.noun} is already running a request; {what} was rejected{self.busy_advice}"
                    )
                self._active = True

    def end(self) -> None:
        """The request ended; a lease closed meanwhile is released now."""
        with self._lock:
            self._active = False
            release = self._closed
        if release:
            self.release()

    def close(self) -> None:
        """Refuse new requests; release now unless a request is running."""
        with self._lock:
            self._closed = True
            release = not self._active
        if release:
            self.release()

    def release(self) -> None:
        """Unwind the resource stack, once."""
        with self._lock:
            if self._released:
                return
            self._released = self._closed = True
        self.stack.close()
