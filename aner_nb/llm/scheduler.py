"""Continuous batching: many requests decoded together on one shared context.

Two parts:

* The step **policy**, plain functions over plain numbers that unit tests
  exercise without a model: admission (:func:`admit_count`), how a step's
  token budget is shared (:func:`share_budget`, :func:`plan_step`), how the
  rows of a step are laid out (:meth:`StepPlan.layout`), which sequence id
  a request gets (:func:`next_sequence_id`) and which sequences move to close
  gaps between ids (:func:`compaction_moves`), and which request gives way
  when the KV has no room (:func:`kv_victim`).
* The :class:`Scheduler`, one thread that owns the context and runs the
  policy against the engine: one ``llama_decode`` per step. Nothing else
  ever touches the context (a llama.cpp context is not thread safe).

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
Admission is first in, first out.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

from ._engine import DECODE_NO_KV_SLOT, Batch, NativeContext, NativeModel, Sampler
from .errors import BusyError, ClosedError, EngineError
from .response import Response
from .runner import Job, SequenceOutput
from .timings import BatchTimings, QueueTimings

__all__ = [
    "StepPlan",
    "SchedulerStats",
    "Outbox",
    "Request",
    "Scheduler",
    "admit_count",
    "share_budget",
    "plan_step",
    "next_sequence_id",
    "compaction_moves",
    "kv_victim",
    "output_rows",
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
        self.pos = 0  # KV position of next_token
        self.next_token = -1  # sampled, not yet evaluated
        self.steps = 0
        self.step_tokens = 0
        self.peak = 0

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


@dataclass(frozen=True)
class SchedulerStats:
    """Counters of one scheduler since it started, read together under its lock (a snapshot).

    Field names follow the batching monitor's protocol (``aner_nb.widgets.batching``).
    """

    max_sequences: int
    sequence_context: int  # KV cells of each sequence id
    queue_limit: int
    batch_tokens: int
    active: int
    waiting: int
    admitted: int
    completed: int
    cancelled: int
    failed: int
    steps: int  # llama_decode calls
    evaluated_tokens: int  # batch rows evaluated: prompt chunks and fed tokens
    decoded_tokens: int  # tokens sampled (one per logits row read)
    peak_sequences: int
    compactions: int
    padding_rows: int  # logits rows requested only to keep the output kernel to one pass
    closed: bool
    running: bool


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
    ) -> None:
        if batch.capacity < batch_tokens:
            raise ValueError(f"batch capacity {batch.capacity} < batch_tokens {batch_tokens}")
        self.model = model
        self.max_sequences = max_sequences
        self.batch_tokens = batch_tokens
        self.sequence_context = sequence_context
        self.queue_limit = queue_limit
        self.pair_columns = pair_columns
        self._ctx = ctx
        self._batch = batch
        self._on_exit = on_exit
        self._cv = threading.Condition()  # RLock inside: a finalizer on this thread may re-enter
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: list[Request] = []  # admission order
        self._free = list(range(max_sequences))  # kept sorted
        self._closed = False
        self._admissions = 0
        self._counts: collections.Counter[str] = collections.Counter()
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
            c = self._counts
            return SchedulerStats(
                max_sequences=self.max_sequences,
                sequence_context=self.sequence_context,
                queue_limit=self.queue_limit,
                batch_tokens=self.batch_tokens,
                active=len(self._active),
                waiting=len(self._waiting),
                admitted=self._admissions,
                completed=c["completed"],
                cancelled=c["cancelled"],
                failed=c["failed"],
                steps=c["steps"],
                evaluated_tokens=c["evaluated_tokens"],
                decoded_tokens=c["decoded_tokens"],
                peak_sequences=self._peak,
                compactions=c["compactions"],
                padding_rows=c["padding_rows"],
                closed=self._closed,
                running=self._thread.is_alive(),
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
        admitted = []
        for _ in range(admit_count(len(self._waiting), len(self._free))):
            r = self._waiting.popleft()
            r.seq = next_sequence_id([a.seq for a in self._active], self._free)
            self._free.remove(r.seq)
            r.admission = self._admissions
            self._admissions += 1
            self._active.append(r)
            admitted.append(r)
        return admitted

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
        if not job.request.greedy:
            r.sampler = Sampler(job.request.temperature, job.request.seed)

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

    def _step(self) -> None:
        decoding = [r for r in self._active if not r.prefilling and self._ready(r)]
        prefilling = [r for r in self._active if r.prefilling]
        if not decoding and not prefilling:
            return
        plan = plan_step([r.seq for r in decoding], [(r.seq, len(r.job.prompt_tokens) - r.evaluated) for r in prefilling], self.batch_tokens)
        by_seq = {r.seq: r for r in self._active}
        layout = list(plan.layout())
        finishing = [seq for seq, n in plan.prefill if by_seq[seq].evaluated + n == len(by_seq[seq].job.prompt_tokens)]
        sampled = len(plan.decode) + len(finishing)
        pad = output_rows(sampled, self.pair_columns) > sampled
        # The extra logits row: a prompt row that is not sampled if the step has one, else a
        # token of its own in an empty sequence id next to the active ones (one micro-batch),
        # whose cell is removed right after the step.
        prompt_rows = plan.n_tokens - len(plan.decode)
        pad_seq = -1
        if pad and prompt_rows == len(finishing) and self._free and plan.n_tokens < self.batch_tokens:
            pad_seq = next_sequence_id(list(by_seq), self._free)
            layout = sorted([*layout, (pad_seq, 1)])
        batch = self._batch
        batch.clear()
        rows: list[tuple[Request, int]] = []  # (request, logits row) for every row that is sampled
        chunks: list[tuple[Request, int]] = []
        spare = -1
        for seq, n in layout:
            if seq == pad_seq:
                batch.add(max(self.model.bos, 0), 0, seq, logits=True)
                continue
            r = by_seq[seq]
            if r.prefilling:
                prompt, lo = r.job.prompt_tokens, r.evaluated
                last = lo + n == len(prompt)
                row = batch.add_run(prompt[lo : lo + n], lo, seq, logits_last=last)
                chunks.append((r, n))
                if last:
                    rows.append((r, row))
                    if n > 1:
                        spare = row - 1
                else:
                    spare = row
            else:
                rows.append((r, batch.add(r.next_token, r.pos, seq, logits=True)))
        padded = pad and (pad_seq >= 0 or spare >= 0)
        if pad and pad_seq < 0 and spare >= 0:
            batch.mark_output(spare)
        participants = [by_seq[seq] for seq, _ in layout if seq != pad_seq]
        try:
            rc = self._decode(batch, pad_seq)
        except EngineError as exc:
            # A failed llama_decode leaves the batch's sequences in an unknown KV state.
            for r in participants:
                self._fail(r, EngineError(f"this request's batch failed: {exc}"))
            return
        if rc == DECODE_NO_KV_SLOT:
            # Nothing of the batch was stored; everyone else retries unchanged next step.
            victim = kv_victim([(r.seq, r.admission, r.prefilling) for r in participants])
            self._fail(by_seq[victim], EngineError(
                f"no KV slot for this request's step ({plan.n_tokens} tokens of {len(participants)} sequences, "
                f"{self.sequence_context} cells per sequence); the request was failed and the others continue: "
                "retry it, or lower max_tokens, or use fewer sequences or a larger context"
            ))
            return
        t_done = _now()
        n_tokens, n_seqs = batch.n_tokens, len(participants)
        with self._cv:
            self._counts["steps"] += 1
            self._counts["evaluated_tokens"] += n_tokens
            self._counts["decoded_tokens"] += len(rows)
            self._counts["padding_rows"] += padded
            self._peak = max(self._peak, n_seqs)
        for r in participants:
            r.steps += 1
            r.step_tokens += n_tokens
            r.peak = max(r.peak, n_seqs)
            if not r.prefilling:
                r.pos += 1
                r.out.decode_calls += 1
        for r, n in chunks:
            r.evaluated += n
            if not r.prefilling:
                r.pos = r.evaluated
                r.out.prompt_eval_duration = t_done - r.out.t_work
        for r, row in rows:
            self._sample(r, row)

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
        out.evaluated_prompt_tokens = r.evaluated
        response = out.response(reason)
        self._release(r)
        with self._cv:
            self._counts["cancelled" if response.finish_reason == "cancelled" else "completed"] += 1
        self._signal(r)

    def _finish_unadmitted(self, r: Request) -> None:
        """A request cancelled while still queued: a cancelled Response, no KV touched."""
        out = SequenceOutput(self.model, r.job)
        r.job.add(QueueTimings(queue_duration=out.t_work - r.t_submit))
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
                if r.sampler is not None:
                    r.sampler.free()
                if r.error is None and not r.finished.is_set():
                    r.error = EngineError(reason)
                    self._signal(r)
            self._batch.free()
            self._ctx.free()
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
