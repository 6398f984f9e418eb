"""The service's Prometheus metrics, on a ``prometheus_client`` registry of its own per application.

Each application gets a :class:`ServiceMetrics` (never the process-global
registry, so two services in one process, or a test's many, do not mix).
Counters and histograms are ``prometheus_client`` objects, updated as
requests happen (thread safe: the event loop and worker threads both
update them); gauges are read at scrape time by a collector: the admission
gate's in-flight count and capacity, the batching scheduler's snapshot,
and the process's resident memory. The scheduler's families are not listed
here: they are the ``metric`` metadata of
:class:`aner_nb.llm.scheduler.SchedulerStats`.

Families (names in base units: ``_seconds``, ``_bytes``; counters end in ``_total``):

- by ``route`` (the declared paths; anything else is ``other``):
  ``aner_http_requests_total`` (and ``code``),
  ``aner_http_request_duration_seconds`` (arrival to the answer's last byte),
  ``aner_http_time_to_first_token_seconds`` (admission to the first text piece);
- by ``model``: ``aner_requests_total``, ``aner_busy_rejections_total``,
  ``aner_timeouts_total``, ``aner_disconnects_total``, ``aner_prompt_tokens_total``,
  ``aner_completion_tokens_total``, ``aner_queue_duration_seconds``,
  ``aner_prefill_duration_seconds``, ``aner_decode_duration_seconds`` (the
  library's timings of finished requests), ``aner_http_in_flight``,
  ``aner_http_capacity``, and a batching lease's scheduler families
  (``aner_queue_length``, ``aner_active_sequences``, ...), ``aner_native_contexts``
  (live llama.cpp contexts on the model's weights: a leak check);
- connections (a running ``Server``'s ``connections.ConnectionRegistry``; absent
  under another ASGI server): ``aner_http_connections`` (open),
  ``aner_http_connections_idle`` (no request in flight),
  ``aner_http_connections_refused_total`` by ``reason`` (``per_client``: over
  the per-client limit, answered 429; ``capacity``: every slot busy, 503),
  ``aner_http_connections_evicted_total`` (idle ones closed to make room);
- ``process_resident_memory_bytes``.

The text is ``prometheus_client.generate_latest`` of the app's own registry
(text format 0.0.4): label order and number formatting are the client
library's, so scrapers and tests must not depend on either.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..llm.scheduler import stat_fields

__all__ = ["CONTENT_TYPE", "ServiceMetrics", "ModelMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# From a 5 ms answer to a 5 minute generation.
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

_COUNTERS = {
    "requests": "Generation requests admitted to the model.",
    "busy_rejections": "Requests answered 503 because the model's workers and queue were full.",
    "timeouts": "Requests cancelled because they ran past the request timeout.",
    "disconnects": "Requests cancelled because the client went away.",
    "prompt_tokens": "Prompt tokens of finished requests.",
    "completion_tokens": "Generated tokens of finished requests.",
}
# The library's timings (ns) observed per finished request, by histogram name.
_TIMINGS = {
    "aner_queue_duration_seconds": ("queue_duration", "Time finished requests waited for a sequence or context."),
    "aner_prefill_duration_seconds": ("prompt_eval_duration", "Prompt evaluation time of finished requests."),
    "aner_decode_duration_seconds": ("decode_duration", "Decode time of finished requests."),
}


class ModelMetrics:
    """The metrics of one served model, as its mount and the service update them."""

    def __init__(self, service: "ServiceMetrics", model: str) -> None:
        self._service = service
        self._counters = {key: counter.labels(model=model) for key, counter in service.counters.items()}
        self._timings = {attr: service.timings[name].labels(model=model) for name, (attr, _) in _TIMINGS.items()}

    def count(self, name: str, value: int = 1) -> None:
        """Add ``value`` to this model's counter ``name`` (a key of ``_COUNTERS``)."""
        self._counters[name].inc(value)

    def finished(self, route: str, response: Any, first_piece_s: float | None) -> None:
        """Record a request that ran to its end: tokens, the library's timings, time to first piece."""
        self.count("prompt_tokens", response.usage.prompt_tokens)
        self.count("completion_tokens", response.usage.completion_tokens)
        for attr, histogram in self._timings.items():
            ns = getattr(response.timings, attr)
            if ns >= 0:  # -1: not measured
                histogram.observe(ns / 1e9)
        if first_piece_s is not None:
            self._service.first_token.labels(route=route).observe(first_piece_s)


class ServiceMetrics:
    """One application's registry: the request-level families, and each served model's."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("aner_http_requests", "HTTP requests answered, by route and status code.",
                                ["route", "code"], registry=r)
        self.duration = Histogram("aner_http_request_duration_seconds",
                                  "Time from the request's arrival to the end of its answer, by route.",
                                  ["route"], buckets=SECONDS_BUCKETS, registry=r)
        self.first_token = Histogram("aner_http_time_to_first_token_seconds",
                                     "Time from a request's admission to its first text piece, by route.",
                                     ["route"], buckets=SECONDS_BUCKETS, registry=r)
        self.counters = {key: Counter(f"aner_{key}", text, ["model"], registry=r) for key, text in _COUNTERS.items()}
        self.timings = {name: Histogram(name, text, ["model"], buckets=SECONDS_BUCKETS, registry=r)
                        for name, (_, text) in _TIMINGS.items()}
        self._mounts: Callable[[], Iterable[Any]] = tuple
        self._connections: Callable[[], Any] = lambda: None
        r.register(_ScrapeTimeCollector(lambda: self._mounts(), lambda: self._connections()))

    def model(self, name: str) -> ModelMetrics:
        return ModelMetrics(self, name)

    def watch(self, mounts: Callable[[], Iterable[Any]]) -> None:
        """Read gauges from ``mounts()`` (the served mounts: gate, capacity, scheduler stats) at each scrape."""
        self._mounts = mounts

    def watch_connections(self, registry: Callable[[], Any]) -> None:
        """Read the connection families from ``registry()`` (a ``ConnectionRegistry``) at each scrape."""
        self._connections = registry

    def request(self, route: str, status: int, seconds: float) -> None:
        """An HTTP request answered (the guard calls this for every request, refused ones included)."""
        self.requests.labels(route=route, code=str(status)).inc()
        self.duration.labels(route=route).observe(seconds)

    def render(self) -> bytes:
        """Prometheus text format (0.0.4)."""
        return generate_latest(self.registry)


class _ScrapeTimeCollector:
    """Gauges read when ``/metrics`` is scraped: in flight, capacity, scheduler stats, native contexts, RSS."""

    def __init__(self, mounts: Callable[[], Iterable[Any]], connections: Callable[[], Any] = lambda: None) -> None:
        self._mounts = mounts
        self._connections = connections

    def collect(self) -> Iterator[Metric]:
        mounts = list(self._mounts())
        in_flight = GaugeMetricFamily("aner_http_in_flight", "Requests admitted and not yet finished.", labels=["model"])
        capacity = GaugeMetricFamily("aner_http_capacity",
                                     "Requests admitted at most at once (workers = running + queued).", labels=["model"])
        for m in mounts:
            in_flight.add_metric([m.name], m.gate.in_flight)
            capacity.add_metric([m.name], m.capacity)
        yield in_flight
        yield capacity
        batching = [(m.name, stats) for m in mounts if (stats := m.stats()) is not None]
        for f in stat_fields("metric"):
            meta = f.metadata
            kind = CounterMetricFamily if meta["metric_type"] == "counter" else GaugeMetricFamily
            family = kind(meta["metric"], meta["help"], labels=["model"])
            for name, stats in batching:
                family.add_metric([name], getattr(stats, f.name))
            yield family
        yield from _prefix_tier_metrics(mounts)
        # A leak check from outside (benchmarks/soak.py samples it): a served model should hold the
        # same contexts after a million requests as after ten.
        contexts = GaugeMetricFamily("aner_native_contexts",
                                     "Live llama.cpp contexts on the served model's weights.", labels=["model"])
        for m in mounts:
            contexts.add_metric([m.name], m.model.memory_summary().live_contexts)
        yield contexts
        registry = self._connections()
        if registry is not None:
            yield GaugeMetricFamily("aner_http_connections", "Open HTTP connections.", value=registry.open)
            yield GaugeMetricFamily("aner_http_connections_idle", "Open HTTP connections with no request in flight.",
                                    value=registry.idle_count)
            refused = CounterMetricFamily("aner_http_connections_refused",
                                          "Connections refused at once: over the per-client limit (429) or no "
                                          "free slot (503).", labels=["reason"])
            for reason, count in registry.refused.items():
                refused.add_metric([reason], count)
            yield refused
            yield CounterMetricFamily("aner_http_connections_evicted",
                                      "Idle connections closed to make room for new ones.", value=registry.evicted)
        rss = GaugeMetricFamily("process_resident_memory_bytes", "Resident memory of this process (bytes).")
        rss.add_metric([], psutil.Process().memory_info().rss)
        yield rss


def _prefix_tier_metrics(mounts: list[Any]) -> Iterator[Metric]:
    """The prefix tiers of each served model (``prefix_cache_ram_bytes`` / ``prefix_cache_dir``)."""
    hits = CounterMetricFamily("aner_prefix_tier_hits", "Requests whose prefix a tier restored, by tier.",
                               labels=["model", "tier"])
    misses = CounterMetricFamily("aner_prefix_tier_misses", "Requests the tiers had no usable prefix for.",
                                 labels=["model"])
    skips = CounterMetricFamily("aner_prefix_tier_skips", "Stored prefixes skipped (not restored), by reason.",
                                labels=["model", "reason"])
    read = CounterMetricFamily("aner_prefix_tier_read_bytes", "Bytes restored from a tier, by tier.",
                               labels=["model", "tier"])
    written = CounterMetricFamily("aner_prefix_tier_written_bytes", "Bytes stored in a tier, by tier.",
                                  labels=["model", "tier"])
    held = GaugeMetricFamily("aner_prefix_tier_held_bytes", "Bytes a tier holds now, by tier.", labels=["model", "tier"])
    for m in mounts:
        stats_of = getattr(m.model, "prefix_tier_stats", None)
        stats = stats_of() if callable(stats_of) else None
        if stats is None:
            continue
        for tier, n in stats["hits"].items():
            hits.add_metric([m.name, tier], n)
        misses.add_metric([m.name], stats["misses"])
        for reason, n in stats["skips"].items():
            skips.add_metric([m.name, reason], n)
        for tier, n in stats["bytes_read"].items():
            read.add_metric([m.name, tier], n)
        for tier, n in stats["bytes_written"].items():
            written.add_metric([m.name, tier], n)
        for tier, n in stats["held_bytes"].items():
            held.add_metric([m.name, tier], n)
    yield from (hits, misses, skips, read, written, held)
