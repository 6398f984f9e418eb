"""Continuous batching: many requests decoded together on one shared context.

Two parts:

* The step **policy**, plain functions and frozen objects over plain numbers
  that unit tests exercise without a model: which queued requests start
  (:class:`FifoAdmission`, :func:`admit_count`), how a step's token budget is
  shared (:func:`share_budget`, :func:`plan_step`), the whole batch of one
  step, row by row (:func:`plan_batch` returning a :class:`BatchPlan`), which
  sequence id a request gets (:func:`next_sequence_id`) and which sequences
  move to close gaps between ids (:func:`compaction_moves`), and which
  request gives way when the KV has no room (:func:`kv_victim`).
* The :class:`Scheduler`, one thread that owns the context and runs the
  policy against the engine: one ``llama_decode`` per step. Nothing else
  ever touches the context (a llama.cpp context is not thread safe). A step
  is split as in vLLM v1: *plan* (:func:`plan_batch`, pure), *execute* (fill
  the batch, one ``llama_decode``) and *update* (positions, counters,
  sampling).

Context split: the context's cells are divided equally between the
``max_sequences`` sequence ids, one KV stream each (llama.cpp
``kv_unified=False``). A sequence's cells then sit in position order at the
start of its own stream, exactly as in a fresh context of an ordinary
lease, so attention (whose flash-attention CPU kernel accumulates in cell
order, in f16) computes the same numbers and greedy output equals the
request run alone, token for token. With a unified cache, freed cells are
reused out of order and outputs drift. A request must therefore fit its
sequence's share (prompt plus ``max_tokens`` <= ``context // max_sequences``),
checked at submission; an admitted request can never run out of KV.

Each step gives one decode row to every running sequence first, then shares
the rest of ``batch_tokens`` between prompts still being evaluated (max-min
fair, chunked prefill). Rows are laid out in sequence-id order because
llama.cpp splits a multi-stream batch into micro-batches of *consecutive*
sequence ids (each one a full pass over the weights): with the active ids
kept consecutive (admissions take an id next to the running ones, and when
a finished request leaves a gap that no queued request fills, the fewest
sequences move, a KV stream copy each) one micro-batch carries a token of
every sequence. Logits are requested only for rows that are sampled, plus
one ignored row where an odd count would cost the CPU kernel an extra pass
over the output weights (:func:`output_rows`). A finished sequence's cells
are removed at once and its id admits queued work on the next step, so a
short request that arrives late can finish before an earlier long one.
Admission order is a policy object; the default is first in, first out.

Shared prefixes (``prefix_cache_entries > 0``, see
:mod:`aner_nb.llm.shared_prefix`): spare sequence ids above the request ids
each hold an evaluated prompt prefix in their own stream. An admitted
request whose prompt starts with an entry's tokens gets a copy of that
stream (``llama_memory_seq_cp`` between streams copies the buffer during
the next ``llama_decode``, before the batch runs, in the order the copies
were asked for), the positions past the common prefix are removed, and
only the rest is evaluated; the copied cells keep their indices, so they
sit in position order at the start of the stream exactly as if evaluated
there. Output equals a solo run when the prompt is evaluated in the same
chunks (the fixtures' single-chunk prompts); a prompt split at other chunk
boundaries (a copied prefix, or a step budget shared with other prompts,
as in plain batching) can round differently in llama.cpp's CPU kernels and
flip a near tie, as a solo lease with another ``batch_tokens`` can. A prompt is retained when its
evaluation ends. A queued request that shares a long prefix with a prompt
being evaluated waits for it instead of evaluating the same tokens beside
it (:func:`~aner_nb.llm.shared_prefix.waits_for`).

The counters a scheduler reports (:class:`SchedulerStats`) are declared once:
each field's metadata names it for the batching monitor widget and for the
Prometheus exposition of the HTTP service (:func:`stat_fields`).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, TypeVar

from ._engine import DECODE_NO_KV_SLOT, Batch, NativeContext, NativeModel, Sampler
from .context_pool import free_all
from .errors import BusyError, ClosedError, EngineError
from .response import Response
from .runner import Job, SequenceOutput
from .sampling import new_sampler
from .shared_prefix import SharedPrefixes
from .timings import BatchTimings, PoolTimings, PrefixCacheTimings, QueueTimings, TimingsPart

__all__ = [
    "StepPlan",
    "Rows",
    "BatchPlan",
    "AdmissionPolicy",
    "FifoAdmission",
    "SchedulerStats",
    "Outbox",
    "Request",
    "Scheduler",
    "admit_count",
    "share_budget",
    "plan_step",
    "plan_batch",
    "next_sequence_id",
    "compaction_moves",
    "kv_victim",
    "output_rows",
    "stat_fields",
]

log = logging.getLogger("aner_nb.scheduler")
_now = time.perf_counter_ns
_POLL_S = 0.25  # waits re-check their condition at this period (Ctrl-C stays responsive on every OS)


# -- policy: pure functions ------------------------------------------------------------


def admit_count(waiting: int, free_sequences: int) -> int:
    """How many queued requests start now: the oldest ones, one per free sequence id.

    Every admitted request fits its sequence's KV share (checked at
    submission), so the only limit is the number of free sequence ids.
    """
    return max(min(waiting, free_sequences), 0)


def share_budget(needs: Sequence[int], budget: int) -> tuple[int, ...]:
    """Split ``budget`` tokens between prefills needing ``needs`` tokens (max-min fair).

    Every prefill gets an equal share; what a small one does not need is
    shared again among the others; an indivisible remainder goes to the
    earliest (lowest index) first. No prefill gets more than it needs, and
    the whole budget is used whenever the needs allow it.
    """
    alloc = [0] * len(needs)
    left = max(budget, 0)
    open_ = [i for i, need in enumerate(needs) if need > 0]
    while open_ and left > 0:
        share = left // len(open_)
        if share == 0:
            for i in open_[:left]:
                alloc[i] += 1
            break
        still_open = []
        for i in open_:
            give = min(share, needs[i] - alloc[i])
            alloc[i] += give
            left -= give
            if alloc[i] < needs[i]:
                still_open.append(i)
        open_ = still_open
    return tuple(alloc)


@dataclass(frozen=True)
class StepPlan:
    """What one ``llama_decode`` evaluates: a decode row per running sequence, then prefill chunks."""

    decode: tuple[int, ...]  # sequence ids with one decode row each
    prefill: tuple[tuple[int, int], ...]  # (sequence id, prompt tokens) for each prefill with a chunk

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)

    @property
    def sequences(self) -> int:
        return len(self.decode) + len(self.prefill)

    def layout(self) -> tuple[tuple[int, int], ...]:
        """``(sequence id, rows)`` in the order the rows go into the batch: by sequence id.

        llama.cpp splits a multi-stream batch into micro-batches of
        consecutive sequence ids taken in row order, so id order lets one
        micro-batch hold a row of every sequence.
        """
        rows = [(seq, 1) for seq in self.decode] + list(self.prefill)
        return tuple(sorted(rows))


def plan_step(decoding: Sequence[int], prefilling: Sequence[tuple[int, int]], batch_tokens: int) -> StepPlan:
    """Plan one step: every decoding sequence gets a row, prefills share what is left.

    ``decoding`` lists sequence ids with a token to feed; ``prefilling`` lists
    ``(sequence id, prompt tokens still to evaluate)`` in admission order.
    """
    if len(decoding) > batch_tokens:
        raise ValueError(f"{len(decoding)} decode rows do not fit batch_tokens={batch_tokens}")
    chunks = share_budget([n for _, n in prefilling], batch_tokens - len(decoding))
    prefill = tuple((seq, n) for (seq, _), n in zip(prefilling, chunks) if n > 0)
    return StepPlan(tuple(decoding), prefill)


def next_sequence_id(active: Sequence[int], free: Sequence[int]) -> int:
    """The free sequence id for the next admission: one that keeps the active ids consecutive.

    A gap between active ids is filled first, then the run is extended
    upwards, then downwards; with nothing active the lowest id is used.
    """
    if not free:
        raise ValueError("no free sequence id")
    free_set = set(free)
    if active:
        lo, hi = min(active), max(active)
        inside = [i for i in sorted(free_set) if lo < i < hi]
        for candidate in (*inside[:1], hi + 1, lo - 1):
            if candidate in free_set:
                return candidate
    return min(free_set)


def compaction_moves(active: Sequence[int], n_ids: int) -> tuple[tuple[int, int], ...]:
    """``(from, to)`` moves that make the active sequence ids consecutive, as few as possible.

    The target is the window of ``len(active)`` ids (within ``0..n_ids-1``)
    that already holds the most active ids (the lowest such window on a
    tie); every active id outside it moves into one of its free ids. No
    moves when the ids are already consecutive.
    """
    ids = sorted(active)
    n = len(ids)
    if n == 0 or ids[-1] - ids[0] + 1 == n:
        return ()
    present = set(ids)
    start = max(range(n_ids - n + 1), key=lambda w: (sum(i in present for i in range(w, w + n)), -w))
    window = range(start, start + n)
    outside = [i for i in reversed(ids) if i not in window]
    holes = [i for i in window if i not in present]
    return tuple(zip(outside, holes))


def kv_victim(participants: Sequence[tuple[int, int, bool]]) -> int:
    """The sequence to fail when a step finds no KV slot.

    ``participants`` are ``(sequence id, admission number, has prefill rows)``.
    The newest request that is evaluating its prompt gives way (prompts are
    what grow the KV fastest); otherwise the newest one. Older requests keep
    their progress, in line with FIFO admission.
    """
    if not participants:
        raise ValueError("a step without participants cannot run out of KV")
    prefilling = [p for p in participants if p[2]]
    return max(prefilling or participants, key=lambda p: p[1])[0]


def output_rows(sampled: int, pair_columns: bool) -> int:
    """How many logits rows a step requests when ``sampled`` of its rows are sampled.

    Where the CPU kernel multiplies the output weights two batch columns at a
    time (``pair_columns``, see :func:`aner_nb.llm._engine.pairs_batch_columns`),
    an odd count of three or more costs a whole extra pass over those weights,
    more than one more column does: such a step asks for one more row's logits
    and ignores them. One row takes the single-column kernel and stays as is.
    """
    if pair_columns and sampled >= 3 and sampled % 2:
        return sampled + 1
    return sampled


T = TypeVar("T")


class AdmissionPolicy(Protocol):
    """Which waiting requests start now; the scheduler calls it under its lock, on its own thread."""

    def admit(self, waiting: Sequence[T], free: Sequence[int]) -> Sequence[T]:
        """Some of ``waiting`` (oldest first), at most one per id in ``free``, in the order they start."""
        ...


class FifoAdmission:
    """First in, first out: the oldest waiting requests, one per free sequence id.

    Every queued request fits its sequence's KV share (checked at
    submission), so the only limit is the number of free sequence ids.
    """

    def admit(self, waiting: Sequence[T], free: Sequence[int]) -> Sequence[T]:
        return tuple(waiting)[: admit_count(len(waiting), len(free))]


DECODE, PREFILL, PAD = "decode", "prefill", "pad"


@dataclass(frozen=True)
class Rows:
    """The consecutive rows one sequence has in a step's batch."""

    seq: int
    first: int  # batch index of the first row
    count: int
    kind: str  # DECODE: the last sampled token fed back; PREFILL: a prompt chunk; PAD: a throwaway token
    sampled: bool  # the last row's logits are sampled (a decode row, or a chunk that ends its prompt)

    @property
    def last(self) -> int:
        return self.first + self.count - 1


@dataclass(frozen=True)
class BatchPlan:
    """One step, row by row: what the scheduler writes into the batch before its ``llama_decode``.

    Made by :func:`plan_batch` from plain numbers; the scheduler only fills
    the batch as it says, runs it and applies the results.
    """

    step: StepPlan  # the budget decision the rows lay out
    rows: tuple[Rows, ...]  # in batch order, which is sequence-id order
    spare_row: int = -1  # a prompt row that is not sampled but gets logits, as the padding row
    pad_seq: int = -1  # an empty sequence id holding the padding token instead, cleared after the step

    @property
    def n_tokens(self) -> int:
        return sum(r.count for r in self.rows)

    @property
    def sampled(self) -> tuple[tuple[int, int], ...]:
        """``(sequence id, logits row)`` of every row that is sampled, in batch order."""
        return tuple((r.seq, r.last) for r in self.rows if r.sampled)

    @property
    def participants(self) -> tuple[int, ...]:
        """The sequence ids of requests in this step (not the padding sequence)."""
        return tuple(r.seq for r in self.rows if r.kind != PAD)

    @property
    def padded(self) -> bool:
        return self.spare_row >= 0 or self.pad_seq >= 0


def plan_batch(
    decoding: Sequence[int],
    prefilling: Sequence[tuple[int, int]],
    batch_tokens: int,
    *,
    pair_columns: bool = False,
    active: Sequence[int] | None = None,
    free: Sequence[int] = (),
) -> BatchPlan:
    """Plan one step's batch: :func:`plan_step`, laid out by sequence id, plus the padding decision.

    ``decoding`` and ``prefilling`` are as for :func:`plan_step`; ``active``
    lists every running sequence id (the step's own by default) and ``free``
    the unused ones. Where :func:`output_rows` asks for one more logits row,
    the last prompt row that is not sampled gets it; a step without such a
    row puts one token in a free id next to the active ones (so it joins
    their micro-batch), if the batch has room; otherwise the step goes
    unpadded.
    """
    step = plan_step(decoding, prefilling, batch_tokens)
    left = dict(prefilling)
    ending = {seq for seq, n in step.prefill if n == left[seq]}
    sampled = len(step.decode) + len(ending)
    pad = output_rows(sampled, pair_columns) > sampled
    has_spare = step.n_tokens - len(step.decode) > len(ending)  # a prompt row that is not sampled
    layout = list(step.layout())
    pad_seq = -1
    if pad and not has_spare and free and step.n_tokens < batch_tokens:
        pad_seq = next_sequence_id([*decoding, *left] if active is None else active, free)
        layout = sorted([*layout, (pad_seq, 1)])
    decode = set(step.decode)
    rows, first = [], 0
    for seq, n in layout:
        kind = PAD if seq == pad_seq else DECODE if seq in decode else PREFILL
        rows.append(Rows(seq, first, n, kind, sampled=kind == DECODE or seq in ending))
        first += n
    spare = -1
    if pad and has_spare:  # a chunk's last unsampled row: its last, or the one before a sampled last
        spare = max(r.last - r.sampled for r in rows if r.kind == PREFILL and r.count > r.sampled)
    return BatchPlan(step, tuple(rows), spare, pad_seq)


# -- the caller's side of a request -----------------------------------------------------


class Outbox:
    """Text pieces of one streamed request on their way to its consumer.

    Bounded: the scheduler feeds the sequence another token only while there
    is room, so a slow consumer pauses its own sequence and nobody else's.
    """

    def __init__(self, capacity: int, wake: Callable[[], None], guard: Callable[[str], None]) -> None:
        self.capacity = capacity
        self._items: collections.deque[str] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._wake = wake
        self._guard = guard

    def has_room(self) -> bool:
        with self._cv:
            return len(self._items) < self.capacity

    def put(self, piece: str) -> None:
        """Scheduler side; never blocks (the scheduler checked ``has_room``)."""
        with self._cv:
            self._items.append(piece)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def get(self) -> str | None:
        """Consumer side: the next piece, or None once the request has ended."""
        self._guard("reading a stream")
        with self._cv:
            while not self._items and not self._closed:
                self._cv.wait(_POLL_S)
            if not self._items:
                return None
            was_full = len(self._items) >= self.capacity
            piece = self._items.popleft()
        if was_full:
            self._wake()  # the scheduler may resume this sequence
        return piece


class Request:
    """One submitted request: what its caller waits on, and the scheduler's bookkeeping.

    The caller side (``wait``, ``result``, ``cancel``, ``settle``) is thread
    safe; the fields below the marker are touched by the scheduler thread only.
    """

    def __init__(self, job: Job, *, outbox: Outbox | None = None, on_text: Callable[[str], None] | None = None) -> None:
        self.job = job
        self.outbox = outbox
        self.on_text = on_text
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.t_submit = -1
        self._scheduler: "Scheduler | None" = None
        # -- scheduler thread only --
        self.seq = -1
        self.admission = -1  # admission number (monotonic)
        self.out: SequenceOutput | None = None
        self.sampler: Sampler | None = None
        self.evaluated = 0  # prompt tokens in the KV
        self.cached = 0  # of which copied from a shared prefix entry
        self.pos = 0  # KV position of next_token
        self.next_token = -1  # sampled, not yet evaluated
        self.steps = 0
        self.step_tokens = 0
        self.peak = 0
        self.deferred = False  # waited for a shared prefix (counted once)

    def cancel(self) -> None:
        """Ask the scheduler to end this request with ``finish_reason="cancelled"``."""
        self.job.cancel.set()
        if self._scheduler is not None:
            self._scheduler.wake()

    def wait(self) -> None:
        """Block until the request has ended (finished, cancelled or failed)."""
        while not self.finished.wait(_POLL_S):
            pass

    def settle(self, ok: bool) -> None:
        """A stream's end callback: an unfinished request is cancelled and awaited."""
        if ok or self.finished.is_set():
            return
        self.cancel()
        if self._scheduler is not None and not self._scheduler.on_scheduler_thread():
            self.wait()

    def result(self) -> Response:
        """The Response, or the error that failed the request."""
        if self.error is not None:
            raise self.error
        assert self.job.result is not None
        return self.job.result

    @property
    def prefilling(self) -> bool:
        return self.evaluated < len(self.job.prompt_tokens)

    @property
    def stream_ready(self) -> bool:
        return self.outbox is None or self.outbox.has_room()


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


# The scheduler's own counters (the other SchedulerStats fields are settings or read off its state).
_COUNTED = (
    "completed", "cancelled", "failed", "steps", "evaluated_tokens", "decoded_tokens", "compactions", "padding_rows",
    "prefix_cache_waits",
)


# -- the scheduler thread -------------------------------------------------------------------


class Scheduler:
    """Runs admitted requests on one context, one ``llama_decode`` per step.

    Thread-safe entry points: ``submit``, ``wake``, ``shutdown``, ``stats``,
    ``guard``. The thread owns the context and the batch and frees both when
    it exits; ``on_exit`` (the lease's weight release) runs last.
    """

    def __init__(
        self,
        *,
        model: NativeModel,
        ctx: NativeContext,
        batch: Batch,
        max_sequences: int,
        batch_tokens: int,
        sequence_context: int,
        queue_limit: int,
        on_exit: Callable[[], None],
        pair_columns: bool = False,
        name: str = "aner-scheduler",
        admission: AdmissionPolicy | None = None,
        prefixes: SharedPrefixes | None = None,
    ) -> None:
        if batch.capacity < batch_tokens:
            raise ValueError(f"batch capacity {batch.capacity} < batch_tokens {batch_tokens}")
        self.model = model
        self.max_sequences = max_sequences
        self.batch_tokens = batch_tokens
        self.sequence_context = sequence_context
        self.queue_limit = queue_limit
        self.pair_columns = pair_columns
        self.admission: AdmissionPolicy = FifoAdmission() if admission is None else admission
        self.prefixes = prefixes  # its streams are sequence ids >= max_sequences
        self._ctx = ctx
        self._batch = batch
        self._on_exit = on_exit
        self._cv = threading.Condition()  # RLock inside: a finalizer on this thread may re-enter
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: list[Request] = []  # admission order
        self._free = list(range(max_sequences))  # kept sorted
        self._closed = False
        self._admissions = 0
        self._counts = dict.fromkeys(_COUNTED, 0)
        self._peak = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        _live.add(self)
        self._thread.start()

    # -- thread-safe API --------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def on_scheduler_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def guard(self, what: str) -> None:
        """Refuse work on the scheduler's own thread: waiting there would deadlock."""
        if self.on_scheduler_thread():
            raise BusyError(
                f"{what} on a batching lease from its own scheduler thread (a text callback or a "
                "finalizer) would deadlock; submit or read from another thread"
            )

    def submit(self, request: Request, *, block: bool = False) -> Request:
        """Queue ``request``; a full queue raises BusyError (or waits for room when ``block``)."""
        self.guard("submitting a request")
        request._scheduler = self
        with self._cv:
            while True:
                if self._closed:
                    raise ClosedError("this batching lease is closed; requests are not accepted")
                if len(self._waiting) < self.queue_limit:
                    break
                if not block:
                    raise BusyError(
                        f"the batching queue is full ({self.queue_limit} waiting, {len(self._active)} of "
                        f"{self.max_sequences} sequences running); retry later"
                    )
                self._cv.wait(_POLL_S)
            request.t_submit = _now()
            self._waiting.append(request)
            self._cv.notify_all()
        return request

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def shutdown(self, *, wait: bool = True, cancel: bool = False, timeout: float | None = None) -> None:
        """Accept nothing more; accepted requests finish (or are cancelled), then the thread exits.

        While closing, streams are no longer throttled by their consumers, so
        the drain always ends; unread pieces stay readable.
        """
        with self._cv:
            self._closed = True
            if cancel:
                for r in [*self._waiting, *self._active]:
                    r.job.cancel.set()
            self._cv.notify_all()
        if wait and not self.on_scheduler_thread() and self._thread.is_alive():
            self._thread.join(timeout)

    def stats(self) -> SchedulerStats:
        with self._cv:
            p = self.prefixes
            return SchedulerStats(
                prefix_cache_capacity=p.capacity if p else 0,
                prefix_cache_entries=len(p.entries) if p else 0,
                prefix_cache_retained_tokens=p.retained_tokens() if p else 0,
                prefix_cache_hits=p.hits if p else 0,
                prefix_cache_reused_tokens=p.reused_tokens if p else 0,
                max_sequences=self.max_sequences,
                sequence_context=self.sequence_context,
                queue_limit=self.queue_limit,
                batch_tokens=self.batch_tokens,
                active=len(self._active),
                waiting=len(self._waiting),
                admitted=self._admissions,
                peak_sequences=self._peak,
                closed=self._closed,
                running=self._thread.is_alive(),
                **self._counts,
            )

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        error: BaseException | None = None
        try:
            while self._cycle():
                pass
        except BaseException as exc:  # a bug or a native failure outside any one request
            log.exception("batching scheduler stopped by an error")
            error = exc
        finally:
            self._teardown(error)

    def _cycle(self) -> bool:
        """Admit, drop cancelled work, run one step; False once closed and drained."""
        with self._cv:
            dropped = [r for r in self._waiting if r.job.cancel.is_set()]
            for r in dropped:
                self._waiting.remove(r)
            admitted = self._admit_locked()
            if admitted or dropped:
                self._cv.notify_all()  # blocked submitters may have queue room now
            elif not self._has_work_locked():
                if self._closed and not self._active and not self._waiting:
                    return False
                self._cv.wait(_POLL_S)
                return True
        for r in dropped:
            self._finish_unadmitted(r)
        for r in admitted:
            try:
                self._start(r)
            except Exception as exc:  # e.g. the sampler could not be created
                self._fail(r, exc)
        for r in [r for r in self._active if r.job.cancel.is_set()]:
            self._complete(r, "cancelled")
        self._compact()
        self._step()
        return True

    def _admit_locked(self) -> list[Request]:
        """Start what the admission policy picks: each gets a free id next to the running ones."""
        chosen = list(self.admission.admit(self._eligible_locked(), tuple(self._free)))
        if len(chosen) > len(self._free) or len(set(map(id, chosen))) < len(chosen):
            raise ValueError(
                f"{type(self.admission).__name__} admitted a request twice or more requests than free sequence ids"
            )
        admitted = []
        for r in chosen:
            self._waiting.remove(r)
            r.seq = next_sequence_id([a.seq for a in self._active], self._free)
            self._free.remove(r.seq)
            r.admission = self._admissions
            self._admissions += 1
            self._active.append(r)
            admitted.append(r)
        return admitted

    def _eligible_locked(self) -> tuple[Request, ...]:
        """The queued requests that may start now: all of them, unless a shared prefix is worth waiting for.

        A request waits while a prompt being evaluated (or one admitted ahead
        of it in this pass) would, once retained, save it a long prefix.
        """
        p = self.prefixes
        if p is None or not self._free:
            return tuple(self._waiting)
        evaluating = [r.job.prompt_tokens for r in self._active if r.prefilling]
        eligible: list[Request] = []
        for r in self._waiting:
            if p.would_wait(r.job.prompt_tokens, evaluating):
                if not r.deferred:
                    r.deferred = True
                    self._counts["prefix_cache_waits"] += 1
                continue
            eligible.append(r)
            if len(eligible) <= len(self._free):  # those the policy can start in this pass
                evaluating.append(r.job.prompt_tokens)
        return tuple(eligible)

    def _has_work_locked(self) -> bool:
        return any(r.job.cancel.is_set() or r.prefilling or self._ready(r) for r in self._active)

    def _ready(self, r: Request) -> bool:
        # While closing, consumers no longer throttle: the drain must end even for unread streams.
        return self._closed or r.stream_ready

    def _start(self, r: Request) -> None:
        """Admission: the request's work (and its first-token clock) starts now."""
        job = r.job
        job.seq = r.seq
        r.out = SequenceOutput(self.model, job)  # its clock is the start of work
        job.add(QueueTimings(queue_duration=r.out.t_work - r.t_submit))
        for part in self._start_from_prefix(r):
            job.add(part)
        r.sampler = new_sampler(self.model, job.request, job.grammar, job.prompt_tokens)

    def _start_from_prefix(self, r: Request) -> tuple[TimingsPart, ...]:
        """Copy the best shared prefix into the request's stream; the timings parts say what was reused."""
        p = self.prefixes
        if p is None:
            return (PoolTimings(cached_input_tokens=0),)  # no pool: every prompt is evaluated
        t0 = _now()
        with self._cv:
            held = (len(p.entries), p.retained_tokens())  # as the request found them
        entry, keep = p.lookup(r.job.prompt_tokens)
        if entry is not None:
            # Across streams the whole stream is copied (positions and cell indices kept) during the
            # next llama_decode, before the batch runs; removing the tail here is bookkeeping only.
            self._ctx.seq_cp(entry.seq, r.seq)
            if self._ctx.trim(r.seq, keep):
                with self._cv:
                    p.used(entry, keep)
            else:  # cannot happen with a full SWA cache; never continue from a partial copy
                self._ctx.seq_rm(r.seq, 0, -1)
                keep = 0
        r.evaluated = r.cached = r.job.n_cached = keep
        hit = int(keep > 0)
        return (
            PoolTimings(cached_input_tokens=keep, context_clear_duration=_now() - t0, context_pool_reused=hit),
            PrefixCacheTimings(prefix_cache_hit=hit, prefix_cache_entries=held[0], prefix_cache_retained_tokens=held[1]),
        )

    def _retain(self, r: Request) -> None:
        """Keep the prefix of a prompt that has just been evaluated in a spare stream, if worth it."""
        p = self.prefixes
        if p is None:
            return
        with self._cv:
            placed = p.placement(r.job.prompt_tokens)
        if placed is None:
            return
        seq, tokens = placed
        self._ctx.seq_rm(seq, 0, -1)
        self._ctx.seq_cp(r.seq, seq)  # the stream as it is now: exactly the prompt (queued before any decode row)
        with self._cv:
            if self._ctx.trim(seq, len(tokens)):
                p.store(seq, tokens)
            else:
                self._ctx.seq_rm(seq, 0, -1)
                p.drop(seq)

    def _compact(self) -> None:
        """Close gaps between active sequence ids (see :func:`compaction_moves`)."""
        with self._cv:
            if self._waiting:
                return  # queued work fills the gaps on the next admission
            moves = compaction_moves([r.seq for r in self._active], self.max_sequences)
        for src, dst in moves:
            r = next(r for r in self._active if r.seq == src)
            if r.evaluated:
                # Across KV streams llama.cpp copies the whole stream buffer (cells keep their
                # indices and positions) during the next llama_decode, before the batch runs.
                pos_max = self._ctx.seq_pos_max(src)
                self._ctx.seq_cp(src, dst)
                if self._ctx.seq_pos_max(dst) != pos_max:
                    self._ctx.seq_rm(dst, 0, -1)
                    self._fail(r, EngineError(f"moving this request's KV from sequence {src} to {dst} failed"))
                    continue
                self._ctx.seq_rm(src, 0, -1)
            with self._cv:
                self._free.remove(dst)
                self._free.append(src)
                self._free.sort()
                self._counts["compactions"] += 1
            r.seq = r.job.seq = dst

    # -- one step: plan, execute, update ----------------------------------------------
    def _step(self) -> None:
        """Plan the batch from plain numbers, run it with one ``llama_decode``, apply the results."""
        plan = self._plan()
        if plan is None:
            return
        by_seq = {r.seq: r for r in self._active}
        if self._execute(plan, by_seq):
            self._update(plan, by_seq)

    def _plan(self) -> BatchPlan | None:
        """The step's :class:`BatchPlan`, or None when no sequence has anything to evaluate."""
        decoding = [r.seq for r in self._active if not r.prefilling and self._ready(r)]
        prefilling = [(r.seq, len(r.job.prompt_tokens) - r.evaluated) for r in self._active if r.prefilling]
        if not decoding and not prefilling:
            return None
        return plan_batch(
            decoding, prefilling, self.batch_tokens, pair_columns=self.pair_columns,
            active=[r.seq for r in self._active], free=self._free,
        )

    def _fill(self, plan: BatchPlan, by_seq: dict[int, Request]) -> None:
        """Write the planned rows into the batch; logits only where the plan samples or pads."""
        batch = self._batch
        batch.clear()
        for rows in plan.rows:
            if rows.kind == PAD:  # any token at position 0 of the empty id: its cell is removed after the step
                row = batch.add(max(self.model.bos, 0), 0, rows.seq, logits=True)
            elif rows.kind == DECODE:
                r = by_seq[rows.seq]
                row = batch.add(r.next_token, r.pos, rows.seq, logits=True)
            else:
                r = by_seq[rows.seq]
                lo = r.evaluated  # prompt tokens already in the KV, at positions 0..lo-1
                row = batch.add_run(r.job.prompt_tokens[lo : lo + rows.count], lo, rows.seq, logits_last=rows.sampled)
            assert row == rows.last, (row, rows)
        if plan.spare_row >= 0:
            batch.mark_output(plan.spare_row)

    def _execute(self, plan: BatchPlan, by_seq: dict[int, Request]) -> bool:
        """Fill the batch and run one ``llama_decode``; False when the step failed (and who it failed)."""
        self._fill(plan, by_seq)
        participants = [by_seq[seq] for seq in plan.participants]
        try:
            rc = self._decode(self._batch, plan.pad_seq)
        except EngineError as exc:
            # A failed llama_decode leaves the batch's sequences in an unknown KV state.
            for r in participants:
                self._fail(r, EngineError(f"this request's batch failed: {exc}"))
            return False
        if rc == DECODE_NO_KV_SLOT:
            # Nothing of the batch was stored; everyone else retries unchanged next step.
            victim = kv_victim([(r.seq, r.admission, r.prefilling) for r in participants])
            self._fail(by_seq[victim], EngineError(
                f"no KV slot for this request's step ({plan.step.n_tokens} tokens of {len(participants)} sequences, "
                f"{self.sequence_context} cells per sequence); the request was failed and the others continue: "
                "retry it, or lower max_tokens, or use fewer sequences or a larger context"
            ))
            return False
        return True

    def _update(self, plan: BatchPlan, by_seq: dict[int, Request]) -> None:
        """Apply a decoded step: counters, KV positions, prompt progress, then sample every sampled row."""
        t_done = _now()
        n_tokens, n_seqs = plan.n_tokens, len(plan.participants)
        with self._cv:
            self._counts["steps"] += 1
            self._counts["evaluated_tokens"] += n_tokens
            self._counts["decoded_tokens"] += len(plan.sampled)
            self._counts["padding_rows"] += plan.padded
            self._peak = max(self._peak, n_seqs)
        for rows in plan.rows:
            if rows.kind == PAD:
                continue
            r = by_seq[rows.seq]
            r.steps += 1
            r.step_tokens += n_tokens
            r.peak = max(r.peak, n_seqs)
            if rows.kind == DECODE:
                r.pos += 1
                r.out.decode_calls += 1
                continue
            r.evaluated += rows.count
            if not r.prefilling:  # the whole prompt is in the KV: the first sampled token goes after it
                r.pos = r.evaluated
                r.out.prompt_eval_duration = t_done - r.out.t_work
                self._retain(r)
        for seq, row in plan.sampled:
            self._sample(by_seq[seq], row)

    def _decode(self, batch: Batch, pad_seq: int) -> int:
        """One ``llama_decode``; a padding row's cell is removed again whatever the outcome."""
        try:
            return self._ctx.decode(batch)
        finally:
            if pad_seq >= 0 and not self._ctx.seq_rm(pad_seq, 0, -1):
                raise EngineError(f"llama.cpp refused to clear padding sequence {pad_seq}")

    def _sample(self, r: Request, row: int) -> None:
        out = r.out
        try:
            token = self._ctx.greedy(row) if r.sampler is None else r.sampler.sample(self._ctx, row)
            piece = out.accept(token)
            if piece:
                self._deliver(r, piece)
            if out.finished:
                tail = out.tail()
                if tail:
                    self._deliver(r, tail)
                self._complete(r, None)
            else:
                r.next_token = token
        except BaseException as exc:  # a text callback or the tokenizer failed: this request only
            self._fail(r, exc)

    def _deliver(self, r: Request, piece: str) -> None:
        if r.on_text is not None:
            r.on_text(piece)
        if r.outbox is not None:
            r.outbox.put(piece)

    def _batch_timings(self, r: Request) -> BatchTimings:
        return BatchTimings(
            batch_max_sequences=self.max_sequences,
            batch_peak_sequences=r.peak,
            scheduler_steps=r.steps,
            batch_decoded_tokens=r.step_tokens,
        )

    def _complete(self, r: Request, reason: str | None) -> None:
        """End an admitted request with its Response (``reason`` overrides, e.g. cancelled)."""
        out = r.out
        r.job.add(self._batch_timings(r))
        out.evaluated_prompt_tokens = r.evaluated - r.cached
        response = out.response(reason)
        self._release(r)
        with self._cv:
            self._counts["cancelled" if response.finish_reason == "cancelled" else "completed"] += 1
        self._signal(r)

    def _finish_unadmitted(self, r: Request) -> None:
        """A request cancelled while still queued: a cancelled Response, no KV touched."""
        out = SequenceOutput(self.model, r.job)
        r.job.add(QueueTimings(queue_duration=out.t_work - r.t_submit))
        r.job.add(PoolTimings(cached_input_tokens=0))
        r.job.add(self._batch_timings(r))
        out.evaluated_prompt_tokens = 0
        out.response("cancelled")
        with self._cv:
            self._counts["cancelled"] += 1
        self._signal(r)

    def _fail(self, r: Request, error: BaseException) -> None:
        r.error = error
        if r in self._active:
            self._release(r)
        with self._cv:
            self._counts["failed"] += 1
        self._signal(r)

    def _release(self, r: Request) -> None:
        """Free the request's KV cells, sampler and sequence id for the next admission."""
        if r.sampler is not None:
            r.sampler.free()
            r.sampler = None
        with self._cv:
            self._active.remove(r)
        if not self._ctx.seq_rm(r.seq, 0, -1):  # a whole-sequence removal cannot be refused
            raise EngineError(f"llama.cpp refused to clear sequence {r.seq}")
        with self._cv:
            self._free.append(r.seq)
            self._free.sort()
            self._cv.notify_all()

    @staticmethod
    def _signal(r: Request) -> None:
        if r.outbox is not None:
            r.outbox.close()
        r.finished.set()

    def _teardown(self, error: BaseException | None) -> None:
        with self._cv:
            self._closed = True
            left = [*self._active, *self._waiting]
            self._waiting.clear()
            self._active.clear()
        reason = f"the batching scheduler stopped: {error}" if error is not None else "the batching lease was shut down"
        try:
            for r in left:
                if r.error is None and not r.finished.is_set():
                    r.error = EngineError(reason)
                    self._signal(r)
            # Every owner is freed even if freeing one raises (the first error is logged below).
            free_all([*(r.sampler for r in left if r.sampler is not None), self._batch, self._ctx])
        except BaseException:
            log.exception("freeing the batching scheduler's native state failed")
        finally:
            _live.discard(self)
            self._on_exit()


# At interpreter exit, running schedulers are cancelled and joined before the
# weights' own finalizers run, so no thread decodes on a freed model. A
# finalize is created first so that weakref's exit hook is registered before
# ours and therefore runs after it (atexit is last in, first out).
_live: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()
weakref.finalize(_live, lambda: None).atexit = True


@atexit.register
def _stop_all_at_exit() -> None:
    for scheduler in list(_live):
        scheduler.shutdown(wait=True, cancel=True, timeout=10.0)
