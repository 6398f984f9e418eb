"""Batching monitor: a live view of a continuous-batching lease, and per-request latencies.

Serving protocol (what the monitor needs from a batching lease)
---------------------------------------------------------------
``serving.stats()`` returns a *snapshot*: an immutable object (a frozen
dataclass or namedtuple) or a mapping, with integer fields

* ``active_sequences``: sequences decoding in the shared context now;
* ``queue_length``: requests accepted and waiting for a slot;
* ``scheduler_steps``: scheduler steps (one ``llama_decode`` each) since the lease was built;
* ``decoded_tokens``: tokens sampled by the scheduler since the lease was built;

and optionally ``max_sequences``, ``queue_capacity`` (8 by the contract),
``completed_requests`` (ints; ``-1`` = unknown) and ``closed`` (bool: the
monitor stops polling once it is true). These names are the ``monitor``
metadata of the fields of :class:`aner_nb.llm.scheduler.SchedulerStats`, and
that class's own field names are accepted too (``STATS_ALIASES``:
``active``, ``waiting``, ``steps``, ``queue_limit``, ``completed``). A batching
lease's ``stats()`` is that class; a snapshot of another serving object is
read once, on arrival, into a :class:`MonitorSnapshot` (whose fields are the
protocol's names, checked against that metadata at import), and the monitor
reads only its attributes from then on. ``stats()`` must be callable from
any thread at any time, cheap (no engine call), and consistent: take the
numbers together under the scheduler's own lock, never from a half-finished
step. A closed lease should still answer (``closed=True``); if ``stats()``
raises, the monitor shows the error and stops. Optionally the scheduler may
call ``monitor.push(snapshot)`` after each step instead of being polled; the
monitor only stores it and wakes its refresher.
``serving.generate_many(prompts, **kwargs) -> list[Response]`` is used by
:meth:`BatchingMonitor.generate_many`, which records the per-request
latency table afterwards.

Thread model
------------
Widget traits are mutated by exactly two parties, always under one lock: the
monitor's own refresher thread and the thread that calls the monitor's
methods (the kernel thread). This is the pattern of the ipywidgets
documentation "Asynchronous Widgets: updating a widget in the background"
(a background thread sets widget values; ipykernel forwards comm messages
through its IOPub thread), with updates throttled to one per ``interval``.
Polling from the monitor's own thread, rather than scheduling on the kernel's
event loop, is what keeps the view live while the kernel thread is blocked in
``generate_many``. The scheduler thread never touches a widget: it only
answers ``stats()`` or calls ``push()``. The monitor holds the serving
object through a weak reference, so it never keeps a lease's native memory
alive; the refresher stops when the lease is collected or reports ``closed``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from ..llm.protocol import Lease
from ..llm.scheduler_stats import SchedulerStats, stat_fields
from ._static import StaticView, fmt_count, fmt_float, frame_html, html_table, measured
from .timings import as_responses

__all__ = [
    "STATS_FIELDS",
    "OPTIONAL_STATS_FIELDS",
    "STATS_ALIASES",
    "MonitorSnapshot",
    "Serving",
    "read_stats",
    "latency_frame",
    "BatchingMonitor",
    "batching_monitor",
]

# The protocol's names, in SchedulerStats order, from that class's field metadata.
STATS_FIELDS = tuple(f.metadata["monitor"] for f in stat_fields("monitor") if f.metadata["monitor_required"])
OPTIONAL_STATS_FIELDS = tuple(f.metadata["monitor"] for f in stat_fields("monitor") if not f.metadata["monitor_required"])
# Accepted alternative names: the SchedulerStats field names where they differ from the protocol's.
STATS_ALIASES = {f.metadata["monitor"]: (f.name,) for f in stat_fields("monitor") if f.metadata["monitor"] != f.name}
_QUEUE_CAPACITY = 8


@runtime_checkable
class Serving(Protocol):
    """What the monitor polls: ``stats()`` returning a snapshot (see the module docstring)."""

    def stats(self) -> Any: ...


@dataclass(frozen=True)
class MonitorSnapshot:
    """One snapshot as the monitor shows it: the protocol's fields (optional ints ``-1`` when unknown)."""

    active_sequences: int
    queue_length: int
    scheduler_steps: int
    decoded_tokens: int
    max_sequences: int = -1
    queue_capacity: int = -1
    completed_requests: int = -1
    closed: bool = False


if tuple(f.name for f in dataclasses.fields(MonitorSnapshot)) != (*STATS_FIELDS, *OPTIONAL_STATS_FIELDS, "closed"):
    raise ImportError("MonitorSnapshot's fields must be the monitor names of SchedulerStats' field metadata")


def read_stats(snapshot: Any) -> MonitorSnapshot:
    """A snapshot (a :class:`SchedulerStats`, another object with the protocol's attributes, or a mapping)
    as a :class:`MonitorSnapshot`; the one place a snapshot's names are looked up."""
    if isinstance(snapshot, MonitorSnapshot):
        return snapshot
    if isinstance(snapshot, SchedulerStats):  # the batching lease's own: every name is declared there
        return MonitorSnapshot(
            **{f.metadata["monitor"]: int(getattr(snapshot, f.name)) for f in stat_fields("monitor")},
            closed=snapshot.closed,
        )

    def get(name: str, default: Any) -> Any:
        if isinstance(snapshot, Mapping):
            return snapshot.get(name, default)
        return getattr(snapshot, name, default)  # another serving object's snapshot (a duck-typed protocol)

    missing = object()

    def lookup(name: str) -> Any:
        for key in (name, *STATS_ALIASES.get(name, ())):
            value = get(key, missing)
            if value is not missing:
                return value
        return missing

    out: dict[str, Any] = {}
    for name in STATS_FIELDS:
        value = lookup(name)
        if value is missing:
            raise TypeError(
                f"stats snapshot {type(snapshot).__name__} lacks {name!r}; the monitor needs "
                f"{', '.join(STATS_FIELDS)} (see aner_nb.widgets.batching)"
            )
        out[name] = int(value)
    for name in OPTIONAL_STATS_FIELDS:
        value = lookup(name)
        out[name] = -1 if value is missing or value is None else int(value)
    out["closed"] = bool(get("closed", False))
    return MonitorSnapshot(**out)


def _latency_fields() -> list[Any]:
    """The Timings fields of the latency table, by their metadata: the run's token counts and
    durations from the call (the queue included), then what sharing the batch looked like."""
    from ..llm import timing_fields

    wanted = ("prompt_tokens", "generated_tokens", "queue_duration", "first_token_duration", "decode_duration",
              "total_duration")
    return [f for f in timing_fields() if f.name in wanted] + list(timing_fields(part="batch"))


def _column(f: Any) -> str:
    return f.metadata["label"] + (" ms" if f.metadata["unit"] == "ns" else "")


def latency_frame(responses: Any, labels: Sequence[str] | None = None) -> Any:
    """Per-request latencies of a batch (one row per response); unmeasured values are NA."""
    import pandas as pd

    pairs = as_responses(responses, labels)
    fields = _latency_fields()
    rows = []
    for _, r in pairs:
        row = {_column(f): getattr(r.timings, f.name) for f in fields}
        row["tokens/s"] = r.tokens_per_second()
        rows.append(row)
    frame = pd.DataFrame(rows, index=pd.Index([lab for lab, _ in pairs], name="request"))
    times = [c for c in frame.columns if c.endswith(" ms")]
    counts = [c for c in frame.columns if c not in times and c != "tokens/s"]
    frame[counts] = frame[counts].astype("Int64").mask(frame[counts] < 0)
    frame[times] = (frame[times].astype("Float64") / 1e6).mask(frame[times] < 0)
    frame["tokens/s"] = frame["tokens/s"].astype("Float64").mask(frame["tokens/s"] < 0)
    frame.insert(0, "finish", [r.finish_reason for _, r in pairs])
    return frame


class BatchingMonitor(StaticView):
    """Live counters of a batching lease plus the latency table of recorded requests.

    See the module docstring for the serving protocol and the thread model.
    """

    def __init__(self, serving: Any, *, interval: float = 0.25, history: int = 2000) -> None:
        if isinstance(serving, Lease) and serving.kind != "throughput":
            raise TypeError(
                f"a {serving.kind} lease has no batching scheduler to monitor (its stats() refuses); "
                "batching_monitor needs a batching lease: model.with_batching(n)"
            )
        if not isinstance(serving, Serving):
            raise TypeError(
                f"{type(serving).__name__} has no stats() method; batching_monitor needs a serving object "
                f"whose stats() returns {', '.join(STATS_FIELDS)} (see aner_nb.widgets.batching)"
            )
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        try:
            self._ref: Any = weakref.ref(serving)
        except TypeError:  # not weak-referenceable: hold it strongly
            self._ref = lambda s=serving: s
        self.interval = float(interval)
        self._lock = threading.RLock()  # guards every widget mutation and the state below
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()
        self._pushed: MonitorSnapshot | None = None
        self._stats: MonitorSnapshot | None = None
        self._error: str | None = None
        self._history: deque[tuple[float, MonitorSnapshot]] = deque(maxlen=history)
        self._responses: list[tuple[str, Any]] = []

    # -- protocol side (any thread) ----------------------------------------------------
    def push(self, snapshot: Any) -> None:
        """Hand a fresh snapshot over from any thread; it is shown at the next throttled refresh."""
        stats = read_stats(snapshot)
        with self._lock:
            self._pushed = stats
        self._wake.set()

    def notify(self) -> None:
        """Ask the refresher to poll ``stats()`` soon (from any thread)."""
        self._wake.set()

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread | None:
        """The refresher thread (for inspection), or None before start."""
        return self._thread

    def start(self) -> "BatchingMonitor":
        """Start the refresher thread (idempotent)."""
        with self._lock:
            if self.running:
                return self
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="aner-batching-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the refresher, wait for it, and show the final numbers."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if self._ref() is not None and self._error is None:
            self.refresh()

    def __enter__(self) -> "BatchingMonitor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        last = 0.0
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            wait = self.interval - (time.monotonic() - last)
            if wait > 0 and self._stop.wait(wait):  # throttle: at most one update per interval
                break
            last = time.monotonic()
            if not self._poll_and_apply():
                break

    # -- refresh (refresher thread or kernel thread) ------------------------------------
    def refresh(self) -> MonitorSnapshot | None:
        """Poll now and update the view on the calling thread; returns the snapshot shown."""
        self._poll_and_apply()
        return self.stats

    def _poll_and_apply(self) -> bool:
        """Take the pushed snapshot or poll ``stats()``, then apply; False when polling should end."""
        with self._lock:
            stats, self._pushed = self._pushed, None
        serving = self._ref()
        if stats is None:
            if serving is None:
                return False
            try:
                stats = read_stats(serving.stats())
            except Exception as exc:  # a broken or closed lease: show why and stop polling
                with self._lock:
                    self._error = f"{type(exc).__name__}: {exc}"
                    self._apply()
                return False
        del serving  # never keep the lease alive between polls
        with self._lock:
            self._stats = stats
            self._history.append((time.monotonic() - self._t0, stats))
            self._apply()
        return not stats.closed

    @property
    def stats(self) -> MonitorSnapshot | None:
        """The last snapshot shown, or None before the first poll."""
        with self._lock:
            return self._stats

    def history_frame(self) -> Any:
        """Every snapshot shown so far, with seconds since the monitor was created."""
        import pandas as pd

        with self._lock:
            rows = [{"seconds": t, **dataclasses.asdict(s)} for t, s in self._history]
        frame = pd.DataFrame(rows, columns=["seconds", *STATS_FIELDS, *OPTIONAL_STATS_FIELDS, "closed"])
        ints = [*STATS_FIELDS, *OPTIONAL_STATS_FIELDS]
        frame[ints] = frame[ints].astype("Int64").mask(frame[ints] < 0)
        return frame

    def decode_rate(self) -> float | None:
        """Decoded tokens per second over the recorded history; None with fewer than two points."""
        with self._lock:
            if len(self._history) < 2:
                return None
            (t0, a), (t1, b) = self._history[0], self._history[-1]
        if t1 <= t0 or not (measured(a.decoded_tokens) and measured(b.decoded_tokens)):
            return None
        return (b.decoded_tokens - a.decoded_tokens) / (t1 - t0)

    # -- per-request latencies -------------------------------------------------------------
    def record(self, responses: Any, labels: Sequence[str] | None = None) -> Any:
        """Show the latency table of finished requests (e.g. a ``generate_many`` result); returns it."""
        pairs = as_responses(responses, labels)
        with self._lock:
            self._responses = pairs
            self._apply()
        return self.to_frame()

    def generate_many(self, prompts: Iterable[str], **kwargs: Any) -> list[Any]:
        """``serving.generate_many(prompts, **kwargs)`` with live counters, then the latency table."""
        serving = self._ref()
        if serving is None:
            raise RuntimeError("the monitored serving object no longer exists")
        self.start()
        responses = serving.generate_many(list(prompts), **kwargs)
        del serving
        self.refresh()
        self.record(responses)
        return responses

    def to_frame(self) -> Any:
        """The per-request latency table of the recorded responses (empty before ``record``)."""
        import pandas as pd

        with self._lock:
            pairs = list(self._responses)
        if not pairs:
            return pd.DataFrame(columns=["finish", "queue ms", "first token ms", "decode ms", "total ms"])
        return latency_frame([r for _, r in pairs], [lab for lab, _ in pairs])

    # -- views -----------------------------------------------------------------------------
    def _status_rows(self) -> list[tuple[str, str]]:
        s = self._stats
        if s is None:
            return [("status", self._error or "waiting for the first snapshot")]
        active = fmt_count(s.active_sequences)
        if measured(s.max_sequences):
            active += f" / {s.max_sequences}"
        queue = fmt_count(s.queue_length)
        queue += f" / {s.queue_capacity if measured(s.queue_capacity) else _QUEUE_CAPACITY}"
        rows = [
            ("active sequences", active),
            ("queue length", queue),
            ("scheduler steps", fmt_count(s.scheduler_steps)),
            ("decoded tokens", fmt_count(s.decoded_tokens)),
            ("completed requests", fmt_count(s.completed_requests)),
            ("decoded tokens/s (observed)", fmt_float(self.decode_rate(), 1)),
        ]
        status = "closed" if s.closed else ("polling" if self.running else "stopped")
        rows.append(("status", self._error or status))
        return rows

    def _latency_html(self) -> str:
        return frame_html(self.to_frame()) if self._responses else "<p><small>no requests recorded</small></p>"

    def _repr_html_(self) -> str:
        with self._lock:
            return f"<div class='aner-batching'>{html_table(self._status_rows())}{self._latency_html()}</div>"

    @property
    def widget(self) -> Any:
        with self._lock:
            if self._widget is None:
                self._widget = self._build_widget()
            return self._widget

    def _build_widget(self) -> Any:
        import ipywidgets as w

        self._w = {
            "active": w.IntProgress(value=0, min=0, max=1, description="active"),
            "queue": w.IntProgress(value=0, min=0, max=_QUEUE_CAPACITY, description="queue", bar_style="warning"),
            "steps": w.Label("–"),
            "tokens": w.Label("–"),
            "status": w.HTML(),
            "latency": w.HTML(),
        }
        box = w.VBox(
            [
                w.HBox([self._w["active"], self._w["queue"]]),
                w.HBox([w.Label("steps:"), self._w["steps"], w.Label("decoded tokens:"), self._w["tokens"]]),
                self._w["status"],
                self._w["latency"],
            ]
        )
        self._widget = box
        self._apply()
        return box

    def _apply(self) -> None:
        """Push the current state into the widgets; callers hold ``self._lock``."""
        if self._widget is None:
            return
        ws, s = self._w, self._stats
        if s is not None:
            active, queue = max(s.active_sequences, 0), max(s.queue_length, 0)
            ws["active"].max = max(s.max_sequences, active, 1)
            ws["active"].value = active
            ws["queue"].max = max(s.queue_capacity if measured(s.queue_capacity) else _QUEUE_CAPACITY, queue, 1)
            ws["queue"].value = queue
            ws["steps"].value = fmt_count(s.scheduler_steps)
            ws["tokens"].value = fmt_count(s.decoded_tokens)
        ws["status"].value = html_table(self._status_rows())
        ws["latency"].value = self._latency_html()

    def __repr__(self) -> str:
        s = self._stats
        state = "running" if self.running else "stopped"
        if s is None:
            return f"<BatchingMonitor {state}, no snapshot yet>"
        return (
            f"<BatchingMonitor {state} active={s.active_sequences} queue={s.queue_length} "
            f"steps={s.scheduler_steps} decoded={s.decoded_tokens}>"
        )


def batching_monitor(serving: Any, *, interval: float = 0.25, start: bool = True) -> BatchingMonitor:
    """A live view of ``serving`` (a batching lease; see the module's protocol), refreshed every ``interval`` s.

    Use ``monitor.generate_many(prompts)`` (or ``record(responses)``) for the
    per-request latency table; ``stop()`` ends polling. Static fallback: HTML
    counters plus the latency table; ``to_frame()`` is the latency table.
    """
    monitor = BatchingMonitor(serving, interval=interval)
    return monitor.start() if start else monitor

