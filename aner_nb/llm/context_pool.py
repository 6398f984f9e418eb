"""Idle contexts of one lease, so consecutive requests skip context creation.

A context never moves between leases: each lease's pool is built from that
lease's own parameters. An ordinary pool hands out empty contexts (cleared
on acquire, with the time it took), so no request sees another's KV.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ._engine import Batch, ContextParams, NativeContext, NativeModel

__all__ = ["ContextSlot", "ContextPool"]


@dataclass
class ContextSlot:
    """A context with the batch used to feed it."""

    ctx: NativeContext
    batch: Batch

    def free(self) -> None:
        self.ctx.free()
        self.batch.free()


class ContextPool:
    """At most ``max_idle`` idle contexts; contexts in use are owned by their request."""

    def __init__(self, model: NativeModel, params: ContextParams, max_idle: int) -> None:
        self.model = model
        self.params = params
        self.max_idle = max_idle
        self._idle: list[ContextSlot] = []
        self._lock = threading.Lock()
        self._closed = False
        self.created = 0

    def acquire(self) -> tuple[ContextSlot, bool, int]:
        """Return (slot, reused, clear_duration_ns); the slot's KV is empty."""
        with self._lock:
            slot = self._idle.pop() if self._idle else None
        if slot is None:
            slot = ContextSlot(NativeContext(self.model, self.params), Batch(self.params.n_batch, self.params.n_seq_max))
            self.created += 1
            return slot, False, -1
        t0 = time.perf_counter_ns()
        slot.ctx.clear()
        return slot, True, time.perf_counter_ns() - t0

    def give_back(self, slot: ContextSlot, *, reusable: bool) -> None:
        """Keep the slot for the next request if there is room, else free it now."""
        with self._lock:
            keep = reusable and not self._closed and len(self._idle) < self.max_idle and slot.ctx.alive
            if keep:
                self._idle.append(slot)
        if not keep:
            slot.free()

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for slot in idle:
            slot.free()
