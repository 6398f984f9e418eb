"""A persistent conversation that owns its context and keeps its history in the KV.

Each turn renders the whole conversation with the chat template and
tokenizes it (special-token text in the turns stays plain text, except in
turns sent with ``allow_special_tokens=True``), then keeps the longest identical token prefix already in the
KV and evaluates only the rest. Re-tokenizing the model's own answer can
differ from the tokens it sampled; the divergent tail is then removed and
re-evaluated, and ``cached_input_tokens`` says how much was reused.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from . import kv_identity
from ._engine import Batch, NativeContext, engine_build
from .adapters import SharedAdapter
from .chat import validate_messages
from .context_pool import ContextSlot
from .errors import ConfigurationError, EngineError, InvalidRequestError, StateMismatchError, UnsupportedFeatureError
from .lifetime import Lifetime
from .prefix_pool import common_prefix_length
from .reuse import conversation_keep
from .options import RequestSettings
from .profiles import Profile
from .protocol import Done, Lease, LeaseKind, Pieces, RequestRules, with_text_callback
from .requests import Prepared, RawText, context_params
from .response import Response
from .runner import Job, run_request
from .stream import Stream
from .summary import ESTIMATE, PER_LEASE, Holding, MemorySummary, memory_summary, pooled_kv_bytes
from .timings import PoolTimings
from .weights import SharedWeights

__all__ = ["Session"]


class Session(Lease):
    """``model.session(system=...)``: ``send`` a user turn, get the answer; history is kept.

    A session is a lease of kind ``session``: one request at a time, on its
    own context. ``generate(text)`` is ``send(text)``; ``chat`` is not
    available (the session owns the conversation).

    ``save(path)`` writes the conversation (history, trusted turns) and its KV
    to one file (``kv_identity`` format, written atomically);
    ``model.session(resume=path)`` restores both, so the next answer is the one
    the uninterrupted session gives. A file that does not match the lease
    (another model, adapter, llama.cpp build, KV type or context layout; corrupt,
    truncated, a newer format) raises ``StateMismatchError`` with its ``reason``:
    resuming is asked for explicitly, so it never falls back to a silent cold start.
    """

    _builder_note = "builders derive leases from leases, and a session is a conversation: derive profiles from the lease"
    _request_noun = "a turn"

    def __init__(
        self,
        weights: SharedWeights,
        profile: Profile,
        *,
        system: str | None,
        model_name: str = "",
        adapter: SharedAdapter | None = None,
        resume: "str | os.PathLike[str] | None" = None,
    ) -> None:
        if resume is not None and system is not None:
            raise ConfigurationError(
                "a resumed session keeps the system message it was saved with: pass system= or resume=, not both",
                param="system",
            )
        if resume is not None and not isinstance(resume, (str, os.PathLike)):
            raise ConfigurationError(f"resume must be a path, got {type(resume).__name__}", param="resume")
        if system is not None:
            validate_messages([{"role": "system", "content": system}])
        # A full SWA cache lets a turn trim a divergent tail below the sliding window.
        params = context_params(weights, profile, swa_full=True, adapter=adapter)
        life = Lifetime("session", busy_advice=" (a session answers one turn at a time: wait for it to finish)")
        with life.building(weights, adapter) as stack:
            slot = ContextSlot(NativeContext(weights.native, params), Batch(params.n_batch, 1))
            stack.callback(slot.free)  # the context first, then the adapter it applies, then the weights
        self._slot = slot
        self._system = system
        self._history: list[dict[str, str]] = [] if system is None else [{"role": "system", "content": system}]
        # Indices of history messages sent with allow_special_tokens=True: their special-token text stays
        # special when later turns re-render the conversation (the rest is plain text, as in any request).
        self._trusted: frozenset[int] = frozenset()
        self._kv_tokens: list[int] = []  # tokens at KV positions 0..n-1 of sequence 0
        self._establish(weights, profile, params, life, adapter)
        if resume is not None:
            try:
                self._resume(Path(resume))
            except BaseException:
                self.close()
                raise

    @property
    def messages(self) -> tuple[dict[str, str], ...]:
        return tuple(dict(m) for m in self._history)

    @property
    def cached_tokens(self) -> int:
        """Tokens of the conversation currently held in the session's KV."""
        return len(self._kv_tokens)

    @property
    def kind(self) -> LeaseKind:
        return "session"

    def _features(self) -> frozenset[str]:
        return frozenset({"generate", "stream"})

    def __repr__(self) -> str:
        turns = sum(1 for m in self._history if m["role"] == "user")
        return f"<Session {self.name!r} turns={turns} cached_tokens={self.cached_tokens}{' closed' if self.closed else ''}>"

    def send(self, content: str, **options: Any) -> Response:
        """Add a user turn, answer it, and keep both in the history (options as ``generate``)."""
        return self.generate(content, **options)

    def stream(self, content: str, **options: Any) -> Stream:  # type: ignore[override]
        """Like ``send`` but yields verified text pieces; the turn joins the history when the stream ends."""
        return super().stream(content, **options)

    def chat(self, messages: Any, **options: Any) -> Response:  # type: ignore[override]
        raise UnsupportedFeatureError("a session keeps its own conversation: use send(text), not chat(messages)")

    # -- requests: the protocol's two steps ---------------------------------------
    _scores_prompts = False  # a turn evaluates only what the kept history lacks

    def _rules(self, messages: "tuple[dict[str, str], ...] | RawText", request: RequestSettings) -> RequestRules:
        """One user turn after the history, within the session's context."""
        if isinstance(messages, RawText):
            raise UnsupportedFeatureError("a session is a conversation: raw completion (complete) is not available")
        if len(messages) != 1 or messages[0]["role"] != "user":
            raise InvalidRequestError("a session turn is one user message: pass a str", param="prompt")
        trusted = self._trusted | ({len(self._history)} if request.allow_special_tokens else set())
        return RequestRules((*self._history, *messages), context=self._params.n_ctx, trusted=frozenset(trusted))

    def _submit(
        self, prepared: Prepared, job: Job, on_text: Callable[[str], None] | None, streaming: bool
    ) -> tuple[Pieces, Done]:
        """Keep the longest prefix of the KV that the new conversation shares, evaluate the rest."""
        ctx = self._slot.ctx
        keep = conversation_keep(common_prefix_length(self._kv_tokens, prepared.tokens), len(prepared.tokens))
        t0 = time.perf_counter_ns()
        # Nothing to remove: the KV is the one the last turn (or a resumed save) left, valid to continue.
        # A restored sliding-window state holds only its last window, so trim() would refuse it even then.
        untouched = 0 < keep == len(self._kv_tokens) and ctx.seq_pos_max(0) == keep - 1
        if not untouched and not ctx.trim(0, keep):
            keep = 0  # the kept range did not survive: start this turn from an empty KV
            ctx.clear()
        job.add(PoolTimings(
            cached_input_tokens=keep, context_clear_duration=time.perf_counter_ns() - t0,
            context_pool_reused=1 if self._kv_tokens else 0,
        ))
        job.n_cached = keep
        self._kv_tokens = []  # unknown until the turn succeeds
        pieces = run_request(self._weights.native, ctx, self._slot.batch, job)
        return with_text_callback(pieces, on_text), lambda ok: self._end(job, prepared.messages[-1], ok)

    # -- saving and resuming (kv_identity's file format) ---------------------------
    _SAVED_KIND = "aner_nb.session"

    def _identity(self) -> kv_identity.KVIdentity:
        return kv_identity.KVIdentity.for_context(
            self._slot.ctx, model_sha256=self._weights.fingerprint,
            adapter_sha256=self._adapter.sha256 if self._adapter is not None else None, build=engine_build(),
        )

    def _payload_cap(self) -> int:
        # A sequence's state is its KV cells plus a few bytes of metadata per cell and layer.
        return 2 * self._context_kv_bytes() + (1 << 20)

    def save(self, path: "str | os.PathLike[str]") -> Path:
        """Write the conversation and its KV to ``path`` atomically (temporary file, fsync, rename); returns it.

        Refused (``BusyError``) while a turn runs, and on a closed session.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidRequestError(f"path must be a str or os.PathLike, got {type(path).__name__}", param="path")
        target = Path(path)
        life = self._lifetime
        life.begin("save()")
        try:
            tokens = list(self._kv_tokens)
            payload = self._slot.ctx.seq_state_bytes(0) if tokens else b""
            meta = {
                "kind": self._SAVED_KIND,
                "messages": [dict(m) for m in self._history],
                "trusted": sorted(self._trusted),
            }
            data = kv_identity.pack(self._identity(), tokens, payload, meta=meta)
        finally:
            life.end()
        kv_identity.write_atomic(target, data)
        return target

    def _resume(self, path: Path) -> None:
        """Restore history and KV from a ``save`` file, every check before the engine sees the bytes."""
        # a user's file, perhaps copied over in place meanwhile: read, not mapped (a mapping would SIGBUS)
        saved = kv_identity.read_file(path, self._identity(), max_payload_bytes=self._payload_cap(), mapped=False)
        meta, tokens = saved.meta, list(saved.tokens)
        if not isinstance(meta, dict) or meta.get("kind") != self._SAVED_KIND or set(meta) != {"kind", "messages", "trusted"}:
            raise StateMismatchError(f"{path.name} is a state file but not a saved session", reason="corrupt")
        try:
            history = list(validate_messages(meta["messages"]))
        except InvalidRequestError as exc:
            raise StateMismatchError(f"the saved session's history is invalid: {exc}", reason="corrupt") from None
        trusted = meta["trusted"]
        if (
            not isinstance(trusted, list)
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(history) for i in trusted)
        ):
            raise StateMismatchError("the saved session's trusted turn indices are invalid", reason="corrupt")
        n_vocab = self._weights.native.n_vocab
        if len(tokens) > self._params.n_ctx or any(not 0 <= t < n_vocab for t in tokens):
            raise StateMismatchError("the saved session's tokens do not fit this model and context", reason="corrupt")
        if bool(tokens) != bool(saved.payload):
            raise StateMismatchError("the saved session's tokens and KV state disagree", reason="corrupt")
        ctx = self._slot.ctx
        ctx.clear()
        if tokens:
            try:
                ctx.seq_state_load(0, saved.payload)
            except EngineError as exc:
                ctx.clear()
                raise StateMismatchError(f"llama.cpp refused the saved KV state: {exc}", reason="layout") from None
            if ctx.seq_pos_max(0) != len(tokens) - 1:
                ctx.clear()
                raise StateMismatchError(
                    f"the saved KV state holds positions up to {ctx.seq_pos_max(0)}, not the {len(tokens)} saved tokens",
                    reason="corrupt",
                )
        self._history = history
        self._system = history[0]["content"] if history and history[0]["role"] == "system" else None
        self._trusted = frozenset(trusted)
        self._kv_tokens = tokens

    def memory_summary(self) -> MemorySummary:
        """Weights, the KV of the session's one context (the conversation it holds now), and the process's
        measured memory."""
        kv_bytes = self._context_kv_bytes()
        one, source = pooled_kv_bytes(self._weights, self._params, kv_bytes)
        held = [Holding(f"the conversation's context ({self.cached_tokens} tokens)", 1, one, PER_LEASE, source)]
        bounds = [Holding("the session's context (its whole conversation)", 1, kv_bytes, PER_LEASE, ESTIMATE)]
        return memory_summary(
            self._weights, kv_bytes=kv_bytes, kv_scope="per session (one context holding the conversation)",
            contexts=self._weights.native.live_contexts(), params=self._params, held=held, bounds=bounds,
        )

    def _end(self, job: Job, user: dict[str, str], ok: bool) -> None:
        """A finished turn joins the history and the KV; a failed or cancelled one leaves neither."""
        response = job.result
        if ok and response is not None and response.finish_reason != "cancelled":
            stored = self._slot.ctx.seq_pos_max(0) + 1  # the last sampled token was never evaluated
            self._kv_tokens = (list(job.prompt_tokens) + list(response.tokens))[:stored]
            if job.request.allow_special_tokens:
                self._trusted |= {len(self._history)}
            self._history += [user, {"role": "assistant", "content": response.text}]
        else:
            self._slot.ctx.clear()
            self._kv_tokens = []
