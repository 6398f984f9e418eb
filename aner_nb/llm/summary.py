"""Memory summary of a lease: what the weights and KV take, and what the OS measured.

The KV figure is the formula of :func:`kv_estimate`; the process figures come
from the OS (psutil for the current RSS, ``getrusage`` for the peak). What the
estimate leaves out is stated, not hidden.
"""

from __future__ import annotations

import html
import sys
from dataclasses import asdict, dataclass
from typing import Any

import psutil

__all__ = ["MemorySummary", "memory_summary", "peak_rss_bytes", "KV_EXCLUDES"]

KV_EXCLUDES = (
    "compute workspace (graph and logits buffers), allocator overhead and padding, "
    "accelerator driver/runtime memory, and the tokenizer's host memory"
)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process as the OS reports it; -1 where unavailable."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return -1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@dataclass(frozen=True)
class MemorySummary:
    """Bytes by source. ``kv_bytes`` covers ``kv_scope``; see ``excludes``."""

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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame({"value": pd.Series(self.as_dict(), dtype=object)})

    def _repr_html_(self) -> str:
        def mib(n: int) -> str:
            return "–" if n < 0 else f"{n / 2**20:,.1f} MiB"

        rows = [
            ("weights (resident tensors)", mib(self.weights_bytes)),
            (f"KV estimate, {html.escape(self.kv_scope)}", mib(self.kv_bytes)),
            ("context", f"{self.context} tokens, {self.kv_cache_type}"),
            ("flash attention (requested)", html.escape(self.flash_attention)),
            ("CPU extra buffers (AMX/repack)", html.escape(self.cpu_extra_buffers)),
            ("live contexts", str(self.live_contexts)),
            ("process RSS now / peak", f"{mib(self.rss_bytes)} / {mib(self.peak_rss_bytes)}"),
        ]
        body = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>" for k, v in rows)
        return (
            f"<table>{body}</table><p><small>KV = {html.escape(self.kv_formula)}. "
            f"Excludes {html.escape(self.excludes)}.</small></p>"
        )


def memory_summary(weights: Any, *, kv_bytes: int, kv_scope: str, contexts: int) -> MemorySummary:
    facts, settings = weights.facts, weights.settings
    formula = (
        f"{settings.context} ctx x {facts.layers} layers x {facts.kv_heads} kv heads x "
        f"(K {facts.head_dim_k} + V {facts.head_dim_v} elements as {settings.kv_cache_type})"
    )
    if facts.sliding_window:
        formula += f"; an upper bound: sliding-window layers keep about {facts.sliding_window} cells"
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
    )
