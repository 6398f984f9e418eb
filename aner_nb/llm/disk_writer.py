"""The disk tier's background writer: state files leave the request's thread, at low OS priority.

Writing a retained prefix through to disk is ~40 MB per request (125 ms with an
fsync on the machine this was measured on; the tier's files now skip it,
``kv_identity.write_cache_file``): on the request's thread that is
what a notebook user would wait for, and it is all the tiers cost when no
prompt is ever reused. The request serialises the sequence (it must: the
context is reused next) and hands the packed bytes here; one daemon thread
writes them in order, at a raised nice value on Linux (per-thread there), so
the write does not compete with the decode threads for a core. A write still
in the queue can be served (:meth:`DiskWriter.pending`), the queue is bounded
in bytes (a caller waits when the disk falls that far behind), and
:meth:`DiskWriter.flush` / :meth:`DiskWriter.close` wait until every accepted
write is on disk — a lease's close, so the next process finds the files.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Callable

__all__ = ["DiskWriter", "DEFAULT_QUEUE_BYTES", "WRITER_NICE"]

log = logging.getLogger(__name__)

DEFAULT_QUEUE_BYTES = 512 << 20
WRITER_NICE = 10  # added to the process's nice value for the writer thread (Linux: threads have their own)

Key = tuple[int, ...]


class DiskWriter:
    """Writes ``(tokens, blob)`` pairs with ``write(tokens, blob)`` on one background thread, in order.

    ``write`` is the disk tier's own (atomic file write, budget enforcement);
    ``done(tokens, blob, error)`` is called on the writer thread after each one
    (``error`` the ``OSError`` it raised, or None) so the caller's counters stay
    in one place. A later submit of the same tokens replaces a queued one.
    """

    def __init__(
        self,
        write: Callable[[Key, bytes], int],
        done: Callable[[Key, bytes, "OSError | None", int], None],
        *,
        max_queue_bytes: int = DEFAULT_QUEUE_BYTES,
        name: str = "aner-nb-prefix-writer",
    ) -> None:
        self._write = write
        self._done = done
        self.max_queue_bytes = max_queue_bytes
        self._queue: OrderedDict[Key, bytes] = OrderedDict()
        self._queued_bytes = 0
        self._busy: tuple[Key, bytes] | None = None  # the write in progress, still servable
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the caller's side -------------------------------------------------------
    def submit(self, tokens: Key, blob: bytes) -> None:
        """Queue ``blob`` for ``tokens``; waits while the queue holds more than its byte bound.

        A blob alone larger than the bound is still accepted (the queue is then
        that one blob). After :meth:`close`, the write happens on the caller's thread.
        """
        with self._cond:
            if self._closed:
                inline = True
            else:
                inline = False
                while self._queue and self._queued_bytes + len(blob) > self.max_queue_bytes and not self._closed:
                    self._cond.wait()
                old = self._queue.pop(tokens, None)
                if old is not None:
                    self._queued_bytes -= len(old)
                self._queue[tokens] = blob
                self._queued_bytes += len(blob)
                self._cond.notify_all()
        if inline:
            self._write_one(tokens, blob)

    def pending(self, tokens: Key) -> bytes | None:
        """The queued (or being written) blob for exactly ``tokens``, or None."""
        with self._cond:
            if self._busy is not None and self._busy[0] == tokens:
                return self._busy[1]
            return self._queue.get(tokens)

    def pending_keys(self) -> list[Key]:
        """Every token tuple queued or being written, oldest first."""
        with self._cond:
            return ([self._busy[0]] if self._busy is not None else []) + list(self._queue)

    @property
    def queued_bytes(self) -> int:
        with self._cond:
            return self._queued_bytes + (len(self._busy[1]) if self._busy is not None else 0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted write has finished; False if ``timeout`` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._busy is None, timeout)

    def close(self) -> None:
        """Finish every accepted write, then stop the thread (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # -- the writer thread ---------------------------------------------------------
    def _run(self) -> None:
        _lower_priority()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:  # closed and drained
                    return
                tokens, blob = self._queue.popitem(last=False)
                self._queued_bytes -= len(blob)
                self._busy = (tokens, blob)
                self._cond.notify_all()  # room in the queue
            try:
                self._write_one(tokens, blob)
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    def _write_one(self, tokens: Key, blob: bytes) -> None:
        try:
            n = self._write(tokens, blob)
        except OSError as exc:
            self._done(tokens, blob, exc, 0)
        except Exception as exc:  # never let the thread die: the next write may succeed
            log.warning("prefix tier: the disk writer failed on %d tokens: %r", len(tokens), exc)
            self._done(tokens, blob, OSError(str(exc)), 0)
        else:
            self._done(tokens, blob, None, n)


def _lower_priority() -> None:
    """Raise this thread's nice value (Linux gives each thread its own; elsewhere it is left alone)."""
    if not hasattr(os, "setpriority") or not os.uname().sysname == "Linux":
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE)
    except OSError:  # not permitted, or a kernel without per-thread nice
        pass
