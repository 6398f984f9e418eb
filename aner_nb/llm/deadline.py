"""A time bound for untrusted Python-level work on the calling thread (chat templates).

Jinja compiles a template to Python bytecode, so a hostile or broken
template (nested loops, runaway macros) is a CPU loop in the caller's
thread: a kernel cell or an HTTP worker that never returns. Nothing in
Jinja's sandbox bounds time. :func:`within` arms a timer thread that, past
the deadline, raises :class:`DeadlineExceeded` *in the calling thread* with
``PyThreadState_SetAsyncExc`` (CPython delivers it at the next bytecode
boundary, so pure-Python loops stop; a single long C call finishes first,
which the sandbox's own size limits keep short). A lock and a ``done`` flag
make sure the exception is only ever delivered while the bounded call is
still running, and a pending one is withdrawn if the call ended first.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, TypeVar

__all__ = ["DeadlineExceeded", "within"]

T = TypeVar("T")


class DeadlineExceeded(Exception):
    """The bounded call ran past its deadline (raised inside it, asynchronously)."""


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> int:
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else ctypes.c_void_p(0)
    )


def within(seconds: float, call: Callable[[], T]) -> T:
    """``call()``, or :class:`DeadlineExceeded` once it has run for ``seconds``."""
    target = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def expire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _set_async_exc(target, DeadlineExceeded)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    try:
        try:
            # Started inside the try: a KeyboardInterrupt that lands while the timer thread starts
            # must still mark the call done and cancel the timer, or it would fire later into
            # whatever this thread runs then (seen: a Ctrl-C between two rows of a map).
            timer.start()
            return call()
        finally:
            with lock:
                state["done"] = True
                if state["fired"]:
                    _set_async_exc(target, None)  # withdraw one not yet delivered
            timer.cancel()
    except DeadlineExceeded:
        raise DeadlineExceeded(f"stopped after {seconds:g} s") from None
