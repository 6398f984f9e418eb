"""Paired benchmarks: ABBA rounds, medians with min/max, ratios against a baseline."""

from .paired import Series, abba, compare, environment, format_comparison

__all__ = ["Series", "abba", "compare", "environment", "format_comparison"]
