"""The one lease protocol: what every kind of lease offers, written once.

A lease is something a user submits requests to: an ordinary, latency or
adapter lease (:class:`~aner_nb.llm.lease.LLMModel`), a batching lease
(:class:`~aner_nb.llm.batching.BatchingModel`) or a conversation
(:class:`~aner_nb.llm.session.Session`). Consumers (magics, the HTTP service,
widgets, benchmarks) switch on :attr:`Lease.kind` and :meth:`Lease.supports`,
never on class or module names.

The recipe of every kind is written here once:

* construction ends with :meth:`Lease._establish` (what the protocol reads:
  the weights, the profile, the context parameters, the adapter, the
  lifetime; then the finalizer that releases the lifetime when the lease is
  collected);
* ``generate``, ``chat``, ``complete`` and ``stream`` prepare a request in one
  step (:meth:`Lease._prepare`: the lease must be open, then
  :func:`aner_nb.llm.requests.prepare` checks and tokenizes it under the
  kind's :class:`RequestRules`: its context limit, greedy-only, which
  messages). Each kind supplies ``_rules`` and ``_submit`` (how a prepared
  job runs: on a pooled context, on the session's context, or on the
  batching scheduler), which returns the request's piece generator and its
  end callback. A request with ``max_tokens=0`` is validated and answered
  here without touching a context;
* the builders (:data:`BUILDERS`) a kind supports are its class's
  :attr:`Lease.builders`; every other builder is refused by one path
  (:meth:`Lease._refuse_builder`) with an :class:`UnsupportedFeatureError`
  whose ``param`` names the builder. A class that declares a builder
  implements it, and one that implements it declares it (checked when the
  class is defined);
* every kind answers :meth:`Lease.memory_summary`; :meth:`Lease.stats` is the
  batching scheduler's :class:`~aner_nb.llm.scheduler_stats.SchedulerStats`
  on a kind that has one (``supports("continuous_batching")``), and on the
  others raises :class:`UnsupportedFeatureError` with
  ``param="continuous_batching"`` (there are no counters to report).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generator, Literal, Mapping, Sequence, get_args

from ._engine import release_compute_threads
from .errors import ConfigurationError, InvalidRequestError, UnsupportedFeatureError
from .memory import kv_caches_for
from .requests import (Prepared, RawText, as_messages, as_raw_text, new_job, prepare, prompt_token_ids,
                       request_settings)
from .runner import Job, unstarted_response, validate_only
from .frame_map import map_frame
from .stream import Stream
from .chat import validate_messages
from .chat_input import chat_input
from .embedder import embed as run_embed
from .embeddings import check_token_ids

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._engine import ContextParams
    from .adapters import AdapterInfo, SharedAdapter
    from .artifact import ModelFacts
    from .lifetime import Lifetime
    from .options import RequestSettings
    from .profiles import Profile
    from .requests import RequestOptions
    from .response import Response
    from .scheduler_stats import SchedulerStats
    from .summary import MemorySummary
    from .weights import LoadSummary, SharedWeights

__all__ = ["Lease", "LeaseKind", "KINDS", "FEATURES", "BUILDERS", "RequestRules", "Pieces", "Done"]

LeaseKind = Literal["ordinary", "latency", "adapter", "throughput", "session"]
KINDS: tuple[str, ...] = get_args(LeaseKind)
FEATURES = (
    "generate", "chat", "stream", "complete", "session", "prefix_cache", "speculative", "continuous_batching", "adapter",
    "embed",
)

Pieces = Generator[str, None, "Response"]  # verified text pieces; returns the final Response
Done = Callable[[bool], None]  # the request's end callback; True when it ran to its end
# The builders of the lease protocol: each returns a NEW lease (or a session) on the same weights.
BUILDERS = ("with_optimizer", "with_context_pool", "with_adapter", "with_batching", "session")


@dataclass(frozen=True)
class RequestRules:
    """A kind's rules for one request: the messages to format, the context they must fit, and the checks.

    ``context_note`` explains a lease-specific context limit in the overflow
    message; ``greedy_only`` refuses anything but plain greedy decoding;
    ``trusted`` message indices may hold special tokens.
    """

    messages: "tuple[dict[str, str], ...] | RawText"
    context: int
    greedy_only: bool = False
    context_note: str = ""
    trusted: frozenset[int] = frozenset()


class Lease(ABC):
    """What every lease kind offers: its kind and features, requests, metadata, and its lifetime.

    Subclasses build their resources, call :meth:`_establish` last, and
    implement ``kind``, ``_features``, ``_submit`` and ``memory_summary``
    (``_rules`` when their requests have rules of their own); ``builders``
    declares the builders they implement.
    """

    _weights: "SharedWeights"
    _profile: "Profile"
    _params: "ContextParams"
    _adapter: "SharedAdapter | None"
    _lifetime: "Lifetime"

    #: The builders (of :data:`BUILDERS`) this kind implements; the others are refused.
    builders: ClassVar[frozenset[str]] = frozenset()
    #: Why this kind refuses builders, and what to call instead (the refusal message's second half).
    _builder_note: ClassVar[str] = "derive profiles from the lease the others come from"
    #: What one request is called in the message of a request on a closed lease.
    _request_noun: ClassVar[str] = "a request"
    #: Whether a request may ask for ``prompt_logprobs`` (its prompt evaluated from position 0, logits on every row).
    _scores_prompts: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = cls.builders - set(BUILDERS)
        implemented = {b for b in BUILDERS if getattr(cls, b) is not getattr(Lease, b)}
        if unknown or implemented != cls.builders:
            raise TypeError(
                f"{cls.__name__}.builders must name exactly the builders it implements: declares "
                f"{sorted(cls.builders)}, implements {sorted(implemented)}"
            )

    # -- construction: the last step of every kind ---------------------------------------
    def _establish(
        self, weights: "SharedWeights", profile: "Profile", params: "ContextParams", lifetime: "Lifetime",
        adapter: "SharedAdapter | None" = None,
    ) -> None:
        """Record what the protocol reads, then watch the lease: when it becomes unreachable its
        lifetime is released (the finalizer holds the lifetime, never the lease)."""
        self._weights = weights
        self._profile = profile
        self._params = params
        self._adapter = adapter
        self._lifetime = lifetime
        self._finalizer = lifetime.watch(self)

    # -- what kind of lease -------------------------------------------------------
    @property
    @abstractmethod
    def kind(self) -> LeaseKind:
        """``ordinary``, ``latency`` (prefix cache or speculation), ``adapter`` (applies a LoRA adapter),
        ``throughput`` (continuous batching) or ``session`` (a conversation keeping its KV)."""

    @abstractmethod
    def _features(self) -> frozenset[str]:
        """The features of this lease while it is open."""

    def supports(self, feature: str) -> bool:
        """Whether this lease can do ``feature`` now (one of FEATURES); closed leases support nothing."""
        if feature not in FEATURES:
            raise ConfigurationError(
                f"unknown feature {feature!r}; known features: {', '.join(FEATURES)}", param="feature"
            )
        return not self.closed and feature in self._features()

    # -- lifetime -------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._lifetime.closed

    def close(self) -> None:
        """Reject new requests; a running request finishes, then native memory is released."""
        self._lifetime.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests: written once for every kind ----------------------------------------
    def generate(
        self,
        prompt: str,
        *,
        on_text: Callable[[str], None] | None = None,
        settings: "RequestSettings | None" = None,
        **options: "Unpack[RequestOptions]",
    ) -> "Response":
        """Answer one user message formatted with the chat template.

        Options: ``max_tokens`` (0..65536, default 256; 0 only validates),
        ``temperature`` (0..2, default 0 = greedy), ``seed`` (0..2**32-1),
        ``stop`` (a string or up to 16), ``top_k`` (0 = off..vocabulary),
        ``top_p`` and ``min_p`` (0..1), ``repeat_penalty`` (> 0) over the last
        ``repeat_last_n`` tokens, ``presence_penalty`` and ``frequency_penalty``
        (-2..2), and ``grammar`` (GBNF) or ``json_schema`` (a JSON-schema dict)
        to constrain the output (every option: :mod:`aner_nb.llm.options`).
        ``settings`` is a ready :class:`~aner_nb.llm.RequestSettings` instead of
        keyword options (what the magics and the HTTP service pass).
        ``on_text`` is called with each newly final piece of text.
        """
        messages = as_messages(prompt, strict_str=True)
        return self._run(self._prepare(messages, request_settings(options, settings)), on_text)

    def complete(
        self,
        text: str,
        *,
        on_text: Callable[[str], None] | None = None,
        settings: "RequestSettings | None" = None,
        **options: "Unpack[RequestOptions]",
    ) -> "Response":
        """Continue ``text`` as given, without the chat template (for base models); options as ``generate``."""
        raw = as_raw_text(text)
        return self._run(self._prepare(raw, request_settings(options, settings)), on_text)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        on_text: Callable[[str], None] | None = None,
        settings: "RequestSettings | None" = None,
        **options: "Unpack[RequestOptions]",
    ) -> "Response":
        """Answer a conversation given as ``[{"role": ..., "content": ...}, ...]`` (options as ``generate``)."""
        checked = validate_messages(messages)
        return self._run(self._prepare(checked, request_settings(options, settings)), on_text)

    def stream(
        self,
        prompt: "str | Sequence[Mapping[str, Any]]",
        *,
        raw: bool = False,
        settings: "RequestSettings | None" = None,
        **options: "Unpack[RequestOptions]",
    ) -> Stream:
        """Like ``generate``/``chat`` (``complete`` with ``raw=True``) but yields verified text pieces."""
        messages = as_raw_text(prompt) if raw else as_messages(prompt)
        prepared = self._prepare(messages, request_settings(options, settings))
        return Stream(*self._start(prepared, None, streaming=True))

    def map(
        self,
        data: Any,
        prompt: str,
        *,
        json_schema: "Mapping[str, Any] | None" = None,
        expand: bool = False,
        system: str | None = None,
        checkpoint: Any = None,
        progress: bool | None = None,
        settings: "RequestSettings | None" = None,
        **options: "Unpack[RequestOptions]",
    ) -> Any:
        """Answer ``prompt`` (a template over the columns: ``"Classify: {text}"``) for every row of ``data``.

        ``data`` is a pandas DataFrame or Series; the result is a DataFrame on its
        index with ``answer``, ``finish_reason``, ``prompt_tokens``,
        ``completion_tokens``, ``first_token_ms``, ``total_ms`` and ``error``
        (empty where the row succeeded: one bad row never loses the run). A
        batching lease runs up to its ``max_sequences`` rows at once. With
        ``json_schema`` every answer is constrained to the schema, and
        ``expand=True`` adds one typed column per property. ``checkpoint`` (a
        ``.jsonl`` path) keeps finished rows, so the same call after a kernel
        restart runs only the rest. Ctrl-C returns what finished. Details:
        :mod:`aner_nb.llm.frame_map`.
        """
        return map_frame(self, data, prompt, json_schema=json_schema, expand=expand, system=system,
                         checkpoint=checkpoint, progress=progress, settings=settings, **options)

    def embed(
        self, texts: Any, *, pooling: str | None = None, normalize: bool = True, return_count: bool = False,
    ) -> Any:
        """Sentence embeddings of ``texts`` as a float32 NumPy array, on an embedding context of its own.

        ``texts`` is a str (the answer is one vector, shape ``(n_embd,)``, as
        llama-cpp-python's ``Llama.embed`` and sentence-transformers return
        it), a list of str (shape ``(len(texts), n_embd)``), or token ids (a
        list of int, or a list of such lists). ``pooling``: ``"mean"``,
        ``"cls"`` or ``"last"``; None takes the model's ``<arch>.pooling_type``,
        and mean when it declares none. ``normalize`` scales each vector to unit
        length. Many inputs share decodes (one sequence id each); an input
        longer than the lease's context is refused (InvalidRequestError naming
        it), never truncated. ``return_count=True`` returns ``(vectors,
        prompt_tokens)``. llama.cpp also computes a logits row per embedded
        token (about ``n_vocab * 8`` bytes: 1 GB for a 500-token input on
        Gemma 3's 262k vocabulary). Policy: :mod:`aner_nb.llm.embeddings`.
        """
        life = self._lifetime
        life.check_open("embed()")
        if "embed" not in self._features():
            raise UnsupportedFeatureError(
                f"embed() is not available on a {self._lifetime.noun}: embed with the lease it came from",
                param="embed",
            )
        life.begin("embed()")
        try:
            self._weights.retain()  # the call's own hold: a close meanwhile cannot free the model under it
            try:
                vectors, count = run_embed(self._weights, self._params, texts, pooling=pooling, normalize=normalize,
                                           context=self.context)
            finally:
                self._weights.release()
        finally:
            life.end()
        return (vectors, count) if return_count else vectors

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """``text``'s token ids. Defaults as llama-cpp-python's ``Llama.tokenize``: the model's BOS is added
        and special-token text (``<|im_start|>``) stays text; ``parse_special=True`` makes it the token."""
        self._lifetime.check_open("tokenize()")
        if not isinstance(text, str):
            raise InvalidRequestError(f"text must be a str, got {type(text).__name__}", param="text")
        return self._weights.native.tokenize(text, add_special=bool(add_special), parse_special=bool(parse_special))

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        """The text of ``tokens`` (ids checked against the vocabulary first); ``special=True`` also renders
        control tokens (BOS, turn markers), which are otherwise left out, as llama-cpp-python does."""
        self._lifetime.check_open("detokenize()")
        if not isinstance(tokens, (list, tuple)):
            raise InvalidRequestError(f"tokens must be a list of int, got {type(tokens).__name__}", param="tokens")
        native = self._weights.native
        check_token_ids(tokens, native.n_vocab)
        return native.detokenize([int(t) for t in tokens], special=bool(special))

    def token_pieces(self, tokens: Sequence[int], *, special: bool = True) -> list[bytes]:
        """Each token's raw bytes (a piece may be part of a UTF-8 character), ids checked first."""
        self._lifetime.check_open("token_pieces()")
        native = self._weights.native
        check_token_ids(tokens, native.n_vocab)
        return [native.token_bytes(int(t), special=bool(special)) for t in tokens]

    def _prepare(self, messages: "tuple[dict[str, str], ...] | RawText", request: "RequestSettings") -> Prepared:
        """Check and tokenize one request (its settings already checked) against this lease's rules and context."""
        self._lifetime.check_open(self._request_noun)
        if request.prompt_logprobs and not self._scores_prompts:
            raise UnsupportedFeatureError(
                f"prompt_logprobs is not available on a {self.kind} lease (its prompts share or keep KV); score "
                "prompts on an ordinary or latency lease", param="prompt_logprobs",
            )
        rules = self._rules(messages, request)
        return prepare(
            self._weights, rules.messages, request, context=rules.context, greedy_only=rules.greedy_only,
            context_note=rules.context_note, trusted=rules.trusted,
        )

    def _rules(self, messages: "tuple[dict[str, str], ...] | RawText", request: "RequestSettings") -> RequestRules:
        """This kind's rules for one request: by default the messages as given, within the whole context."""
        return RequestRules(messages, context=self.context)

    @abstractmethod
    def _submit(
        self, prepared: Prepared, job: Job, on_text: Callable[[str], None] | None, streaming: bool
    ) -> tuple[Pieces, Done]:
        """Start a prepared job (``max_tokens`` > 0): its piece generator and its end callback."""

    def _start(
        self, prepared: Prepared, on_text: Callable[[str], None] | None, *, streaming: bool = False
    ) -> tuple[Pieces, Job, Done]:
        if on_text is not None and not callable(on_text):
            raise InvalidRequestError(
                f"on_text must be a callable taking a str, got {type(on_text).__name__}", param="on_text"
            )
        job = new_job(prepared, self._params, self._profile, self.name)
        life = self._lifetime
        life.begin("stream()" if streaming else "generate()")
        if prepared.request.max_tokens == 0 and not prepared.request.prompt_logprobs:
            return validate_only(job), job, lambda ok: life.end()  # validated: no context, no KV
        try:
            pieces, done = self._submit(prepared, job, on_text, streaming)
        except BaseException:
            life.end()
            raise
        if not life.exclusive:
            return pieces, job, done  # concurrent requests are not tracked by the lifetime: nothing to end

        def end(ok: bool) -> None:
            try:
                if job.result is None and not job.started and job.cancel.is_set():
                    unstarted_response(job)  # cancelled while it waited to start: a cancelled Response, no KV touched
                done(ok)
            finally:
                life.end()
                # This thread decoded the request: its idle OpenMP workers would slow every other thread's
                # decodes (a batching scheduler's) until its next request (_engine.release_compute_threads).
                release_compute_threads()

        return pieces, job, end

    def _run(self, prepared: Prepared, on_text: Callable[[str], None] | None) -> "Response":
        """Drain a request's pieces, then end it (KeyboardInterrupt ends it as cancelled and propagates)."""
        pieces, _, done = self._start(prepared, on_text)
        ok = False
        try:
            while True:
                next(pieces)
        except StopIteration as stop:
            ok = True
            return stop.value
        finally:
            done(ok)

    # -- metadata, readable after close ------------------------------------------------
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
    def profile(self) -> "Profile":
        return self._profile

    @property
    def context_params(self) -> "ContextParams":
        """The resolved engine settings of this lease's contexts (threads, batch sizes, KV type...)."""
        return self._params

    @property
    def facts(self) -> "ModelFacts":
        """What the GGUF header declares (layers, KV heads, head dims, window...), for KV arithmetic."""
        return self._weights.facts

    @property
    def chat_template(self) -> str:
        """Where the chat template came from: ``embedded``, ``builtin:<name>`` or ``explicit``."""
        return self._weights.template.origin

    def prompt_tokens(
        self, prompt: "str | Sequence[Mapping[str, Any]]", *, raw: bool = False, **options: Any
    ) -> list[int]:
        """The exact token ids a request with this prompt (message list, or raw text) evaluates; ``options``
        are the request's (``tools``, ``chat_template_kwargs``, ``allow_special_tokens`` change the prompt)."""
        if raw:
            return prompt_token_ids(self._weights, as_raw_text(prompt))
        request = request_settings(options)
        chat = chat_input(self._weights, as_messages(prompt), request)
        return prompt_token_ids(self._weights, chat.messages, allow_special_tokens=request.allow_special_tokens,
                                trusted=chat.trusted, tools=chat.tools, variables=chat.variables)

    @property
    def adapter(self) -> "AdapterInfo | None":
        """The LoRA adapter this lease's contexts apply (name, hashes, rank, targets), or None."""
        return self._adapter.info if self._adapter is not None else None

    def load_summary(self) -> "LoadSummary":
        return self._weights.summary

    # -- summaries: every kind answers them ---------------------------------------------
    @abstractmethod
    def memory_summary(self) -> "MemorySummary":
        """Weights, the KV of this lease's contexts now and what its policies may hold, and the process's
        measured memory."""

    def stats(self) -> "SchedulerStats":
        """A snapshot of the batching scheduler's counters; a kind without a scheduler has none to report
        and raises :class:`UnsupportedFeatureError` (``param="continuous_batching"``)."""
        raise UnsupportedFeatureError(
            f"stats() reports a continuous-batching scheduler, and this {self.kind} lease has none "
            "(supports('continuous_batching') is False); derive one with with_batching(n)",
            param="continuous_batching",
        )

    # -- builders: the ones a kind does not implement are refused here -------------------------
    def _refuse_builder(self, builder: str) -> UnsupportedFeatureError:
        """The one refusal of a builder this kind does not support (``builders``); ``param`` names it."""
        return UnsupportedFeatureError(
            f"{builder}() is not available on a {self._lifetime.noun}: {self._builder_note}", param=builder
        )

    def with_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        """A latency profile on the same weights (see :meth:`aner_nb.llm.LLMModel.with_optimizer`)."""
        raise self._refuse_builder("with_optimizer")

    def with_context_pool(self, *args: Any, **kwargs: Any) -> Any:
        """The same profile with another idle-context bound (see :meth:`aner_nb.llm.LLMModel.with_context_pool`)."""
        raise self._refuse_builder("with_context_pool")

    def with_adapter(self, *args: Any, **kwargs: Any) -> Any:
        """A lease applying a LoRA adapter (see :meth:`aner_nb.llm.LLMModel.with_adapter`)."""
        raise self._refuse_builder("with_adapter")

    def with_batching(self, *args: Any, **kwargs: Any) -> Any:
        """A throughput lease (see :meth:`aner_nb.llm.LLMModel.with_batching`)."""
        raise self._refuse_builder("with_batching")

    def session(self, *args: Any, **kwargs: Any) -> Any:
        """A persistent conversation (see :meth:`aner_nb.llm.LLMModel.session`)."""
        raise self._refuse_builder("session")

    def _context_kv_bytes(self) -> int:
        """KV bytes llama.cpp allocates for one context of this lease (its ``context_params``)."""
        return sum(c.bytes for c in kv_caches_for(self._weights.facts, self._params))


def with_text_callback(pieces: Pieces, on_text: Callable[[str], None] | None) -> Pieces:
    """``pieces``, calling ``on_text`` with each one on the consuming thread (no callback: unchanged)."""
    if on_text is None:
        return pieces

    def relay() -> Pieces:
        try:
            while True:
                piece = next(pieces)
                on_text(piece)
                yield piece
        except StopIteration as stop:
            return stop.value
        finally:
            pieces.close()

    return relay()
