"""``LLMModel``: the opaque lease a user holds, with one context per active request.

An ordinary lease, a latency lease (``with_optimizer``: prefix cache,
prompt-lookup speculation, engine threads) and an adapter lease
(``with_adapter``) are all :class:`LLMModel` objects; :attr:`kind` tells them apart.
The lease owns its context pool (a :class:`ContextPool`, or a
:class:`PrefixPool` for a prefix-caching profile) and, for an adapter lease,
its :class:`SharedAdapter`; the weights are shared with every lease derived
from the same load. Its :class:`Lifetime` releases the pool, then the
adapter (when no other lease or session uses it), then the lease's hold on
the weights, on ``close()`` or when the lease becomes unreachable.

Requests (``generate`` / ``chat`` / ``stream``) are the lease protocol's
(:mod:`aner_nb.llm.protocol`); this module supplies how one runs: acquire a
context from the pool, run it, give the context back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable

from .adapters import SharedAdapter, load_adapter
from .batching import BatchingModel, check_source_profile
from .context_pool import ContextPool, ContextSlot
from .errors import ConfigurationError
from .lifetime import Lifetime
from .prefix_pool import PrefixPool
from .prefix_store import system_prefix_length, tier_store
from .prefix_tiers import pinned_lengths
from .options import RequestSettings
from .profiles import DEFAULT_DISK_BYTES, BatchingSettings, OptimizerSettings, Profile
from .protocol import BUILDERS, Done, Lease, LeaseKind, Pieces, RequestRules, with_text_callback
from .requests import Prepared, RawText, context_params, template_opening
from .reuse import ReuseShape
from .runner import Job, run_request
from .session import Session
from .speculation import lease_speculator
from .summary import MemorySummary, lease_holdings, memory_summary
from .weights import SharedWeights

__all__ = ["LLMModel"]


@dataclass(frozen=True)
class _Owned:
    """What the lease owns besides its holds on the weights and the adapter (those are in its lifetime)."""

    pool: "ContextPool | PrefixPool"


class LLMModel(Lease):
    """An opaque lease on loaded weights. Create it with :func:`aner_nb.llm.load`."""

    builders = frozenset(BUILDERS)

    def __init__(
        self, weights: SharedWeights, profile: Profile | None = None, *, adapter: SharedAdapter | None = None
    ) -> None:
        profile = profile or Profile()
        opt = profile.optimizer
        # Latency contexts keep a full sliding-window cache: prefix trims and rejected
        # proposals remove positions that a window-sized SWA cache may no longer hold.
        params = context_params(
            weights, profile, swa_full=opt.is_latency_profile, adapter=adapter, reuses_prefixes=opt.prefix_cache_entries > 0,
        )
        # Measured (or read from the cache) before anything is owned: a failed probe leaves nothing behind.
        self._speculator = lease_speculator(weights, params, opt.draft_tokens)
        life = Lifetime(
            "lease", busy_advice=" (one request at a time per lease: wait, or use with_batching for concurrency)"
        )
        with life.building(weights, adapter) as stack:  # the adapter frees any context still applying it
            pool: ContextPool | PrefixPool
            if opt.prefix_cache_entries:
                trivial = template_opening(weights)
                store = tier_store(weights, profile, params, trivial_prefix=trivial)
                # A disk tier serves the first request after a restart: its context is made with the lease.
                pool = PrefixPool(
                    weights.native, params, capacity=opt.prefix_cache_entries,
                    max_tokens=opt.prefix_cache_tokens, trivial_prefix=trivial, store=store,
                    warm=store is not None and store.disk is not None,
                )
            else:
                pool = ContextPool(weights.native, params, profile.max_idle_contexts)
            stack.callback(pool.close)  # the lease's idle contexts go first
        self._state = _Owned(pool)
        self._establish(weights, profile, params, life, adapter)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        adapter = f" adapter={self._adapter.sha256[:12]}" if self._adapter is not None else ""
        return (
            f"<LLMModel {self.name!r} {self.architecture} {self.kind} ctx={self.context} "
            f"device={self.device} sha256={self.fingerprint[:12]}{adapter} {state}>"
        )

    @property
    def kind(self) -> LeaseKind:
        return "adapter" if self._adapter is not None else self._profile.kind  # type: ignore[return-value]

    def _features(self) -> frozenset[str]:
        opt = self._profile.optimizer
        optional = {
            "prefix_cache": opt.prefix_cache_entries > 0,
            "speculative": opt.draft_tokens > 0,  # speculative_tokens >= batch_tokens decodes plainly
            "adapter": self._adapter is not None,
        }
        return frozenset(
            {"generate", "chat", "stream", "complete", "session", "embed", *(f for f, on in optional.items() if on)}
        )

    # -- requests: the protocol's two steps ---------------------------------------
    def _rules(self, messages: "tuple[dict[str, str], ...] | RawText", request: RequestSettings) -> RequestRules:
        """The whole context; a speculative lease verifies proposals against the greedy choice only."""
        return RequestRules(messages, context=self.context, greedy_only=self._profile.optimizer.draft_tokens > 0)

    def _submit(
        self, prepared: Prepared, job: Job, on_text: Callable[[str], None] | None, streaming: bool
    ) -> tuple[Pieces, Done]:
        """Acquire a context (the pool may already hold part of the prompt), run the job, give it back."""
        pool = self._state.pool
        # A scored prompt is evaluated from position 0 (logits on every row): no cached prefix is reused.
        acquired = pool.acquire(() if prepared.request.prompt_logprobs else prepared.tokens)
        job.n_cached = acquired.n_cached
        job.cached_logits = acquired.logits  # a whole prompt restored from the tiers: nothing to evaluate
        job.capture_logits = getattr(pool, "wants_prompt_logits", False)
        for part in acquired.timings:
            job.add(part)
        pieces = run_request(
            self._weights.native, acquired.slot.ctx, acquired.slot.batch, job, speculator=self._speculator
        )

        def done(ok: bool, slot: ContextSlot = acquired.slot) -> None:
            if job.result is None:
                outcome = "failed"  # an engine error: the KV state is unknown
            elif ok and job.result.finish_reason != "cancelled":
                outcome = "ok"
            else:
                outcome = "cancelled"
            if outcome == "ok" and getattr(pool, "store", None) is not None:
                # Pinned system prefixes: the part before the first user message (and a checkpoint).
                system = system_prefix_length(self._weights, prepared.messages, prepared.tokens)
                pins = pinned_lengths(system, len(prepared.tokens), trivial=pool.trivial_prefix)  # type: ignore[union-attr]
                pool.give_back(  # type: ignore[call-arg]
                    slot, prepared.tokens, outcome=outcome, pins=pins, logits=job.prompt_logits
                )
                return
            pool.give_back(slot, prepared.tokens, outcome=outcome)

        return with_text_callback(pieces, on_text), done

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
        prefix_cache_ram_bytes: int = 0,
        prefix_cache_dir: "str | os.PathLike[str] | None" = None,
        prefix_cache_disk_bytes: int = DEFAULT_DISK_BYTES,
    ) -> "LLMModel":
        """A latency profile: engine threads and batch sizes, prefix cache, prompt-lookup speculation.

        The new lease has its own (empty) prefix pool; this lease is unchanged.
        ``prefix_cache_ram_bytes`` keeps prefixes evicted from the pool as
        serialised KV in host memory (LRU, at most that many bytes);
        ``prefix_cache_dir`` keeps every retained prefix in that directory too
        (at most ``prefix_cache_disk_bytes``, LRU by mtime; processes may share
        it), so a new process (a restarted kernel) restores it instead of
        evaluating it. Stored entries are checked against the model, adapter,
        KV type, context layout and engine build before reuse; both are off by default.
        """
        settings = OptimizerSettings(
            threads=threads, prefill_threads=prefill_threads, batch_tokens=batch_tokens,
            micro_batch_tokens=micro_batch_tokens, prefix_cache_entries=prefix_cache_entries,
            prefix_cache_tokens=prefix_cache_tokens, speculative_tokens=speculative_tokens,
            prefix_cache_ram_bytes=prefix_cache_ram_bytes, prefix_cache_dir=prefix_cache_dir,  # type: ignore[arg-type]
            prefix_cache_disk_bytes=prefix_cache_disk_bytes,
        )
        self._check_open("with_optimizer()")
        return LLMModel(self._weights, self._profile.with_(optimizer=settings), adapter=self._adapter)

    def with_context_pool(self, max_idle: int) -> "LLMModel":
        """The same profile keeping up to ``max_idle`` (0..4) idle contexts; 0 disables retention.

        A prefix-cache lease retains contexts in its prefix pool instead, so ``max_idle`` is ignored there.
        """
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
        self._lifetime.check_open(what)

    # -- sessions and summaries -----------------------------------------------
    def session(self, system: str | None = None, *, resume: "str | os.PathLike[str] | None" = None) -> Session:
        """A persistent conversation with its own context; history is not re-evaluated per turn.

        ``resume=path`` restores a conversation saved with ``Session.save(path)`` (history and KV);
        a file that does not match this lease raises ``StateMismatchError`` (``reason`` says why).
        """
        self._check_open("session()")
        return Session(
            self._weights, self._profile, system=system, model_name=self.name, adapter=self._adapter, resume=resume
        )

    def with_batching(
        self, max_sequences: int, *, prefix_cache_entries: int = 0, prefix_cache_tokens: int = 2048,
        prefix_cache_ram_bytes: int = 0, prefix_cache_dir: "str | os.PathLike[str] | None" = None,
        prefix_cache_disk_bytes: int = DEFAULT_DISK_BYTES, speculative_tokens: int = 0,
    ) -> BatchingModel:
        """A throughput lease on the same weights: one shared context decoding up to ``max_sequences`` requests.

        ``prefix_cache_entries`` (0..16) evaluated prompt prefixes of up to
        ``prefix_cache_tokens`` tokens are kept and shared by later requests
        that start with the same tokens (a common system prompt is evaluated
        once); each entry costs one more sequence's KV. On an adapter lease
        the shared context applies the same adapter (its own hold on it).

        The new profile holds the batching settings (``profile.batching``);
        the shared prefixes are its optimizer's ``prefix_cache_entries`` and
        ``prefix_cache_tokens``, the latency profile's names and bounds (a
        latency source profile is refused, so they were 0 there).
        ``prefix_cache_ram_bytes``, ``prefix_cache_dir`` and
        ``prefix_cache_disk_bytes`` keep entries evicted from the spare streams
        (and, with a directory, every evaluated prompt) in host RAM and on disk,
        as on :meth:`with_optimizer`.
        ``speculative_tokens`` (0..64) lets plain greedy requests verify
        prompt-lookup proposals inside the shared steps, where the measured row
        costs say they raise the step's speed (:func:`~aner_nb.llm.draft_policy.batch_drafts`);
        sampled and constrained requests decode one token per step beside them.
        """
        self._check_open("with_batching()")
        settings = BatchingSettings(max_sequences=max_sequences)
        optimizer = replace(
            self._profile.optimizer, prefix_cache_entries=prefix_cache_entries, prefix_cache_tokens=prefix_cache_tokens,
            prefix_cache_ram_bytes=prefix_cache_ram_bytes, prefix_cache_dir=prefix_cache_dir,
            prefix_cache_disk_bytes=prefix_cache_disk_bytes, speculative_tokens=speculative_tokens,
        )
        check_source_profile(self._profile, settings)
        return BatchingModel(self._weights, self._profile.with_(batching=settings, optimizer=optimizer), adapter=self._adapter)

    @property
    def reuse_shape(self) -> ReuseShape | None:
        """Where a prompt may start over this lease's cached prefixes (:class:`~aner_nb.llm.reuse.ReuseShape`); None without a prefix cache."""
        return self._params.prefix_reuse

    def prefix_tier_stats(self) -> "dict[str, object] | None":
        """The prefix tiers' counters (hits, misses, skips by reason, bytes by tier) and holdings; None without tiers."""
        store = getattr(self._state.pool, "store", None)
        return store.snapshot() if store is not None else None

    def memory_summary(self) -> MemorySummary:
        """Weights, the KV of live contexts and of this lease's pool now, what its policies may hold, and
        the process's measured memory."""
        kv_bytes = self._context_kv_bytes()
        held, bounds = lease_holdings(self._weights, self._params, kv_bytes, self._state.pool, self._profile)
        return memory_summary(
            self._weights,
            kv_bytes=kv_bytes,
            kv_scope="per request (one context per active request)",
            contexts=self._weights.native.live_contexts(),
            params=self._params, held=held, bounds=bounds,
        )
