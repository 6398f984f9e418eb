"""A streamed request: an iterator of verified text pieces with a final Response.

The stream owns its request's resources until it ends: exhausted, cancelled,
interrupted (KeyboardInterrupt), or garbage collected without being finished.
Each end runs the owner's ``done`` callback exactly once.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Generator, Iterator

from .output import OutputFormat
from .response import Response
from .runner import Job

__all__ = ["Stream"]


class _Driver:
    """The part of a stream the finalizer may touch (no reference to the Stream)."""

    def __init__(self, gen: Generator[str, None, Response], job: Job, done: Callable[[bool], None]) -> None:
        self.gen = gen
        self.job = job
        self._done = done
        self._done_called = False
        self.lock = threading.Lock()  # held while the generator runs

    def finish(self, ok: bool) -> None:
        if not self._done_called:
            self._done_called = True
            self._done(ok)

    def abandon(self) -> None:
        """Close an unfinished generator (it records a cancelled response) and release."""
        if self._done_called:
            return
        self.job.cancel.set()
        try:
            self.gen.close()
        finally:
            self.finish(False)


class Stream(Iterator[str]):
    """Iterate for text pieces; ``response`` is set once the stream has ended.

    ``cancel()`` may be called from any thread: a running step finishes, then
    the stream ends with ``finish_reason="cancelled"``. A KeyboardInterrupt
    while iterating ends it the same way and is re-raised.
    """

    def __init__(self, gen: Generator[str, None, Response], job: Job, done: Callable[[bool], None]) -> None:
        self._driver = _Driver(gen, job, done)
        self._pieces: list[str] = []
        self._finalizer = weakref.finalize(self, self._driver.abandon)

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        d = self._driver
        with d.lock:
            if d._done_called:
                raise StopIteration
            try:
                piece = next(d.gen)
            except StopIteration as stop:
                d.job.result = stop.value
                d.finish(True)
                raise StopIteration from None
            except BaseException:
                d.finish(False)
                raise
        self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """Text received so far."""
        return "".join(self._pieces)

    @property
    def response(self) -> Response | None:
        return self._driver.job.result

    @property
    def output_format(self) -> OutputFormat:
        """How this request's text splits into content, reasoning and tool calls (for a consumer that
        shows them apart while it streams: :class:`~aner_nb.llm.output.OutputSplitter`)."""
        return self._driver.job.output

    @property
    def done(self) -> bool:
        return self._driver._done_called

    def cancel(self) -> None:
        """Ask the stream to end; ends it at once when no step is running."""
        d = self._driver
        d.job.cancel.set()
        if d.lock.acquire(blocking=False):
            try:
                d.abandon()
            finally:
                d.lock.release()

    def close(self) -> None:
        self.cancel()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "done" if self.done else "running"
        return f"<Stream {state}, {len(self._pieces)} pieces>"
