"""A persistent conversation that owns its context and keeps its history in the KV.

Each turn renders the whole conversation with the chat template and
tokenizes it (special-token text in the turns stays plain text, except in
turns sent with ``allow_special_tokens=True``), then keeps the longest identical token prefix already in the
KV and evaluates only the rest. Re-tokenizing the model's own answer can
differ from the tokens it sampled; the divergent tail is then removed and
re-evaluated, and ``cached_input_tokens`` says how much was reused.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ._engine import Batch, NativeContext
from .adapters import SharedAdapter
from .chat import validate_messages
from .context_pool import ContextSlot
from .errors import InvalidRequestError, UnsupportedFeatureError
from .lifetime import Lifetime
from .prefix_pool import reusable_prefix
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
    ) -> None:
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
        keep = reusable_prefix(self._kv_tokens, prepared.tokens)
        t0 = time.perf_counter_ns()
        if not ctx.trim(0, keep):
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
