"""The statistics of the batching scheduler, declared once (:class:`SchedulerStats`).

Each field's metadata names it for the batching monitor widget
(``aner_nb.widgets.batching``) and for the Prometheus exposition of the HTTP
service (``/metrics`` of ``aner_nb.api``); :func:`stat_fields` lists the
fields that have a given name. :class:`SchedulerCounters` are the fields a
scheduler counts itself (:data:`COUNTED` names them); the others are its
settings or are read off its state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SchedulerStats", "SchedulerCounters", "stat_fields", "COUNTED"]


def _stat(help: str, *, monitor: str | None = None, required: bool = False, metric: str | None = None) -> Any:
    """A :class:`SchedulerStats` field: its help text and its names elsewhere.

    ``monitor``: the batching monitor's protocol name (``required``: the
    monitor needs it); ``metric``: the Prometheus family, a counter when the
    name ends in ``_total`` and a gauge otherwise.
    """
    meta: dict[str, Any] = {"help": help}
    if monitor is not None:
        meta.update(monitor=monitor, monitor_required=required)
    if metric is not None:
        meta.update(metric=metric, metric_type="counter" if metric.endswith("_total") else "gauge")
    return field(metadata=meta)


@dataclass(frozen=True)
class SchedulerStats:
    """Counters of one scheduler since it started, read together under its lock (a snapshot).

    The one declaration of the scheduler's statistics: each field's metadata
    holds its ``help`` text and, where it has them, its name in the batching
    monitor's protocol (``aner_nb.widgets.batching``) and its Prometheus
    family (``/metrics`` of ``aner_nb.api``); see :func:`stat_fields`.
    """

    max_sequences: int = _stat(
        "Sequences the batching scheduler decodes at most at once.",
        monitor="max_sequences", metric="aner_max_sequences")
    sequence_context: int = _stat("KV cells of each sequence id.", metric="aner_sequence_context_cells")
    queue_limit: int = _stat(
        "Requests the batching scheduler's queue holds at most.",
        monitor="queue_capacity", metric="aner_queue_limit")
    batch_tokens: int = _stat("Batch rows one scheduler step evaluates at most.", metric="aner_batch_tokens")
    active: int = _stat(
        "Sequences decoding in the batching scheduler now.",
        monitor="active_sequences", required=True, metric="aner_active_sequences")
    waiting: int = _stat(
        "Requests waiting in the batching scheduler's queue.",
        monitor="queue_length", required=True, metric="aner_queue_length")
    admitted: int = _stat("Requests given a sequence id by the batching scheduler.", metric="aner_scheduler_admitted_total")
    completed: int = _stat(
        "Requests the batching scheduler finished, not counting cancelled ones.",
        monitor="completed_requests", metric="aner_scheduler_completed_total")
    cancelled: int = _stat(
        "Requests the batching scheduler ended as cancelled, queued or running.", metric="aner_scheduler_cancelled_total")
    failed: int = _stat("Requests the batching scheduler failed with an error.", metric="aner_scheduler_failed_total")
    steps: int = _stat(
        "llama_decode calls of the batching scheduler.",
        monitor="scheduler_steps", required=True, metric="aner_scheduler_steps_total")
    evaluated_tokens: int = _stat(
        "Batch rows evaluated by the batching scheduler: prompt chunks and fed tokens.",
        metric="aner_scheduler_evaluated_tokens_total")
    decoded_tokens: int = _stat(
        "Tokens sampled by the batching scheduler.",
        monitor="decoded_tokens", required=True, metric="aner_scheduler_decoded_tokens_total")
    peak_sequences: int = _stat("Most sequences that shared one scheduler step so far.", metric="aner_peak_sequences")
    compactions: int = _stat(
        "Sequences moved to another id to keep the active ids consecutive.", metric="aner_scheduler_compactions_total")
    padding_rows: int = _stat(
        "Logits rows requested only to keep the output kernel to one pass.", metric="aner_scheduler_padding_rows_total")
    prefix_cache_capacity: int = _stat(
        "Shared prefixes the batching scheduler keeps at most (spare KV streams).", metric="aner_prefix_cache_capacity")
    prefix_cache_entries: int = _stat(
        "Shared prefixes the batching scheduler holds now.", metric="aner_prefix_cache_entries")
    prefix_cache_retained_tokens: int = _stat(
        "Prompt tokens the batching scheduler's shared prefixes hold now.", metric="aner_prefix_cache_retained_tokens")
    prefix_cache_hits: int = _stat(
        "Requests that started from a shared prefix instead of evaluating it.", metric="aner_prefix_cache_hits_total")
    prefix_cache_reused_tokens: int = _stat(
        "Prompt tokens copied from shared prefixes instead of evaluated.",
        metric="aner_prefix_cache_reused_tokens_total")
    prefix_cache_waits: int = _stat(
        "Admissions deferred until a prompt being evaluated, sharing a long prefix, was retained.",
        metric="aner_prefix_cache_waits_total")
    closed: bool = _stat("The scheduler accepts no more requests.")  # the monitor reads it as is
    running: bool = _stat("The scheduler thread is alive.")


def stat_fields(key: str) -> tuple[dataclasses.Field, ...]:
    """The :class:`SchedulerStats` fields whose metadata has ``key`` (``"monitor"`` or ``"metric"``), in order."""
    return tuple(f for f in dataclasses.fields(SchedulerStats) if key in f.metadata)


@dataclass
class SchedulerCounters:
    """The counters a scheduler keeps itself, as attributes (mutable: the scheduler updates them under its
    lock); each is the :class:`SchedulerStats` field of the same name, which a snapshot copies
    (``**dataclasses.asdict(counters)``)."""

    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    steps: int = 0
    evaluated_tokens: int = 0
    decoded_tokens: int = 0
    compactions: int = 0
    padding_rows: int = 0
    prefix_cache_waits: int = 0


# The scheduler's own counters (the other SchedulerStats fields are settings or read off its state).
COUNTED = tuple(f.name for f in dataclasses.fields(SchedulerCounters))

