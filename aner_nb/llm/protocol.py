"""The one lease protocol: what every kind of lease offers, written once.

A lease is something a user submits requests to: an ordinary, latency or
adapter lease (:class:`~aner_nb.llm.lease.LLMModel`), a batching lease
(:class:`~aner_nb.llm.batching.BatchingModel`) or a conversation
(:class:`~aner_nb.llm.session.Session`). Consumers (magics, the HTTP service,
widgets, benchmarks) switch on :attr:`Lease.kind` and :meth:`Lease.supports`,
never on class or module names.

``generate``, ``chat`` and ``stream`` are written here once. Each kind
supplies two steps: ``_prepare`` (its context limit and rules, through
:func:`aner_nb.llm.requests.prepare`) and ``_submit`` (how a prepared job
runs: on a pooled context, on the session's context, or on the batching
scheduler), which returns the request's piece generator and its end
callback. A request with ``max_tokens=0`` is validated and answered here
without touching a context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Generator, Literal, Mapping, Sequence, get_args

from .errors import ConfigurationError, InvalidRequestError
from .memory import kv_caches_for
from .requests import Prepared, RawText, as_messages, as_raw_text, new_job, prompt_token_ids
from .runner import Job, unstarted_response, validate_only
from .stream import Stream
from .chat import validate_messages

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._engine import ContextParams
    from .artifact import ModelFacts
    from .lifetime import Lifetime
    from .profiles import Profile
    from .requests import RequestOptions
    from .response import Response
    from .weights import LoadSummary, SharedWeights

__all__ = ["Lease", "LeaseKind", "KINDS", "FEATURES", "Pieces", "Done"]

LeaseKind = Literal["ordinary", "latency", "adapter", "throughput", "session"]
KINDS: tuple[str, ...] = get_args(LeaseKind)
FEATURES = (
    "generate", "chat", "stream", "complete", "session", "prefix_cache", "speculative", "continuous_batching", "adapter",
)

Pieces = Generator[str, None, "Response"]  # verified text pieces; returns the final Response
Done = Callable[[bool], None]  # the request's end callback; True when it ran to its end


class Lease(ABC):
    """What every lease kind offers: its kind and features, requests, metadata, and its lifetime.

    Subclasses set ``_weights``, ``_profile``, ``_params`` and ``_lifetime``
    and implement ``kind``, ``_features``, ``_prepare`` and ``_submit``.
    """

    _weights: "SharedWeights"
    _profile: "Profile"
    _params: "ContextParams"
    _lifetime: "Lifetime"

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
        self, prompt: str, *, on_text: Callable[[str], None] | None = None, **options: "Unpack[RequestOptions]"
    ) -> "Response":
        """Answer one user message formatted with the chat template.

        Options: ``max_tokens`` (0..65536, default 256; 0 only validates),
        ``temperature`` (0..2, default 0 = greedy), ``seed`` (0..2**32-1),
        ``stop`` (a string or up to 16), ``top_k`` (0 = off..vocabulary),
        ``top_p`` and ``min_p`` (0..1), ``repeat_penalty`` (> 0) over the last
        ``repeat_last_n`` tokens, ``presence_penalty`` and ``frequency_penalty``
        (-2..2), and ``grammar`` (GBNF) or ``json_schema`` (a JSON-schema dict)
        to constrain the output. ``on_text`` is called with each newly final
        piece of text.
        """
        return self._run(self._prepare(as_messages(prompt, strict_str=True), options), on_text)

    def complete(
        self, text: str, *, on_text: Callable[[str], None] | None = None, **options: "Unpack[RequestOptions]"
    ) -> "Response":
        """Continue ``text`` as given, without the chat template (for base models); options as ``generate``."""
        return self._run(self._prepare(as_raw_text(text), options), on_text)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        on_text: Callable[[str], None] | None = None,
        **options: "Unpack[RequestOptions]",
    ) -> "Response":
        """Answer a conversation given as ``[{"role": ..., "content": ...}, ...]`` (options as ``generate``)."""
        return self._run(self._prepare(validate_messages(messages), options), on_text)

    def stream(
        self, prompt: "str | Sequence[Mapping[str, Any]]", *, raw: bool = False, **options: "Unpack[RequestOptions]"
    ) -> Stream:
        """Like ``generate``/``chat`` (``complete`` with ``raw=True``) but yields verified text pieces."""
        prepared = self._prepare(as_raw_text(prompt) if raw else as_messages(prompt), options)
        return Stream(*self._start(prepared, None, streaming=True))

    @abstractmethod
    def _prepare(self, messages: "tuple[dict[str, str], ...] | RawText", options: Mapping[str, Any]) -> Prepared:
        """Check and tokenize one request against this lease's rules and context."""

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
        if prepared.request.max_tokens == 0:
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

    def prompt_tokens(self, prompt: "str | Sequence[Mapping[str, Any]]", *, raw: bool = False) -> list[int]:
        """The exact token ids a request with this prompt (message list, or raw text) evaluates."""
        return prompt_token_ids(self._weights, as_raw_text(prompt) if raw else as_messages(prompt))

    def load_summary(self) -> "LoadSummary":
        return self._weights.summary

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
