"""A persistent conversation that owns its context and keeps its history in the KV.

Each turn renders the whole conversation with the chat template and
tokenizes it, then keeps the longest identical token prefix already in the
KV and evaluates only the rest. Re-tokenizing the model's own answer can
differ from the tokens it sampled; the divergent tail is then removed and
re-evaluated, and ``cached_input_tokens`` says how much was reused.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from .context_pool import ContextSlot
from .prefix_pool import reusable_prefix
from .errors import BusyError, ClosedError, UnsupportedFeatureError
from .lease import Prepared, context_params, prepare, profile_timings
from .chat import validate_messages
from .profiles import Profile, RequestSettings
from .response import Response
from .runner import Job, run_request, validate_only
from .stream import Stream
from .weights import SharedWeights
from .adapters import SharedAdapter
from .timings import PoolTimings
from .protocol import Lease, LeaseKind
from ._engine import Batch, NativeContext

__all__ = ["Session"]


class _SessionState:
    def __init__(self, weights: SharedWeights, slot: ContextSlot, adapter: "SharedAdapter | None" = None) -> None:
        self.weights = weights
        self.slot = slot
        self.adapter = adapter
        self.lock = threading.Lock()
        self.active = False
        self.closed = False
        self.released = False

    def release(self) -> None:
        with self.lock:
            if self.released:
                return
            self.released = self.closed = True
        try:
            self.slot.free()  # context first, then the adapter it applies, then the weights
            if self.adapter is not None:
                self.adapter.release()
        finally:
            self.weights.release()


class Session(Lease):
    """``model.session(system=...)``: ``send`` a user turn, get the answer; history is kept."""

    def __init__(
        self,
        weights: SharedWeights,
        profile: Profile,
        *,
        system: str | None,
        model_name: str,
        adapter: "SharedAdapter | None" = None,
    ) -> None:
        if system is not None:
            validate_messages([{"role": "system", "content": system}])
        # A full SWA cache lets a turn trim a divergent tail below the sliding window.
        params = context_params(weights, profile, swa_full=True, adapter=adapter)
        weights.retain()
        retained = None
        try:
            if adapter is not None:
                adapter.retain()
                retained = adapter
            slot = ContextSlot(NativeContext(weights.native, params), Batch(params.n_batch, 1))
        except BaseException:
            if retained is not None:
                retained.release()
            weights.release()
            raise
        self._weights = weights
        self._profile = profile
        self._params = params
        self._model_name = model_name
        self._system = system
        self._history: list[dict[str, str]] = [] if system is None else [{"role": "system", "content": system}]
        self._kv_tokens: list[int] = []  # tokens at KV positions 0..n-1 of sequence 0
        self._state = _SessionState(weights, slot, adapter)
        self._finalizer = weakref.finalize(self, self._state.release)
        self._finalizer.atexit = True

    @property
    def messages(self) -> tuple[dict[str, str], ...]:
        return tuple(dict(m) for m in self._history)

    @property
    def cached_tokens(self) -> int:
        """Tokens of the conversation currently held in the session's KV."""
        return len(self._kv_tokens)

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def kind(self) -> LeaseKind:
        return "session"

    def _features(self) -> frozenset[str]:
        return frozenset({"generate", "stream"})

    def close(self) -> None:
        with self._state.lock:
            self._state.closed = True
            busy = self._state.active
        if not busy:
            self._state.release()

    def __repr__(self) -> str:
        turns = sum(1 for m in self._history if m["role"] == "user")
        return f"<Session {self._model_name!r} turns={turns} cached_tokens={self.cached_tokens}{' closed' if self.closed else ''}>"

    # Builders derive leases from leases; a session is a conversation, not a lease.
    def _no_builders(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedFeatureError("builders are not available on a session; derive profiles from the lease")

    with_optimizer = with_context_pool = with_batching = with_adapter = session = _no_builders

    def send(self, content: str, *, max_tokens: int = 256, temperature: float = 0.0, seed: int = 0, stop: Any = None) -> Response:
        """Add a user turn, answer it, and keep both in the history."""
        gen, _, done = self._begin(content, max_tokens, temperature, seed, stop)
        ok = False
        try:
            while True:
                next(gen)
        except StopIteration as stop_it:
            ok = True
            return stop_it.value
        finally:
            done(ok)

    def stream(self, content: str, *, max_tokens: int = 256, temperature: float = 0.0, seed: int = 0, stop: Any = None) -> Stream:
        gen, job, done = self._begin(content, max_tokens, temperature, seed, stop)
        return Stream(gen, job, done)

    def _begin(self, content: str, max_tokens: Any, temperature: Any, seed: Any, stop: Any) -> tuple[Any, Job, Any]:
        t_call = time.perf_counter_ns()
        st = self._state
        if st.closed:
            raise ClosedError("this session is closed; open a new one with model.session()")
        request = RequestSettings.of(max_tokens, temperature, seed, stop)
        user = {"role": "user", "content": content}
        messages = validate_messages([*self._history, user])
        prepared: Prepared = prepare(self._weights, messages, self._params.n_ctx, request, t_call)
        with st.lock:
            if st.active:
                raise BusyError("this session is already answering a turn; wait for it to finish")
            if st.closed:
                raise ClosedError("this session is closed; open a new one with model.session()")
            st.active = True
        job = Job(prompt_tokens=prepared.tokens, request=request, t_call=t_call, model_name=self._model_name)
        job.add(profile_timings(self._params, self._profile))
        if request.max_tokens == 0:
            return validate_only(job), job, lambda ok: self._end(None, None)
        ctx = st.slot.ctx
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
        gen = run_request(self._weights.native, ctx, st.slot.batch, job)
        return gen, job, lambda ok: self._end(job if ok else None, user)

    def _end(self, job: Job | None, user: dict[str, str] | None) -> None:
        st = self._state
        try:
            if job is not None and job.result is not None and job.result.finish_reason != "cancelled":
                response = job.result
                ctx = st.slot.ctx
                stored = ctx.seq_pos_max(0) + 1  # the last sampled token was never evaluated
                self._kv_tokens = (list(job.prompt_tokens) + list(response.tokens))[:stored]
                self._history += [user, {"role": "assistant", "content": response.text}]
            elif user is not None:
                st.slot.ctx.clear()  # a failed or cancelled turn leaves no history and no KV
                self._kv_tokens = []
        finally:
            with st.lock:
                st.active = False
                release = st.closed
            if release:
                st.release()
