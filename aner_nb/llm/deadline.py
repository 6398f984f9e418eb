"""A time bound for untrusted Python-level work on the calling thread (chat templates).

Jinja compiles a template to Python bytecode, so a hostile or broken
template (nested loops, runaway macros) is a CPU loop in the caller's
thread: a kernel cell or an HTTP worker that never returns. Nothing in
Jinja's sandbox bounds time. :func:`within` arms a deadline that, once
passed, raises :class:`DeadlineExceeded` *in the calling thread* with
``PyThreadState_SetAsyncExc`` (CPython delivers it at the next bytecode
boundary, so pure-Python loops stop; a single long C call finishes first,
which the sandbox's own size limits keep short). A lock and a ``done`` flag
per call make sure the exception is only ever delivered while the bounded
call is still running, and a pending one is withdrawn if the call ended first.

Every deadline in the process is watched by one daemon thread, started on
first use. A thread per call (``threading.Timer``) cost ~0.75 ms per render
on a two-core machine while the engine's threads were busy, and a request
renders its template two to four times.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import os
import threading
import time
from typing import Callable, TypeVar

__all__ = ["DeadlineExceeded", "within"]

T = TypeVar("T")


class DeadlineExceeded(Exception):
    """The bounded call ran past its deadline (raised inside it, asynchronously)."""


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> int:
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else ctypes.c_void_p(0)
    )


class _Bound:
    """One bounded call: its thread, and whether it ended (``done``) or its deadline was delivered (``fired``)."""

    __slots__ = ("target", "lock", "done", "fired")

    def __init__(self) -> None:
        self.target = threading.get_ident()
        self.lock = threading.Lock()
        self.done = False
        self.fired = False

    def expire(self) -> None:
        with self.lock:
            if not self.done:
                self.fired = True
                _set_async_exc(self.target, DeadlineExceeded)

    def finish(self) -> None:
        with self.lock:
            self.done = True
            if self.fired:
                _set_async_exc(self.target, None)  # withdraw one not yet delivered


class _Watchdog:
    """The deadlines of every bounded call in the process, earliest first, and the one thread that delivers them.

    A finished call's entry is not searched for; it leaves the heap when it
    reaches the top (so the heap holds at most the calls of one bound's span).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Bound]] = []
        self._serial = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, bound: _Bound, seconds: float) -> None:
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._serial), bound))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="aner-nb-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is bound:
                self._cond.notify()  # an earlier deadline than the one the thread sleeps until

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)[2].expire()

    def forget(self) -> None:
        """After ``fork``: the child has no watchdog thread, and the parent's calls are not its own."""
        self._cond = threading.Condition()
        self._heap = []
        self._thread = None


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG.forget)


def within(seconds: float, call: Callable[[], T]) -> T:
    """``call()``, or :class:`DeadlineExceeded` once it has run for ``seconds``."""
    bound = _Bound()
    try:
        try:
            # Armed inside the try: a KeyboardInterrupt that lands while the deadline is armed must
            # still mark the call done, or it would fire later into whatever this thread runs then
            # (seen: a Ctrl-C between two rows of a map).
            _WATCHDOG.arm(bound, seconds)
            return call()
        finally:
            bound.finish()
    except DeadlineExceeded:
        raise DeadlineExceeded(f"stopped after {seconds:g} s") from None
