"""``LLMModel``: the opaque lease a user holds. A thin facade over lifetime.

The lease owns its state (open/closed, the one active request) and its
context pool; the weights are shared with every lease derived from the same
load. A ``weakref.finalize`` on the lease releases both when the lease becomes
unreachable, so ``del``, ``%reset`` and failed cells free native memory
without relying on ``__del__``.

An adapter lease (``with_adapter``) also holds a :class:`SharedAdapter`; its
contexts apply the adapter at creation (``ContextParams.adapter``), and
releasing the lease frees its contexts, then the adapter (when no other
lease or session uses it), then the lease's hold on the weights.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ._engine import ContextParams, default_threads
from .chat import validate_messages
from .context_pool import ContextPool, ContextSlot
from .prefix_pool import PrefixPool, common_prefix_length
from .errors import BusyError, ClosedError, ConfigurationError, ContextOverflowError, InvalidRequestError
from .adapters import AdapterInfo, SharedAdapter, load_adapter
from .artifact import ModelFacts
from .memory import kv_estimate
from .timings import ProfileTimings
from .protocol import FEATURES, Lease, LeaseKind
from .profiles import OptimizerSettings, Profile, RequestSettings
from .response import Response
from .runner import Job, run_request, validate_only
from .stream import Stream
from .summary import MemorySummary, memory_summary
from .weights import LoadSummary, SharedWeights

if TYPE_CHECKING:  # imported lazily at run time: both modules import this one
    from .batching import BatchingModel
    from .session import Session

__all__ = ["LLMModel", "LeaseMetadata", "FEATURES", "Prepared", "prepare", "prompt_token_ids", "context_params"]



class Prepared:
    """A validated request: its settings and the exact prompt tokens to evaluate."""

    __slots__ = ("request", "tokens", "t_call")

    def __init__(self, request: RequestSettings, tokens: list[int], t_call: int) -> None:
        self.request = request
        self.tokens = tokens
        self.t_call = t_call


def prompt_token_ids(weights: SharedWeights, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Render the chat template and tokenize; special-token text (e.g. ``<bos>``) is parsed.

    The template writes BOS itself when the model family wants one, so no
    special tokens are added on top.
    """
    text = weights.template.render(messages, add_generation_prompt=True)
    return weights.native.tokenize(text, add_special=False, parse_special=True)


def prepare(
    weights: SharedWeights, messages: Sequence[Mapping[str, Any]], context: int, request: RequestSettings, t_call: int
) -> Prepared:
    """Render the chat template, tokenize, and check that prompt plus output fit the context."""
    tokens = prompt_token_ids(weights, messages)
    if not tokens:
        raise ContextOverflowError("the formatted prompt is empty; a request needs at least one prompt token")
    if len(tokens) + request.max_tokens > context:
        room = context - len(tokens)
        advice = f"lower max_tokens to at most {room}" if room > 0 else "shorten the prompt"
        raise ContextOverflowError(
            f"prompt of {len(tokens)} tokens plus max_tokens={request.max_tokens} is "
            f"{len(tokens) + request.max_tokens}, above the context of {context}; {advice} "
            "(nothing is truncated)"
        )
    return Prepared(request, tokens, t_call)


def engine_threads(profile: Profile) -> tuple[int, int]:
    """``(n_threads, n_threads_batch)`` a profile's contexts get: its own, or the engine default for 0."""
    threads, prefill = default_threads()
    opt = profile.optimizer
    return opt.threads or threads, opt.prefill_threads or prefill


def context_params(
    weights: SharedWeights,
    profile: Profile,
    *,
    n_seq_max: int = 1,
    swa_full: bool = False,
    adapter: SharedAdapter | None = None,
) -> ContextParams:
    """The explicit context parameters of a lease's contexts, including the adapter they apply.

    A profile naming an adapter needs that adapter here, so no caller can
    silently create adapter-less contexts for it.
    """
    if profile.adapter != (adapter.sha256 if adapter is not None else None):
        raise ConfigurationError(
            f"this profile applies adapter {profile.adapter!r} but the contexts were asked for "
            f"{adapter.sha256 if adapter is not None else None!r}; an adapter profile's contexts must apply its adapter"
        )
    opt = profile.optimizer
    threads, prefill = engine_threads(profile)
    settings = weights.settings
    return ContextParams(
        n_ctx=settings.context,
        n_batch=opt.batch_tokens,
        n_ubatch=opt.micro_batch_tokens,
        n_seq_max=n_seq_max,
        n_threads=threads,
        n_threads_batch=prefill,
        kv_cache_type=settings.kv_cache_type,
        flash_attention=settings.flash_attention,
        swa_full=swa_full,
        offload=weights.device != "cpu",
        adapter=adapter.native if adapter is not None else None,
    )


def profile_timings(params: ContextParams, profile: Profile) -> ProfileTimings:
    """The timings part that describes the configuration the request ran with."""
    opt = profile.optimizer
    return ProfileTimings(
        threads=params.n_threads,
        prefill_threads=params.n_threads_batch,
        batch_tokens=params.n_batch,
        micro_batch_tokens=params.n_ubatch,
        speculative_tokens=opt.speculative_tokens,
        prefix_cache_capacity=opt.prefix_cache_entries,
    )


class _LeaseState:
    """Open/closed and the single active request; what the finalizer releases."""

    def __init__(
        self, weights: SharedWeights, pool: "ContextPool | PrefixPool", adapter: SharedAdapter | None = None
    ) -> None:
        self.weights = weights
        self.pool = pool
        self.adapter = adapter
        self.lock = threading.Lock()
        self.closed = False
        self.active = False
        self.released = False

    def begin(self, what: str) -> None:
        with self.lock:
            if self.closed:
                raise ClosedError(f"this lease is closed; {what} is not accepted (load or derive a new lease)")
            if self.active:
                raise BusyError(
                    f"this lease is already running a request; {what} was rejected "
                    "(one request at a time per lease: wait, or use with_batching for concurrency)"
                )
            self.active = True

    def end(self) -> None:
        with self.lock:
            self.active = False
            release = self.closed
        if release:
            self.release()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            release = not self.active
        if release:
            self.release()

    def release(self) -> None:
        with self.lock:
            if self.released:
                return
            self.released = True
            self.closed = True
        try:
            self.pool.close()  # the lease's idle contexts first,
            if self.adapter is not None:
                self.adapter.release()  # then the adapter (frees any context still applying it),
        finally:
            self.weights.release()  # then the weights


class LeaseMetadata(Lease):
    """What every lease kind reads from its weights: metadata, readable after close.

    Subclasses set ``_weights`` and ``_profile`` and define ``close()``.
    """

    _weights: SharedWeights
    _profile: Profile

    @property
    def name(self) -> str:
        return self._weights.facts.name

    @property
    def architecture(self) -> str:
        return self._weights.facts.architecture

    @property
    def fingerprint(self) -> str:
        return self._weights.fingerprint

    @property
    def context(self) -> int:
        return self._weights.settings.context

    @property
    def device(self) -> str:
        return self._weights.device

    @property
    def path(self) -> str:
        return self._weights.facts.path

    @property
    def profile(self) -> Profile:
        return self._profile

    @property
    def facts(self) -> "ModelFacts":
        """What the GGUF header declares (layers, KV heads, head dims, window...), for KV arithmetic."""
        return self._weights.facts

    @property
    def chat_template(self) -> str:
        """Where the chat template came from: ``embedded``, ``builtin:<name>`` or ``explicit``."""
        return self._weights.template.origin

    def prompt_tokens(self, prompt: "str | Sequence[Mapping[str, Any]]") -> list[int]:
        """The exact token ids a request with this prompt (or message list) evaluates."""
        return prompt_token_ids(self._weights, _as_messages(prompt))

    def load_summary(self) -> LoadSummary:
        return self._weights.summary

    def _context_kv_bytes(self) -> int:
        """KV estimate of one context of this lease's size and KV type."""
        facts = self._weights.facts
        return kv_estimate(
            self.context, facts.layers, facts.kv_heads, facts.head_dim_k, facts.head_dim_v,
            self._weights.settings.kv_cache_type,
        )



class LLMModel(LeaseMetadata):
    """An opaque lease on loaded weights. Create it with :func:`aner_nb.llm.load`."""

    def __init__(
        self, weights: SharedWeights, profile: Profile | None = None, *, adapter: SharedAdapter | None = None
    ) -> None:
        profile = profile or Profile()
        opt = profile.optimizer
        # Latency contexts keep a full sliding-window cache: prefix trims and rejected
        # proposals remove positions that a window-sized SWA cache may no longer hold.
        params = context_params(weights, profile, swa_full=opt.is_latency_profile, adapter=adapter)
        weights.retain()
        try:
            if adapter is not None:
                adapter.retain()
        except BaseException:
            weights.release()
            raise
        self._weights = weights
        self._profile = profile
        self._adapter = adapter
        self._params = params
        pool: ContextPool | PrefixPool
        try:
            if opt.prefix_cache_entries:
                pool = PrefixPool(
                    weights.native, self._params, capacity=opt.prefix_cache_entries,
                    max_tokens=opt.prefix_cache_tokens, trivial_prefix=_template_opening(weights),
                )
            else:
                pool = ContextPool(weights.native, self._params, profile.max_idle_contexts)
        except BaseException:
            if adapter is not None:
                adapter.release()
            weights.release()
            raise
        self._state = _LeaseState(weights, pool, adapter)
        self._finalizer = weakref.finalize(self, self._state.release)
        self._finalizer.atexit = True

    @property
    def adapter(self) -> AdapterInfo | None:
        """The LoRA adapter this lease applies (name, hashes, rank, targets), or None."""
        return self._adapter.info if self._adapter is not None else None

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        adapter = f" adapter={self._adapter.sha256[:12]}" if self._adapter is not None else ""
        return (
            f"<LLMModel {self.name!r} {self.architecture} {self._profile.kind} ctx={self.context} "
            f"device={self.device} sha256={self.fingerprint[:12]}{adapter} {state}>"
        )

    # -- lifetime -------------------------------------------------------------
    def close(self) -> None:
        """Reject new requests; a running request finishes, then native memory is released."""
        self._state.close()

    @property
    def kind(self) -> LeaseKind:
        return "adapter" if self._adapter is not None else self._profile.kind  # type: ignore[return-value]

    def _features(self) -> frozenset[str]:
        opt = self._profile.optimizer
        optional = {
            "prefix_cache": opt.prefix_cache_entries > 0,
            "speculative": opt.speculative_tokens > 0,
            "adapter": self._adapter is not None,
        }
        return frozenset({"generate", "chat", "stream", "session", *(f for f, on in optional.items() if on)})

    # -- requests ---------------------------------------------------------------
    def generate(
        self, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0, seed: int = 0, stop: Any = None
    ) -> Response:
        """Answer one user message formatted with the chat template."""
        return self._complete(_as_messages(prompt, strict_str=True), max_tokens, temperature, seed, stop)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        seed: int = 0,
        stop: Any = None,
    ) -> Response:
        """Answer a conversation given as ``[{"role": ..., "content": ...}, ...]``."""
        return self._complete(validate_messages(messages), max_tokens, temperature, seed, stop)

    def stream(
        self,
        prompt: "str | Sequence[Mapping[str, Any]]",
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        seed: int = 0,
        stop: Any = None,
    ) -> Stream:
        """Like ``generate``/``chat`` but yields verified text pieces; see :class:`Stream`."""
        t_call = time.perf_counter_ns()
        prepared = self._prepare(_as_messages(prompt), max_tokens, temperature, seed, stop, t_call)
        self._state.begin("stream()")
        try:
            gen, job, done = self._start(prepared)
        except BaseException:
            self._state.end()
            raise
        return Stream(gen, job, done)

    def _complete(self, messages: Any, max_tokens: Any, temperature: Any, seed: Any, stop: Any) -> Response:
        t_call = time.perf_counter_ns()
        prepared = self._prepare(messages, max_tokens, temperature, seed, stop, t_call)
        self._state.begin("generate()")
        try:
            gen, job, done = self._start(prepared)
        except BaseException:
            self._state.end()
            raise
        ok = False
        try:
            while True:
                next(gen)
        except StopIteration as stop_it:
            ok = True
            return stop_it.value
        finally:
            done(ok)

    def _prepare(self, messages: Any, max_tokens: Any, temperature: Any, seed: Any, stop: Any, t_call: int) -> Prepared:
        if self._state.closed:
            raise ClosedError("this lease is closed; requests are not accepted (load or derive a new lease)")
        request = RequestSettings.of(max_tokens, temperature, seed, stop)
        if self._profile.optimizer.speculative_tokens and not request.greedy:
            raise InvalidRequestError(
                f"temperature={request.temperature} is not allowed on a speculative lease: prompt-lookup "
                "verification is greedy; use temperature=0, or a lease without speculative_tokens"
            )
        return prepare(self._weights, messages, self.context, request, t_call)

    def _start(self, prepared: Prepared) -> tuple[Any, Job, Any]:
        """Acquire a context and build the request's generator and its completion callback."""
        job = Job(
            prompt_tokens=prepared.tokens,
            request=prepared.request,
            t_call=prepared.t_call,
            model_name=self.name,
        )
        job.add(profile_timings(self._params, self._profile))
        if prepared.request.max_tokens == 0:
            return validate_only(job), job, lambda ok: self._state.end()
        pool = self._state.pool
        acquired = pool.acquire(prepared.tokens)
        job.n_cached = acquired.n_cached
        for part in acquired.timings:
            job.add(part)
        gen = run_request(
            self._weights.native, acquired.slot.ctx, acquired.slot.batch, job,
            speculative_tokens=self._profile.optimizer.speculative_tokens,
        )

        def done(ok: bool, slot: ContextSlot = acquired.slot) -> None:
            if job.result is None:
                outcome = "failed"  # an engine error: the KV state is unknown
            elif ok and job.result.finish_reason != "cancelled":
                outcome = "ok"
            else:
                outcome = "cancelled"
            try:
                pool.give_back(slot, prepared.tokens, outcome=outcome)
            finally:
                self._state.end()

        return gen, job, done

    # -- builders: each returns a NEW lease on the same weights ----------------
    def with_optimizer(
        self,
        *,
        threads: int = 0,
        prefill_threads: int = 0,
        batch_tokens: int = 512,
        micro_batch_tokens: int = 128,
        prefix_cache_entries: int = 0,
        prefix_cache_tokens: int = 2048,
        speculative_tokens: int = 0,
    ) -> "LLMModel":
        """A latency profile: engine threads and batch sizes, prefix cache, prompt-lookup speculation.

        The new lease has its own (empty) prefix pool; this lease is unchanged.
        """
        settings = OptimizerSettings(
            threads=threads, prefill_threads=prefill_threads, batch_tokens=batch_tokens,
            micro_batch_tokens=micro_batch_tokens, prefix_cache_entries=prefix_cache_entries,
            prefix_cache_tokens=prefix_cache_tokens, speculative_tokens=speculative_tokens,
        )
        self._check_open("with_optimizer()")
        return LLMModel(self._weights, self._profile.with_(optimizer=settings), adapter=self._adapter)

    def with_context_pool(self, max_idle: int) -> "LLMModel":
        """The same profile keeping up to ``max_idle`` (0..4) idle contexts; 0 disables retention."""
        profile = self._profile.with_(max_idle_contexts=max_idle)
        self._check_open("with_context_pool()")
        return LLMModel(self._weights, profile, adapter=self._adapter)

    def with_adapter(self, manifest_path: "str | os.PathLike[str]") -> "LLMModel":
        """A lease on the same weights that applies the LoRA adapter a checked manifest names.

        The manifest (see :mod:`aner_nb.llm.adapters`) must name this lease's
        fingerprint and architecture and the adapter's SHA-256; every check
        runs before llama.cpp loads the adapter. The new lease keeps this
        lease's profile, owns the adapter and its own contexts (no KV is
        shared with other configurations); this lease is unchanged. One
        adapter per effective model: an adapter lease cannot take another.
        """
        self._check_open("with_adapter()")
        if self._adapter is not None:
            raise ConfigurationError(
                f"this lease already applies adapter {self._adapter.manifest.adapter_file!r} "
                f"(sha256 {self._adapter.sha256[:12]}); one adapter per effective model: call with_adapter() "
                "on the base lease instead"
            )
        adapter = load_adapter(self._weights, manifest_path)
        try:
            return LLMModel(self._weights, self._profile.with_(adapter=adapter.sha256), adapter=adapter)
        except BaseException:
            adapter.discard()
            raise

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise ClosedError(f"this lease is closed; {what} cannot derive from it (load or derive from an open lease)")

    # -- sessions and summaries -----------------------------------------------
    def session(self, system: str | None = None) -> "Session":
        """A persistent conversation with its own context; history is not re-evaluated per turn."""
        from .session import Session

        if self.closed:
            raise ClosedError("this lease is closed; a session cannot be opened on it")
        return Session(self._weights, self._profile, system=system, model_name=self.name, adapter=self._adapter)

    def with_batching(self, max_sequences: int) -> "BatchingModel":
        """A throughput lease on the same weights: one shared context decoding up to ``max_sequences`` requests."""
        from .batching import BatchingModel

        if self.closed:
            raise ClosedError("this lease is closed; with_batching() cannot derive from it (load or derive from an open lease)")
        if self._adapter is not None:
            raise ConfigurationError(
                "with_batching() cannot be combined with an adapter lease (its shared context would not apply "
                "the adapter); derive the batching lease from the base lease"
            )
        return BatchingModel(self._weights, self._profile, max_sequences)

    def memory_summary(self) -> MemorySummary:
        """Weights, KV estimate for this lease's contexts, and the process's measured memory."""
        return memory_summary(
            self._weights,
            kv_bytes=self._context_kv_bytes(),
            kv_scope="per request (one context per active request)",
            contexts=self._weights.native.live_contexts(),
        )


def _template_opening(weights: SharedWeights) -> int:
    """Tokens every prompt of this template starts with (BOS, the first turn's header).

    A prefix-cache match no longer than this is template-only and worth no entry.
    """
    render, tokenize = weights.template.render, weights.native.tokenize
    a = tokenize(render([{"role": "user", "content": "a"}]))
    b = tokenize(render([{"role": "user", "content": "b"}]))
    return common_prefix_length(a, b)


def _as_messages(prompt: Any, *, strict_str: bool = False) -> tuple[dict, ...]:
    if isinstance(prompt, str):
        return validate_messages([{"role": "user", "content": prompt}])
    if strict_str:
        raise InvalidRequestError(
            f"prompt must be a string, got {type(prompt).__name__}; use chat(messages) for a message list"
        )
    return validate_messages(prompt)
