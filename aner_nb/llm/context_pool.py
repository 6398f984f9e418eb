"""Idle contexts of one lease, so consecutive requests skip context creation.

A context never moves between leases: each lease's pool is built from that
lease's own parameters. An ordinary pool hands out empty contexts (cleared
on acquire, with the time it took), so no request sees another's KV.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ._engine import Batch, ContextParams, NativeContext, NativeModel
from .timings import PoolTimings, TimingsPart

__all__ = ["Acquired", "ContextSlot", "ContextPool", "new_slot", "free_all"]


@dataclass
class ContextSlot:
    """A context with the batch used to feed it."""

    ctx: NativeContext
    batch: Batch

    def free(self) -> None:
        free_all([self.ctx, self.batch])


def new_slot(model: NativeModel, params: ContextParams) -> ContextSlot:
    """A fresh context and its batch; the context is freed again if the batch cannot be made."""
    ctx = NativeContext(model, params)
    try:
        return ContextSlot(ctx, Batch(params.n_batch, params.n_seq_max))
    except BaseException:
        ctx.free()
        raise


def free_all(owners: Sequence[Any]) -> None:
    """Free every one of ``owners`` (contexts, batches, slots) even if freeing one raises; then re-raise the first error.

    A Ctrl-C or a failing free must not leave the rest to the garbage collector.
    """
    error: BaseException | None = None
    for owner in owners:
        try:
            owner.free()
        except BaseException as exc:  # noqa: BLE001 - re-raised below once the rest are freed
            error = error or exc
    if error is not None:
        raise error


@dataclass
class Acquired:
    """A context handed to one request: ``n_cached`` prompt tokens already in its KV.

    ``logits``: the prompt's last row, when a stored entry restored the whole
    prompt (``n_cached`` is then its length; see :mod:`aner_nb.llm.prefix_store`).
    """

    slot: ContextSlot
    n_cached: int
    timings: tuple[TimingsPart, ...]
    logits: Any = None


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

    def acquire(self, prompt: Sequence[int] = ()) -> Acquired:
        """An empty context: a retained idle one (cleared, timed) or a new one."""
        with self._lock:
            slot = self._idle.pop() if self._idle else None
        if slot is None:
            slot = new_slot(self.model, self.params)
            self.created += 1
            return Acquired(slot, 0, (PoolTimings(cached_input_tokens=0, context_pool_reused=0),))
        t0 = time.perf_counter_ns()
        try:
            slot.ctx.clear()
        except BaseException:  # an interrupt here: the slot is neither idle nor handed out
            slot.free()
            raise
        clear = time.perf_counter_ns() - t0
        return Acquired(slot, 0, (PoolTimings(cached_input_tokens=0, context_clear_duration=clear, context_pool_reused=1),))

    def give_back(self, slot: ContextSlot, prompt: Sequence[int] = (), *, outcome: str) -> None:
        """Keep the slot for the next request if there is room, else free it now.

        ``outcome`` is ``"ok"``, ``"cancelled"`` or ``"failed"``. The next
        acquire clears the KV, so a cancelled request's context is reusable;
        after a failure its state is unknown and it is freed.
        """
        with self._lock:
            keep = outcome != "failed" and not self._closed and len(self._idle) < self.max_idle and slot.ctx.alive
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
        free_all(idle)
