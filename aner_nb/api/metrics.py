"""Counters of the HTTP service and their Prometheus text exposition.

Counters live per served model (``MountMetrics``) and are plain integers
under a lock: cheap to bump from the event loop and from worker threads.
Gauges (in flight, queue length, active sequences) are read when
``/metrics`` is scraped, from the admission gate and the batching
scheduler's snapshot. The scheduler's families are not listed here: they
are the ``metric`` metadata of :class:`aner_nb.llm.scheduler.SchedulerStats`.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Iterable

from ..llm.scheduler import stat_fields

__all__ = ["MountMetrics", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS = {
    "requests": "Generation requests admitted to the model.",
    "busy_rejections": "Requests answered 503 because the model's workers and queue were full.",
    "timeouts": "Requests cancelled because they ran past the request timeout.",
    "disconnects": "Requests cancelled because the client went away.",
    "prompt_tokens": "Prompt tokens of finished requests.",
    "completion_tokens": "Generated tokens of finished requests.",
}


class MountMetrics:
    """Counters of one served model (and, for the service, requests by route and status)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._requests: Counter[tuple[str, str]] = Counter()  # (route, status code) -> count
        self._duration_sum = 0.0
        self._duration_count = 0

    def count(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._counts[name] += value

    def request(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self._requests[(route, str(status))] += 1
            self._duration_sum += seconds
            self._duration_count += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "counts": dict(self._counts),
                "requests": dict(self._requests),
                "duration_sum": self._duration_sum,
                "duration_count": self._duration_count,
            }


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(service: MountMetrics, mounts: Iterable[Any]) -> str:
    """Prometheus text format (0.0.4): the service's request counts, then each model's (``model="<id>"``)."""
    mounts = list(mounts)
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            number = repr(float(value)) if isinstance(value, float) else str(int(value))
            lines.append(f"{name}{{{labels}}} {number}" if labels else f"{name} {number}")

    service_snap = service.snapshot()
    family(
        "aner_http_requests_total", "counter", "HTTP requests answered, by route and status code.",
        [(f'route="{_escape(route)}",code="{code}"', n) for (route, code), n in sorted(service_snap["requests"].items())],
    )
    lines.append("# HELP aner_http_request_duration_seconds Time from the request's arrival to the end of its answer.")
    lines.append("# TYPE aner_http_request_duration_seconds summary")
    lines.append(f"aner_http_request_duration_seconds_sum {service_snap['duration_sum']!r}")
    lines.append(f"aner_http_request_duration_seconds_count {service_snap['duration_count']}")
    snaps = [(m, f'model="{_escape(m.name)}"', m.metrics.snapshot(), m.stats()) for m in mounts]
    for key, help_text in _COUNTERS.items():
        family(f"aner_{key}_total", "counter", help_text, [(label, snap["counts"].get(key, 0)) for _, label, snap, _ in snaps])
    family("aner_http_in_flight", "gauge", "Requests admitted and not yet finished.",
           [(label, m.gate.in_flight) for m, label, _, _ in snaps])
    family("aner_http_capacity", "gauge", "Requests admitted at most at once (workers = running + queued).",
           [(label, m.capacity) for m, label, _, _ in snaps])
    batching = [(label, stats) for _, label, _, stats in snaps if stats is not None]
    for f in stat_fields("metric"):
        meta = f.metadata
        family(meta["metric"], meta["metric_type"], meta["help"], [(label, getattr(s, f.name)) for label, s in batching])
    return "\n".join(lines) + "\n"
