"""Continuous batching: the scheduler thread, one ``llama_decode`` per step on one shared context.

The :class:`Scheduler` is one thread that owns the context and runs the
step policy (:mod:`aner_nb.llm.step_policy`, which also explains the context
split and the row layout) against the engine. Nothing else ever touches the
context (a llama.cpp context is not thread safe). A step is split as in
vLLM v1: *plan* (:func:`~aner_nb.llm.step_policy.plan_batch`, pure, from the
plain numbers of the running sequences), *execute* (fill the batch, one
``llama_decode``) and *update* (positions, counters, phases, sampling).

Each request's state is one :class:`~aner_nb.llm.sequence.SequenceState`
with an explicit phase (WAITING, PREFILL, DECODE, then FINISHED, CANCELLED
or FAILED); the caller's handle and its stream are in
:mod:`aner_nb.llm.outbox`, the counters the scheduler reports
(:class:`~aner_nb.llm.scheduler_stats.SchedulerStats`) in
:mod:`aner_nb.llm.scheduler_stats`.

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
"""

from __future__ import annotations

import atexit
import dataclasses
import collections
import logging
import threading
import time
import weakref
from typing import Callable

from ._engine import DECODE_NO_KV_SLOT, Batch, NativeContext, NativeModel, release_compute_threads
from .context_pool import free_all
from .errors import BusyError, ClosedError, EngineError
from .outbox import POLL_S, Request
from .runner import SequenceOutput, SpeculationCounts, keep_accepted, verify_drafts
from .sampling import new_sampler
from .scheduler_stats import SchedulerCounters, SchedulerStats, stat_fields
from .sequence import ENDED, Phase, SequenceState
from .shared_prefix import SharedPrefixes
from .draft_policy import batch_drafts
from .speculation import Speculator
from .step_policy import (DECODE, PAD, AdmissionPolicy, BatchPlan, FifoAdmission, Rows, compaction_moves,
                          draft_room, kv_victim, next_sequence_id, plan_batch)
from .prefix_tiers import TIER_CODES
from .timings import BatchTimings, PoolTimings, PrefixCacheTimings, PrefixTierTimings, QueueTimings, TimingsPart

# ``stat_fields`` and ``SchedulerStats`` are also imported from here (aner_nb.api.metrics,
# aner_nb.widgets.batching, aner_nb.llm).
__all__ = ["Scheduler", "SchedulerStats", "stat_fields"]

log = logging.getLogger("aner_nb.scheduler")
_now = time.perf_counter_ns


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
        speculator: Speculator | None = None,
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
        # Prompt lookup for plain greedy requests: measured row costs, the lease's corpus (this thread only).
        self.speculator = speculator
        self._fresh_streams: set[int] = set()
        self._ctx = ctx
        self._batch = batch
        self._on_exit = on_exit
        self._cv = threading.Condition()  # RLock inside: a finalizer on this thread may re-enter
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._active: list[SequenceState] = []  # admission order: the PREFILL and DECODE sequences
        self._free = list(range(max_sequences))  # kept sorted
        self._closed = False
        self._admissions = 0
        self._counts = SchedulerCounters()
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
        sequence = request.sequence
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
                self._cv.wait(POLL_S)
            sequence.t_submit = _now()
            self._waiting.append(sequence)
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
                prefix_cache_entries=p.entries if p else 0,
                prefix_cache_retained_tokens=p.held_tokens if p else 0,
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
                **dataclasses.asdict(self._counts),
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
                self._cv.wait(POLL_S)
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
        if not self._active:
            # Nothing left to decode: free this thread's OpenMP workers, or their team would slow the decodes
            # of every other thread (a latency lease's) while this lease is idle (release_compute_threads).
            release_compute_threads()
        return True

    def _admit_locked(self) -> list[SequenceState]:
        """Start what the admission policy picks: each gets a free id next to the running ones."""
        chosen = list(self.admission.admit(self._eligible_locked(), tuple(self._free)))
        if len(chosen) > len(self._free) or len(set(map(id, chosen))) < len(chosen):
            raise ValueError(
                f"{type(self.admission).__name__} admitted a request twice or more requests than free sequence ids"
            )
        admitted = []
        for r in chosen:
            self._waiting.remove(r)
            r.admit(next_sequence_id([a.seq for a in self._active], self._free), self._admissions)
            self._free.remove(r.seq)
            self._admissions += 1
            self._active.append(r)
            admitted.append(r)
        return admitted

    def _eligible_locked(self) -> tuple[SequenceState, ...]:
        """The queued requests that may start now: all of them, unless a shared prefix is worth waiting for.

        A request waits while a prompt being evaluated (or one admitted ahead
        of it in this pass) would, once retained, save it a long prefix.
        """
        p = self.prefixes
        if p is None or not self._free:
            return tuple(self._waiting)
        evaluating = [r.job.prompt_tokens for r in self._active if r.prefilling]
        eligible: list[SequenceState] = []
        for r in self._waiting:
            if p.would_wait(r.job.prompt_tokens, evaluating):
                if not r.deferred:
                    r.deferred = True
                    self._counts.prefix_cache_waits += 1
                continue
            eligible.append(r)
            if len(eligible) <= len(self._free):  # those the policy can start in this pass
                evaluating.append(r.job.prompt_tokens)
        return tuple(eligible)

    def _has_work_locked(self) -> bool:
        return any(r.job.cancel.is_set() or r.prefilling or self._ready(r) for r in self._active)

    def _ready(self, r: SequenceState) -> bool:
        # While closing, consumers no longer throttle: the drain must end even for unread streams.
        return self._closed or r.stream_ready

    def _start(self, r: SequenceState) -> None:
        """Admission: the request's work (and its first-token clock) starts now."""
        job = r.job
        r.out = SequenceOutput(self.model, job)  # its clock is the start of work
        job.add(QueueTimings(queue_duration=r.out.t_work - r.t_submit))
        for part in self._start_from_prefix(r):
            job.add(part)
        r.sampler = new_sampler(self.model, job.request, job.grammar, job.prompt_tokens)
        if self.speculator is not None and job.request.plain_argmax and r.sampler is None:
            # Plain greedy requests speculate; sampled or constrained ones decode one token per step.
            r.drafts_of = self.speculator.start(job.prompt_tokens)
            r.out.speculation = SpeculationCounts()

    def _start_from_prefix(self, r: SequenceState) -> tuple[TimingsPart, ...]:
        """Copy the best shared prefix into the request's stream; the timings parts say what was reused."""
        p = self.prefixes
        if p is None:
            return (PoolTimings(cached_input_tokens=0),)  # no pool: every prompt is evaluated
        t0 = _now()
        with self._cv:
            held = (p.entries, p.held_tokens)  # as the request found them
        entry, keep = p.lookup(r.job.prompt_tokens)
        store, restored = p.tiers, None
        if store is not None:  # a longer prefix in the RAM / disk tiers is loaded straight into this stream
            restored = store.restore(self._ctx, r.seq, r.job.prompt_tokens, better_than=keep)
            if restored is not None:
                entry, keep = None, restored.keep
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
        r.start_from(keep)
        hit = int(keep > 0)
        parts: tuple[TimingsPart, ...] = (
            PoolTimings(cached_input_tokens=keep, context_clear_duration=_now() - t0, context_pool_reused=hit),
            PrefixCacheTimings(prefix_cache_hit=hit, prefix_cache_entries=held[0], prefix_cache_retained_tokens=held[1]),
        )
        if store is not None:
            tier = restored.tier if restored is not None else ("live" if keep > 0 else "cold")
            parts += (PrefixTierTimings(
                prefix_cache_tier=TIER_CODES[tier],
                prefix_restored_tokens=restored.keep if restored is not None else 0,
                prefix_tier_bytes_read=restored.bytes_read if restored is not None else 0,
                prefix_restore_duration=restored.duration if restored is not None else -1,
            ),)
        return parts

    def _retain(self, r: SequenceState) -> None:
        """Keep the prefix of a prompt that has just been evaluated in a spare stream, if worth it."""
        p = self.prefixes
        if p is None:
            return
        if p.tiers is not None:  # write-through: this stream holds exactly the evaluated prompt now
            p.tiers.save(self._ctx, r.seq, r.job.prompt_tokens, ram=False, disk=True)
        with self._cv:
            placed = p.placement(r.job.prompt_tokens)
        if placed is None:
            return
        seq, tokens = placed
        old = next((e for e in p.held() if e.seq == seq), None)
        if p.tiers is not None and old is not None and seq not in self._fresh_streams:
            # The entry leaves live KV: keep it in the tiers. (A stream filled by a copy in this
            # step is not materialised before the next decode, so it is not saved.)
            p.tiers.save(self._ctx, seq, old.tokens, ram=True, disk=True)
        self._fresh_streams.add(seq)
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
                self._counts.compactions += 1
            r.move_to(dst)

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
        decoding = [r.seq for r in self._active if r.decoding and self._ready(r)]
        prefilling = [(r.seq, r.prompt_left) for r in self._active if r.prefilling]
        if not decoding and not prefilling:
            return None
        return plan_batch(
            decoding, prefilling, self.batch_tokens, pair_columns=self.pair_columns,
            active=[r.seq for r in self._active], free=self._free, drafts=self._drafts(decoding, prefilling),
        )

    def _drafts(self, decoding: list[int], prefilling: list[tuple[int, int]]) -> dict[int, int]:
        """Proposals per decoding sequence for this step (:func:`batch_drafts`); each keeps its draft's tokens."""
        if self.speculator is None:
            return {}
        step, room = draft_room(decoding, prefilling, self.batch_tokens)
        offers, drafts = [], {}
        for r in self._active:
            r.pending_drafts = []
            if r.drafts_of is None or r.seq not in decoding or room <= 0:
                continue
            assert r.out is not None
            # Room: the output limit, and the sequence's own KV cells (positions pos+1.. hold proposals).
            left = min(r.job.request.max_tokens - len(r.out.tokens), self.sequence_context - r.pos) - 1
            offered = r.drafts_of.offer(left)
            if offered is not None and offered[2] > 0:
                drafts[r.seq] = (r, offered[0])
                offers.append((r.seq, offered[1], offered[2]))
        # a multi-stream batch runs as micro-batches of consecutive ids with equal rows each (step_policy.micro_batches)
        chosen = batch_drafts(offers, len(decoding), step.n_tokens, room, self.speculator.costs,
                              layout=step.layout(), n_ubatch=self._ctx.params.n_ubatch)
        for seq, d in chosen.items():
            r, draft = drafts[seq]
            r.pending_drafts = r.drafts_of.take(draft, d)  # type: ignore[union-attr]
        return chosen

    def _fill(self, plan: BatchPlan, by_seq: dict[int, SequenceState]) -> None:
        """Write the planned rows into the batch; logits only where the plan samples or pads."""
        batch = self._batch
        batch.clear()
        for rows in plan.rows:
            if rows.kind == PAD:  # any token at position 0 of the empty id: its cell is removed after the step
                row = batch.add(max(self.model.bos, 0), 0, rows.seq, logits=True)
            elif rows.kind == DECODE:
                r = by_seq[rows.seq]
                row = batch.add(r.next_token, r.pos, rows.seq, logits=True)
                for i, token in enumerate(r.pending_drafts):  # proposals go right after it, each with logits
                    row = batch.add(token, r.pos + 1 + i, rows.seq, logits=True)
            else:
                r = by_seq[rows.seq]
                lo = r.evaluated  # prompt tokens already in the KV, at positions 0..lo-1
                row = batch.add_run(r.job.prompt_tokens[lo : lo + rows.count], lo, rows.seq, logits_last=rows.sampled)
            assert row == rows.last, (row, rows)
        if plan.spare_row >= 0:
            batch.mark_output(plan.spare_row)

    def _execute(self, plan: BatchPlan, by_seq: dict[int, SequenceState]) -> bool:
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

    def _update(self, plan: BatchPlan, by_seq: dict[int, SequenceState]) -> None:
        """Apply a decoded step: counters, KV positions, prompt progress, then sample every sampled row."""
        t_done = _now()
        n_tokens, n_seqs = plan.n_tokens, len(plan.participants)
        with self._cv:
            self._counts.steps += 1
            self._counts.evaluated_tokens += n_tokens
            self._counts.decoded_tokens += len(plan.sampled)
            self._counts.padding_rows += plan.padded
            self._peak = max(self._peak, n_seqs)
        self._fresh_streams = set()  # streams a copy fills during this step's bookkeeping
        for rows in plan.rows:
            if rows.kind == PAD:
                continue
            r = by_seq[rows.seq]
            r.took_part(n_tokens, n_seqs)
            if rows.kind == DECODE:
                r.fed()
            elif r.evaluated_chunk(rows.count):  # the whole prompt is in the KV: the first sampled token goes after it
                r.out.prompt_eval_duration = t_done - r.out.t_work
                self._retain(r)
        for rows in plan.rows:
            if rows.kind == PAD or not rows.sampled:
                continue
            if rows.drafts:
                self._verify(by_seq[rows.seq], rows)
            else:
                self._sample(by_seq[rows.seq], rows.last)

    def _decode(self, batch: Batch, pad_seq: int) -> int:
        """One ``llama_decode``; a padding row's cell is removed again whatever the outcome."""
        try:
            return self._ctx.decode(batch)
        finally:
            if pad_seq >= 0 and not self._ctx.seq_rm(pad_seq, 0, -1):
                raise EngineError(f"llama.cpp refused to clear padding sequence {pad_seq}")

    def _sample(self, r: SequenceState, row: int) -> None:
        try:
            token = self._ctx.greedy(row) if r.sampler is None else r.sampler.sample(self._ctx, row)
            self._emit(r, [(token, row)])
        except BaseException as exc:  # a text callback or the tokenizer failed: this request only
            self._fail(r, exc)

    def _verify(self, r: SequenceState, rows: Rows) -> None:
        """Greedy verification of ``[next_token, d0, ..]``: keep the agreeing proposals, drop the rest's KV.

        The runner's rule and bookkeeping (:func:`~aner_nb.llm.runner.verify_drafts`,
        :func:`~aner_nb.llm.runner.keep_accepted`) on this sequence's rows of the step.
        """
        try:
            drafts = r.pending_drafts
            tokens = verify_drafts(self._ctx, drafts, rows.first)
            accepted = len(tokens) - 1
            # fed() moved pos past next_token; the accepted proposals follow it in the stream's KV.
            r.pos = keep_accepted(self._ctx, r.out, r.drafts_of, r.pos - 1, drafts, accepted)
            with self._cv:
                self._counts.decoded_tokens += accepted  # the step counted one token for this sequence
            self._emit(r, [(token, rows.first + i) for i, token in enumerate(tokens)])
        except BaseException as exc:
            self._fail(r, exc)

    def _emit(self, r: SequenceState, tokens: list[tuple[int, int]]) -> None:
        """Accept verified ``(token, logits row)`` pairs in order until the request ends; the last is fed next."""
        out = r.out
        for token, row in tokens:
            piece = out.accept(token, out.score(self._ctx, row, token))  # logprobs from this row (if asked)
            if piece:
                r.deliver(piece)
            if out.finished:
                tail = out.tail()
                if tail:
                    r.deliver(tail)
                self._complete(r, None)
                return
        if r.drafts_of is not None:
            r.drafts_of.extend([token for token, _ in tokens])
        r.next_token = tokens[-1][0]

    def _batch_timings(self, r: SequenceState) -> BatchTimings:
        return BatchTimings(
            batch_max_sequences=self.max_sequences,
            batch_peak_sequences=r.peak,
            scheduler_steps=r.steps,
            batch_decoded_tokens=r.step_tokens,
        )

    def _complete(self, r: SequenceState, reason: str | None) -> None:
        """End an admitted request with its Response (``reason`` overrides, e.g. cancelled)."""
        out = r.out
        r.job.add(self._batch_timings(r))
        out.evaluated_prompt_tokens = r.evaluated - r.cached
        response = out.response(reason)
        if r.drafts_of is not None and response.finish_reason != "cancelled":
            r.drafts_of.finish(out.tokens)  # the lease's corpus: a later request may repeat this answer
        self._release(r)
        phase = Phase.CANCELLED if response.finish_reason == "cancelled" else Phase.FINISHED
        with self._cv:
            if phase is Phase.CANCELLED:
                self._counts.cancelled += 1
            else:
                self._counts.completed += 1
        r.end(phase)

    def _finish_unadmitted(self, r: SequenceState) -> None:
        """A request cancelled while still queued: a cancelled Response, no KV touched."""
        out = SequenceOutput(self.model, r.job)
        r.job.add(QueueTimings(queue_duration=out.t_work - r.t_submit))
        r.job.add(PoolTimings(cached_input_tokens=0))
        r.job.add(self._batch_timings(r))
        out.evaluated_prompt_tokens = 0
        out.response("cancelled")
        with self._cv:
            self._counts.cancelled += 1
        r.end(Phase.CANCELLED)

    def _fail(self, r: SequenceState, error: BaseException) -> None:
        r.error = error  # recorded first: it stands even if freeing the sequence raises
        if r in self._active:
            self._release(r)
        with self._cv:
            self._counts.failed += 1
        r.end(Phase.FAILED)

    def _release(self, r: SequenceState) -> None:
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

    def _teardown(self, error: BaseException | None) -> None:
        with self._cv:
            self._closed = True
            left = [*self._active, *self._waiting]
            self._waiting.clear()
            self._active.clear()
        reason = f"the batching scheduler stopped: {error}" if error is not None else "the batching lease was shut down"
        try:
            for r in left:
                if r.error is None and r.phase not in ENDED:
                    r.end(Phase.FAILED, EngineError(reason))
            # Every owner is freed even if freeing one raises (the first error is logged below).
            free_all([*(r.sampler for r in left if r.sampler is not None), self._batch, self._ctx])
        except BaseException:
            log.exception("freeing the batching scheduler's native state failed")
        finally:
            if self.prefixes is not None and self.prefixes.tiers is not None:
                try:  # the disk tier's queued writes land before the lease reports closed
                    self.prefixes.tiers.close()
                except BaseException:
                    log.exception("closing the prefix tiers failed")
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
