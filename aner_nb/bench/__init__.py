"""Paired benchmarks: ABBA rounds, medians with min/max, ratios against a baseline, manifests."""

from ..llm.diagnostics import BatchShape, Divergence, first_divergence as divergence, is_near_tie
from .harness import BenchResult, Case, Side, lease_side, manifest, response_row, run_sides
from .evidence import BenchmarkBusyError, LeaseSettings, environment, exclusive, lease_settings
from .paired import Series, abba, compare, format_comparison

__all__ = [
    "Case",
    "Side",
    "BenchResult",
    "lease_side",
    "response_row",
    "run_sides",
    "manifest",
    "divergence",
    "Divergence",
    "BatchShape",
    "is_near_tie",
    "Series",
    "abba",
    "compare",
    "environment",
    "exclusive",
    "lease_settings",
    "LeaseSettings",
    "BenchmarkBusyError",
    "format_comparison",
]
