"""Memory summary of a lease: what is resident now, and what its configured policies may hold.

*Resident now*: the weights, the KV buffers of every live context on these
weights (read back from what llama.cpp reported allocating, see
``NativeContext.kv_buffers``), and what this lease's own pool keeps between
requests (retained prefix entries, idle contexts). *At most*: what the
lease's policies allow (the active request's context, the idle-context pool,
the prefix cache's entries, a batching lease's streams), each with its scope:
``per request``, ``per lease``, or ``shared across leases of one weights``.
The per-context KV figure is :func:`kv_caches_for` (llama.cpp's allocation
rule: padding, per-sequence streams, the sliding-window cache); the process
figures come from the OS (psutil for the current RSS, ``getrusage`` for the
peak). What the figures leave out is stated, not hidden.
"""

from __future__ import annotations

import html
import sys
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import psutil

from .memory import KVCache, kv_caches_for

__all__ = [
    "MemorySummary",
    "Holding",
    "memory_summary",
    "peak_rss_bytes",
    "context_kv_read_back",
    "pooled_kv_bytes",
    "lease_holdings",
    "KV_EXCLUDES",
    "ESTIMATE",
    "PER_REQUEST",
    "PER_LEASE",
    "SHARED",
]

KV_EXCLUDES = (
    "compute workspace (graph and logits buffers), allocator overhead and padding, "
    "accelerator driver/runtime memory, and the tokenizer's host memory"
)
PER_REQUEST = "per request"
PER_LEASE = "per lease"
SHARED = "shared across leases of one weights"
_READ_BACK = "read back from llama.cpp"
ESTIMATE = "estimate (llama.cpp's allocation rule)"


def peak_rss_bytes() -> int:
    """Peak resident set size of this process as the OS reports it; -1 where unavailable."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return -1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@dataclass(frozen=True)
class Holding:
    """``count`` things of one kind holding ``bytes`` in all, within ``scope``; ``source`` says how it is known."""

    what: str
    count: int
    bytes: int
    scope: str
    source: str


def context_kv_read_back(ctx: Any) -> int:
    """The KV bytes llama.cpp allocated for one live context (its reported buffers)."""
    return sum(b.buffer_bytes for b in ctx.kv_buffers)


def _describe(caches: Sequence[KVCache], kv_cache_type: str, facts: Any) -> str:
    parts = []
    for c in caches:
        streams = f" x {c.streams} streams" if c.streams > 1 else ""
        parts.append(f"{c.kind}: {c.cells} cells{streams} x {c.layers} layers")
    heads = facts.kv_heads_per_layer or facts.kv_heads
    return (
        "; ".join(parts)
        + f"; each cell x layer x kv heads ({heads}) x (K {facts.head_dim_k} + V {facts.head_dim_v} elements "
        f"as {kv_cache_type})"
    )


@dataclass(frozen=True)
class MemorySummary:
    """Bytes by source. ``kv_bytes`` is one context of this lease (``kv_scope``); ``resident`` what is
    held now and ``bounds`` what the configured policies may hold at most, each row with its scope."""

    model: str
    weights_bytes: int
    file_bytes: int
    context: int
    kv_cache_type: str
    flash_attention: str
    kv_bytes: int
    kv_scope: str
    kv_formula: str
    live_contexts: int
    sliding_window: int
    rss_bytes: int
    peak_rss_bytes: int
    cpu_extra_buffers: str = "off"  # quantized weights in AMX/repack buffers ("on") or plain ones
    excludes: str = KV_EXCLUDES
    resident_kv_bytes: int = 0  # every live context on these weights, read back from llama.cpp
    resident: tuple[Holding, ...] = ()
    bounds: tuple[Holding, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame({"value": pd.Series(self.as_dict(), dtype=object)})

    def holdings_frame(self) -> Any:
        """One row per holding: ``now`` (resident) and ``at most`` (policy bounds), with scope and source."""
        import pandas as pd

        rows = [{"": "now", **asdict(h)} for h in self.resident] + [{"": "at most", **asdict(h)} for h in self.bounds]
        return pd.DataFrame(rows, columns=["", "what", "count", "bytes", "scope", "source"])

    def _repr_html_(self) -> str:
        def mib(n: int) -> str:
            return "–" if n < 0 else f"{n / 2**20:,.2f} MiB"

        rows = [
            ("context", f"{self.context} tokens, {self.kv_cache_type}"),
            (f"KV of one context, {html.escape(self.kv_scope)}", mib(self.kv_bytes)),
            ("flash attention (requested)", html.escape(self.flash_attention)),
            ("CPU extra buffers (AMX/repack)", html.escape(self.cpu_extra_buffers)),
            ("process RSS now / peak", f"{mib(self.rss_bytes)} / {mib(self.peak_rss_bytes)}"),
        ]
        body = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>" for k, v in rows)
        head = "<tr><th></th><th style='text-align:left'>what</th><th>count</th><th>bytes</th><th>scope</th><th>source</th></tr>"
        held = "".join(
            f"<tr><td>{when}</td><td style='text-align:left'>{html.escape(h.what)}</td><td>{h.count}</td>"
            f"<td>{mib(h.bytes)}</td><td>{html.escape(h.scope)}</td><td>{html.escape(h.source)}</td></tr>"
            for when, group in (("now", self.resident), ("at most", self.bounds)) for h in group
        )
        return (
            f"<table>{body}</table><table>{head}{held}</table><p><small>KV = {html.escape(self.kv_formula)}. "
            f"Excludes {html.escape(self.excludes)}.</small></p>"
        )


def memory_summary(
    weights: Any,
    *,
    kv_bytes: int,
    kv_scope: str,
    contexts: int,
    params: Any = None,
    held: Sequence[Holding] = (),
    bounds: Sequence[Holding] = (),
) -> MemorySummary:
    """The summary of a lease on ``weights`` whose contexts take ``kv_bytes`` each (``kv_scope``).

    ``params`` (the lease's ``ContextParams``) describes the KV layout;
    ``held`` what the lease's pool keeps now, ``bounds`` what its policies
    allow (without: one row, ``kv_bytes`` within ``kv_scope``).
    """
    facts, settings = weights.facts, weights.settings
    if params is not None:
        formula = _describe(kv_caches_for(facts, params), params.kv_cache_type, facts)
    else:
        formula = (
            f"{settings.context} ctx x {facts.layers} layers x {facts.kv_heads} kv heads x "
            f"(K {facts.head_dim_k} + V {facts.head_dim_v} elements as {settings.kv_cache_type})"
        )
    live = weights.native.contexts()
    single = [c for c in live if c.params.n_seq_max == 1]
    multi = [c for c in live if c.params.n_seq_max > 1]
    resident = [Holding("weights", 1, weights.native.size_bytes, SHARED, "llama.cpp (llama_model_size)")]
    resident.append(Holding(
        "KV of live one-sequence contexts (requests, pools, prefix entries, sessions)", len(single),
        sum(map(context_kv_read_back, single)), SHARED, _READ_BACK,
    ))
    if multi:
        streams = sum(c.params.n_seq_max for c in multi)
        resident.append(Holding(
            f"KV of live batching contexts ({streams} streams)", len(multi),
            sum(map(context_kv_read_back, multi)), SHARED, _READ_BACK,
        ))
    resident += held
    rss = int(psutil.Process().memory_info().rss)
    return MemorySummary(
        model=facts.name,
        weights_bytes=weights.native.size_bytes,
        file_bytes=facts.file_size,
        context=settings.context,
        kv_cache_type=settings.kv_cache_type,
        flash_attention=settings.flash_attention,
        kv_bytes=kv_bytes,
        kv_scope=kv_scope,
        kv_formula=formula,
        live_contexts=contexts,
        sliding_window=facts.sliding_window,
        rss_bytes=rss,
        # The kernel updates its high-water mark lazily; the peak is at least the current RSS.
        peak_rss_bytes=max(peak_rss_bytes(), rss),
        cpu_extra_buffers=weights.summary.cpu_extra_buffers,
        resident_kv_bytes=sum(map(context_kv_read_back, live)),
        resident=tuple(resident),
        bounds=tuple(bounds) or (Holding("KV of this lease's context", 1, kv_bytes, kv_scope, ESTIMATE),),
    )


def pooled_kv_bytes(weights: Any, params: Any, estimate: int) -> tuple[int, str]:
    """KV bytes of one context with ``params``: read back from a live one when there is one, else ``estimate``."""
    for ctx in weights.native.contexts():
        if ctx.params == params:
            return context_kv_read_back(ctx), _READ_BACK
    return estimate, ESTIMATE


COUNTED = "counted (bytes of the stored entries)"


def tier_holdings(store: Any) -> tuple[list[Holding], list[Holding]]:
    """``(held, bounds)`` of a lease's prefix RAM tier (serialised KV in host memory); nothing without one.

    The disk tier is not memory; its directory's bound is ``prefix_cache_disk_bytes``.
    """
    if store is None or store.ram is None:
        return [], []
    held = [Holding("prefix RAM tier (serialised KV of evicted prefixes)", store.ram_entries, store.ram_bytes,
                    PER_LEASE, COUNTED)]
    bounds = [Holding("prefix RAM tier (prefix_cache_ram_bytes)", 1, store.ram.budget, PER_LEASE, "configured bound")]
    return held, bounds


def lease_holdings(weights: Any, params: Any, kv_bytes: int, pool: Any, profile: Any) -> tuple[list[Holding], list[Holding]]:
    """``(held, bounds)`` of an ordinary or latency lease: its pool now, and its policies' limits.

    A prefix-caching lease keeps at most ``prefix_cache_entries`` contexts,
    the running request's own included (it takes an entry or the place of
    one); an ordinary lease keeps up to ``max_idle_contexts`` idle contexts
    and creates one per active request (one at a time per lease).
    """
    one, source = pooled_kv_bytes(weights, params, kv_bytes)
    entries = profile.optimizer.prefix_cache_entries
    if entries:
        n = pool.entries
        held = [Holding("retained prefix entries (contexts)", n, n * one, PER_LEASE, source)]
        bounds = [Holding(
            "prefix-cache contexts (prefix_cache_entries; the running request's included)", entries,
            entries * kv_bytes, PER_LEASE, ESTIMATE,
        )]
        more_held, more_bounds = tier_holdings(getattr(pool, "store", None))
        held += more_held
        bounds += more_bounds
    else:
        n = pool.idle
        idle = profile.max_idle_contexts
        held = [Holding("idle pooled contexts", n, n * one, PER_LEASE, source)]
        bounds = [
            Holding("the running request's context", 1, kv_bytes, PER_REQUEST, ESTIMATE),
            Holding("idle pooled contexts (max_idle_contexts)", idle, idle * kv_bytes, PER_LEASE, ESTIMATE),
        ]
    return held, bounds
