"""A persistent conversation that owns its context and keeps its history in the KV.

Each turn renders the whole conversation with the chat template and
tokenizes it, then keeps the longest identical token prefix already in the
KV and evaluates only the rest. Re-tokenizing the model's own answer can
differ from the tokens it sampled; the divergent tail is then removed and
re-evaluated, and ``cached_input_tokens`` says how much was reused.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from ._engine import Batch, NativeContext
from .adapters import SharedAdapter
from .chat import validate_messages
from .context_pool import ContextSlot
from .errors import InvalidRequestError, UnsupportedFeatureError
from .lifetime import Lifetime
from .prefix_pool import reusable_prefix
from .profiles import Profile
from .protocol import Done, Lease, LeaseKind, Pieces, with_text_callback
from .requests import Prepared, RawText, context_params, prepare
from .response import Response
from .runner import Job, run_request
from .stream import Stream
from .timings import PoolTimings
from .weights import SharedWeights

__all__ = ["Session"]


class Session(Lease):
    """``model.session(system=...)``: ``send`` a user turn, get the answer; history is kept.

    A session is a lease of kind ``session``: one request at a time, on its
    own context. ``generate(text)`` is ``send(text)``; ``chat`` is not
    available (the session owns the conversation).
    """

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
        self._weights = weights
        self._profile = profile
        self._params = params
        self._slot = slot
        self._system = system
        self._history: list[dict[str, str]] = [] if system is None else [{"role": "system", "content": system}]
        self._kv_tokens: list[int] = []  # tokens at KV positions 0..n-1 of sequence 0
        self._lifetime = life
        self._finalizer = life.watch(self)

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

    # Builders derive leases from leases; a session is a conversation, not a lease to derive from.
    def _no_builders(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedFeatureError("builders are not available on a session; derive profiles from the lease")

    with_optimizer = with_context_pool = with_batching = with_adapter = session = _no_builders

    def send(self, content: str, **options: Any) -> Response:
        """Add a user turn, answer it, and keep both in the history (options as ``generate``)."""
        return self.generate(content, **options)

    def stream(self, content: str, **options: Any) -> Stream:  # type: ignore[override]
        """Like ``send`` but yields verified text pieces; the turn joins the history when the stream ends."""
        return super().stream(content, **options)

    def chat(self, messages: Any, **options: Any) -> Response:  # type: ignore[override]
        raise UnsupportedFeatureError("a session keeps its own conversation: use send(text), not chat(messages)")

    # -- requests: the protocol's two steps ---------------------------------------
    def _prepare(self, messages: "tuple[dict[str, str], ...] | RawText", options: Mapping[str, Any]) -> Prepared:
        self._lifetime.check_open("a turn")
        if isinstance(messages, RawText):
            raise UnsupportedFeatureError("a session is a conversation: raw completion (complete) is not available")
        if len(messages) != 1 or messages[0]["role"] != "user":
            raise InvalidRequestError("a session turn is one user message: pass a str", param="prompt")
        return prepare(self._weights, (*self._history, *messages), options, context=self._params.n_ctx)

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

    def _end(self, job: Job, user: dict[str, str], ok: bool) -> None:
        """A finished turn joins the history and the KV; a failed or cancelled one leaves neither."""
        response = job.result
        if ok and response is not None and response.finish_reason != "cancelled":
            stored = self._slot.ctx.seq_pos_max(0) + 1  # the last sampled token was never evaluated
            self._kv_tokens = (list(job.prompt_tokens) + list(response.tokens))[:stored]
            self._history += [user, {"role": "assistant", "content": response.text}]
        else:
            self._slot.ctx.clear()
            self._kv_tokens = []
