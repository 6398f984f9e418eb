"""The disk tier's background writer: order, replacement, serving queued entries, the byte bound,
failures counted on the caller's callback, flush and close (pure Python, no model)."""

from __future__ import annotations

import os
import threading

import pytest

from aner_nb.llm.disk_writer import WRITER_NICE, DiskWriter


class Recorder:
    def __init__(self, gate: threading.Event | None = None, fail: set | None = None) -> None:
        self.gate = gate
        self.fail = fail or set()
        self.written: list[tuple[tuple[int, ...], bytes]] = []
        self.done: list[tuple[tuple[int, ...], object, int]] = []
        self.threads: set[int] = set()

    def write(self, tokens, blob):
        self.threads.add(threading.get_native_id())
        if self.gate is not None:
            assert self.gate.wait(30)
        if tokens in self.fail:
            raise OSError(28, "No space left on device")
        self.written.append((tokens, blob))
        return len(blob)

    def report(self, tokens, blob, error, n):
        self.done.append((tokens, error, n))


def test_writes_happen_in_order_off_the_callers_thread_and_flush_waits():
    rec = Recorder()
    w = DiskWriter(rec.write, rec.report)
    for i in range(5):
        w.submit((i,), bytes([i]) * 10)
    assert w.flush(timeout=30)
    assert [t for t, _ in rec.written] == [(i,) for i in range(5)]
    assert [(t, e, n) for t, e, n in rec.done] == [((i,), None, 10) for i in range(5)]
    assert threading.get_native_id() not in rec.threads
    w.close()


def test_a_queued_entry_is_servable_and_a_resubmit_replaces_it():
    gate = threading.Event()
    rec = Recorder(gate)
    w = DiskWriter(rec.write, rec.report)
    w.submit((1,), b"first")  # taken by the thread, which waits at the gate
    w.submit((2,), b"old")
    w.submit((2,), b"new")
    assert w.pending((1,)) == b"first" and w.pending((2,)) == b"new" and w.pending((3,)) is None
    assert set(w.pending_keys()) == {(1,), (2,)} and w.queued_bytes == len(b"first") + len(b"new")
    assert not w.flush(timeout=0.05)
    gate.set()
    assert w.flush(timeout=30)
    assert rec.written == [((1,), b"first"), ((2,), b"new")] and w.pending((2,)) is None and w.queued_bytes == 0
    w.close()


def test_the_queue_bound_makes_a_submitter_wait():
    gate = threading.Event()
    rec = Recorder(gate)
    w = DiskWriter(rec.write, rec.report, max_queue_bytes=100)
    w.submit((0,), b"a" * 60)  # being written (held at the gate)
    w.submit((1,), b"b" * 60)  # queued: 60 of 100
    entered = threading.Event()
    finished = threading.Event()

    def third():
        entered.set()
        w.submit((2,), b"c" * 60)  # 120 > 100: waits for room
        finished.set()

    t = threading.Thread(target=third)
    t.start()
    assert entered.wait(10) and not finished.wait(0.2)
    gate.set()
    assert finished.wait(30)
    t.join()
    assert w.flush(timeout=30) and [k for k, _ in rec.written] == [(0,), (1,), (2,)]
    w.close()


def test_a_failed_write_is_reported_and_the_thread_goes_on():
    rec = Recorder(fail={(1,)})
    w = DiskWriter(rec.write, rec.report)
    for i in range(3):
        w.submit((i,), b"x")
    assert w.flush(timeout=30)
    errors = {t: e for t, e, _ in rec.done}
    assert isinstance(errors[(1,)], OSError) and errors[(0,)] is None and errors[(2,)] is None
    w.close()


def test_close_finishes_accepted_writes_and_later_ones_run_inline():
    gate = threading.Event()
    rec = Recorder(gate)
    w = DiskWriter(rec.write, rec.report)
    w.submit((1,), b"x")
    w.submit((2,), b"y")
    threading.Timer(0.2, gate.set).start()
    w.close()
    assert [k for k, _ in rec.written] == [(1,), (2,)]
    w.submit((3,), b"z")  # after close: on the caller's thread
    assert rec.written[-1] == ((3,), b"z") and threading.get_native_id() in rec.threads
    w.close()


@pytest.mark.skipif(not hasattr(os, "getpriority") or os.uname().sysname != "Linux", reason="per-thread nice is Linux's")
def test_the_writer_thread_runs_at_a_lower_priority():
    seen = {}

    def write(tokens, blob):
        tid = threading.get_native_id()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        return len(blob)

    w = DiskWriter(write, lambda *a: None)
    w.submit((1,), b"x")
    assert w.flush(timeout=30)
    w.close()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen["nice"] == min(mine + WRITER_NICE, 19)
