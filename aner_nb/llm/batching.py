"""``BatchingModel``: the throughput profile, many concurrent requests on one context.

``model.with_batching(max_sequences)`` returns a new lease on the same
weights that owns one llama context (``n_seq_max = max_sequences``, one KV
stream per sequence: each gets ``context // max_sequences`` cells) and one
scheduler thread (see :mod:`aner_nb.llm.scheduler` for the loop and
:mod:`aner_nb.llm.step_policy` for the step policy and why the context is
split this way). ``generate``, ``chat`` and ``stream``
may be called from many threads at once; each call becomes one sequence of
the shared batch. Up to ``queue_limit`` (8) requests wait for a free
sequence; beyond that a call fails at once with ``BusyError``.

Timings of a batched response: ``queue_duration`` runs from submission to
admission (a sequence id became free); ``prompt_eval_duration`` runs from
admission, ``first_token_duration`` and ``total_duration`` from submission (so
they include the queue); ``batch_max_sequences`` is
``max_sequences``, ``batch_peak_sequences`` the most sequences that shared a
step with the request, ``scheduler_steps`` the steps (``llama_decode``
calls) it took part in and ``batch_decoded_tokens`` the rows those steps
evaluated, its own and the other sequences'. Without shared prefixes there
is no context pool, so ``context_clear_duration`` and
``context_pool_reused`` are -1.

Shared prefixes (``with_batching(n, prefix_cache_entries=E,
prefix_cache_tokens=T)``, the latency profile's names and bounds): the
context gets ``n + E`` KV streams of ``context // n`` cells each; the ``E``
spare streams hold evaluated prompt prefixes of up to ``T`` tokens (see
:mod:`aner_nb.llm.shared_prefix`). ``cached_input_tokens`` then counts the
prompt tokens a request copied from an entry, ``context_pool_reused`` is 1
on a hit and ``context_clear_duration`` times the lookup and copy request;
the ``prefix_cache_*`` timings say what the entries held at admission.
Sliding-window models keep a full SWA cache then (an entry is trimmed to the
common prefix, below the window). Trusted cache domain, as for the latency
profile: a request's timings reveal how much of its prompt an earlier
request of the same lease sent.

Lifetime: the lease retains the weights, so closing the source lease does
not affect accepted requests. ``close()`` rejects new requests, lets every
accepted one finish, then the scheduler thread frees the context and exits;
a finalizer does the same (without waiting) when the lease is collected.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Mapping, Sequence

from ._engine import Batch, ContextParams, NativeContext, pairs_batch_columns
from .errors import ConfigurationError, InvalidRequestError
from .adapters import SharedAdapter
from .lifetime import Lifetime
from .options import RequestSettings
from .profiles import MAX_SEQUENCES, QUEUE_LIMIT, STREAM_BUFFER, BatchingSettings, Profile
from .protocol import Done, Lease, LeaseKind, Pieces, RequestRules
from .requests import Prepared, RawText, as_messages, context_params, new_job, request_settings, template_opening
from .response import Response
from .runner import Job, validated_response
from .outbox import Outbox, Request
from .scheduler import Scheduler
from .scheduler_stats import SchedulerStats
from .summary import ESTIMATE, PER_LEASE, PER_REQUEST, Holding, MemorySummary, memory_summary, tier_holdings
from .prefix_store import tier_store
from .shared_prefix import SharedPrefixes
from .speculation import lease_speculator
from .weights import SharedWeights

__all__ = ["BatchingModel", "BatchingSettings", "with_batching", "MAX_SEQUENCES", "QUEUE_LIMIT", "STREAM_BUFFER"]


def with_batching(
    model: Any, max_sequences: int, *, prefix_cache_entries: int = 0, prefix_cache_tokens: int = 2048,
    speculative_tokens: int = 0, **tiers: Any
) -> "BatchingModel":
    """Module form of :meth:`LLMModel.with_batching` (``tiers``: ``prefix_cache_ram_bytes``, ``prefix_cache_dir``,
    ``prefix_cache_disk_bytes``)."""
    return model.with_batching(
        max_sequences, prefix_cache_entries=prefix_cache_entries, prefix_cache_tokens=prefix_cache_tokens,
        speculative_tokens=speculative_tokens, **tiers
    )


class BatchingModel(Lease):
    """A throughput lease: concurrent requests share one context and one scheduler thread.

    Create it with ``model.with_batching(max_sequences)``. Requests take the
    same arguments as on :class:`LLMModel`; ``generate``/``chat`` also accept
    ``on_text``, a callable run on the scheduler thread with each newly final
    piece (keep it quick; it must not submit to or read from this lease).
    """

    _builder_note = (
        "the throughput profile cannot be combined with sessions, latency profiles or context pools, and an "
        "adapter is applied before batching: with_adapter() then with_batching(); call it on the source lease"
    )

    def __init__(self, weights: SharedWeights, profile: Profile, *, adapter: SharedAdapter | None = None) -> None:
        """A lease for ``profile``, a throughput profile (its ``batching`` settings; its optimizer's
        ``prefix_cache_entries`` and ``prefix_cache_tokens`` are the shared prefixes)."""
        if profile.batching is None:
            raise ConfigurationError("a batching lease needs a throughput profile (Profile.batching)", param="batching")
        _check_context(profile.batching, weights.settings.context)
        params, sequence_context = _shared_context_params(weights, profile, adapter)
        life = Lifetime("batching lease", exclusive=False)
        # The scheduler must not reference the lease, or the lease could never be collected.
        self._scheduler = _start_scheduler(weights, adapter, profile, params, sequence_context, life)
        self._establish(weights, profile, params, life, adapter)

    # -- metadata (the shared metadata comes from the Lease protocol) --------------------
    @property
    def sequence_context(self) -> int:
        """Cells each sequence may use: a request's prompt plus max_tokens must fit them."""
        return self._scheduler.sequence_context

    @property
    def batching(self) -> BatchingSettings:
        """The profile's batching settings (sequences, queue bound, stream buffer)."""
        return self._settings

    @property
    def _settings(self) -> BatchingSettings:
        assert self._profile.batching is not None  # checked at construction
        return self._profile.batching

    @property
    def max_sequences(self) -> int:
        return self._settings.max_sequences

    @property
    def closed(self) -> bool:
        return self._scheduler.closed

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"<BatchingModel {self.name!r} {self.architecture} throughput max_sequences={self.max_sequences} "
            f"ctx={self.context} device={self.device} sha256={self.fingerprint[:12]} {state}>"
        )

    # -- lifetime -------------------------------------------------------------
    def close(self) -> None:
        """Reject new requests, finish accepted ones, then free the context and join the thread."""
        self._lifetime.close()
        self._scheduler.shutdown(wait=True)

    @property
    def kind(self) -> LeaseKind:
        return "throughput"

    def _features(self) -> frozenset[str]:
        optional = {
            "adapter": self._adapter is not None, "prefix_cache": self._profile.optimizer.prefix_cache_entries > 0,
            "speculative": self._profile.optimizer.draft_tokens > 0,
        }
        return frozenset(
            {"generate", "chat", "stream", "complete", "continuous_batching", "embed",
             *(f for f, on in optional.items() if on)}
        )

    # -- requests: the protocol's two steps ----------------------------------------
    # ``generate``/``chat`` block until this request's sequence finishes; ``on_text`` runs on the
    # scheduler thread with each newly final piece. ``stream`` pieces wait in a small per-request
    # buffer; while it is full the sequence pauses (others continue), and ``cancel()`` or Ctrl-C
    # ends only this sequence.
    _scores_prompts = False  # prompts are evaluated in shared steps with logits on their last row only

    def _rules(self, messages: "tuple[dict[str, str], ...] | RawText", request: RequestSettings) -> RequestRules:
        note = (
            f" (this batching lease splits its context of {self.context} cells between {self.max_sequences} "
            f"sequences, {self.sequence_context} each; use fewer sequences or load with a larger context)"
        )
        return RequestRules(messages, context=self.sequence_context, context_note=note)

    def _submit(
        self, prepared: Prepared, job: Job, on_text: Callable[[str], None] | None, streaming: bool
    ) -> tuple[Pieces, Done]:
        req = self._enqueue(job, on_text=on_text, streaming=streaming)
        return (_pieces(req) if streaming else _awaited(req)), req.settle

    def _enqueue(
        self, job: Job, *, on_text: Callable[[str], None] | None = None, streaming: bool = False, block: bool = False
    ) -> Request:
        s = self._scheduler
        outbox = Outbox(self._settings.stream_buffer, s.wake, s.guard) if streaming else None
        return s.submit(Request(job, outbox=outbox, on_text=on_text), block=block)

    def generate_many(
        self, prompts: Sequence["str | Sequence[Mapping[str, Any]]"], *, settings: RequestSettings | None = None,
        **options: Any,
    ) -> list[Response]:
        """Submit every prompt concurrently and return the responses in order (options as ``generate``).

        All prompts are validated before any is submitted. Submission waits
        for queue room instead of failing, so lists longer than the queue
        work; a failed request raises its error once all have ended.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidRequestError(
                f"prompts must be a list of prompts, got {type(prompts).__name__}", param="prompts"
            )
        messages = [as_messages(p) for p in prompts]
        request = request_settings(options, settings)
        jobs = [self._job(self._prepare(m, request)) for m in messages]
        requests: list[Request | Response] = []
        try:
            for job in jobs:
                requests.append(validated_response(job) if job.request.max_tokens == 0 else self._enqueue(job, block=True))
            for r in requests:
                if isinstance(r, Request):
                    r.wait()
        except BaseException:
            pending = [r for r in requests if isinstance(r, Request)]
            for r in pending:
                r.cancel()
            if not self._scheduler.on_scheduler_thread():
                for r in pending:
                    r.wait()
            raise
        return [r.result() if isinstance(r, Request) else r for r in requests]

    def _job(self, prepared: Prepared) -> Job:
        return new_job(prepared, self._params, self._profile, self.name)

    # -- summaries -----------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        """A snapshot of the scheduler's counters (steps, tokens, peak sequences, queue)."""
        return self._scheduler.stats()

    def prefix_tier_stats(self) -> "dict[str, object] | None":
        """The prefix tiers' counters (hits, misses, skips by reason, bytes by tier) and holdings; None without tiers."""
        prefixes = self._scheduler.prefixes
        store = prefixes.tiers if prefixes is not None else None
        return store.snapshot() if store is not None else None

    def memory_summary(self) -> MemorySummary:
        """Weights, the KV of the one shared context (request streams and shared-prefix streams), what the
        shared prefixes hold now, and the process's measured memory."""
        kv_bytes = self._context_kv_bytes()
        n, entries = self.max_sequences, self._profile.optimizer.prefix_cache_entries
        per_stream = kv_bytes // (n + entries)  # every stream of the context has the same cells
        layout = f"one shared context: {n} sequences x {self.sequence_context} cells"
        layout += f" + {entries} shared-prefix streams of the same size" if entries else ""
        stats = self.stats()
        held = [Holding(
            f"shared prefixes ({stats.prefix_cache_retained_tokens} tokens)", stats.prefix_cache_entries,
            stats.prefix_cache_entries * per_stream, PER_LEASE, ESTIMATE,
        )] if entries else []
        bounds = [
            Holding(layout, 1, kv_bytes, PER_LEASE, ESTIMATE),
            Holding("one request's stream", 1, per_stream, PER_REQUEST, ESTIMATE),
        ]
        prefixes = self._scheduler.prefixes
        more_held, more_bounds = tier_holdings(prefixes.tiers if prefixes is not None else None)
        held += more_held
        bounds += more_bounds
        return memory_summary(
            self._weights, kv_bytes=kv_bytes, kv_scope=f"whole scheduler ({layout})",
            contexts=self._weights.native.live_contexts(), params=self._params, held=held, bounds=bounds,
        )


def _pieces(req: Request) -> Generator[str, None, Response]:
    """The consumer side of a batched stream; returns the Response or raises the request's error."""
    assert req.outbox is not None
    while True:
        piece = req.outbox.get()
        if piece is None:
            break
        yield piece
    return req.result()


def _awaited(req: Request) -> Generator[str, None, Response]:
    """A blocking request as a generator with no pieces (``on_text`` delivers them on the scheduler thread)."""
    req.wait()  # Ctrl-C here ends the generator; the end callback (``settle``) cancels this sequence only
    return req.result()
    yield  # pragma: no cover - makes this a generator


def check_source_profile(profile: Profile, settings: BatchingSettings) -> None:
    """Refuse a source profile the throughput profile cannot be derived from."""
    opt = profile.optimizer
    if opt.is_latency_profile:
        raise ConfigurationError(
            f"with_batching() cannot be combined with a latency profile (prefix_cache_entries="
            f"{opt.prefix_cache_entries}, speculative_tokens={opt.speculative_tokens}); derive the "
            "batching lease from a lease without prefix cache or speculation"
        )
    if opt.batch_tokens < settings.max_sequences:
        raise ConfigurationError(
            f"batch_tokens ({opt.batch_tokens}) must be >= max_sequences ({settings.max_sequences}): "
            "every step holds one decode row per running sequence"
        )


def _check_context(settings: BatchingSettings, context: int) -> None:
    """Refuse a context the throughput profile cannot split."""
    if context < settings.max_sequences:
        raise ConfigurationError(
            f"max_sequences ({settings.max_sequences}) must be <= the context ({context}): each sequence "
            "gets an equal share of the context's cells"
        )


def _shared_context_params(
    weights: SharedWeights, profile: Profile, adapter: SharedAdapter | None
) -> tuple[ContextParams, int]:
    """The shared context's parameters and the cells of each sequence id."""
    # One KV stream per sequence: cells stay in position order, so output equals a solo run.
    # Shared prefixes take spare streams of the same size above the request ids, and keep a full
    # sliding-window cache: an entry is trimmed to a common prefix that may end below the window.
    # An adapter profile's shared context applies the adapter, as each of its ordinary contexts does.
    assert profile.batching is not None
    sequence_context = weights.settings.context // profile.batching.max_sequences
    entries = profile.optimizer.prefix_cache_entries
    streams = profile.batching.max_sequences + entries
    # Speculation removes rejected proposals, so it keeps a full sliding-window cache as well.
    params = context_params(
        weights, profile, n_seq_max=streams, kv_unified=False, adapter=adapter,
        n_ctx=sequence_context * streams if entries else None,
        swa_full=entries > 0 or profile.optimizer.draft_tokens > 0,
    )
    return params, sequence_context


def _start_scheduler(
    weights: SharedWeights, adapter: SharedAdapter | None, profile: Profile, params: ContextParams,
    sequence_context: int, life: Lifetime,
) -> Scheduler:
    """Build the shared context and batch and hand them to a new scheduler thread."""
    settings, opt = profile.batching, profile.optimizer
    assert settings is not None
    prefixes = None
    if opt.prefix_cache_entries:
        trivial = template_opening(weights)
        prefixes = SharedPrefixes(
            range(settings.max_sequences, settings.max_sequences + opt.prefix_cache_entries),
            max_tokens=opt.prefix_cache_tokens, trivial_prefix=trivial,
            store=tier_store(weights, profile, params, trivial_prefix=trivial),
        )
    speculator = lease_speculator(weights, params, opt.draft_tokens)  # measured before anything is owned
    with life.building(weights, adapter) as stack:
        ctx = NativeContext(weights.native, params)
        stack.callback(ctx.free)
        batch = Batch(params.n_batch, 1)
        stack.callback(batch.free)
        # From here the scheduler thread owns these: when it exits it releases them in reverse
        # order (batch, context, then the adapter it applied, then the weights' hold).
        owned = stack.pop_all()
        try:
            scheduler = Scheduler(
                model=weights.native, ctx=ctx, batch=batch, max_sequences=settings.max_sequences,
                batch_tokens=params.n_batch, sequence_context=sequence_context,
                queue_limit=settings.queue_limit, on_exit=owned.close,
                pair_columns=weights.device == "cpu" and pairs_batch_columns(weights.facts.output_type),
                name=f"aner-scheduler-{weights.facts.name}", prefixes=prefixes, speculator=speculator,
            )
        except BaseException:
            owned.close()
            raise
        stack.callback(scheduler.shutdown, wait=False)  # the lease only asks it to stop
    return scheduler
