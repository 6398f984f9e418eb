"""Paired A/B measurement: alternate the two sides in ABBA order and compare medians.

The machines this runs on are shared and noisy, so absolute numbers mean
little; what is reported is each side's median with min/max and the ratio of
medians measured in the same run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Series", "abba", "compare"]


@dataclass
class Series:
    """Measurements of one side, in one unit."""

    name: str
    values: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        if not self.values:
            raise ValueError(f"series {self.name!r} has no measurements")
        return {
            "median": statistics.median(self.values),
            "min": min(self.values),
            "max": max(self.values),
            "n": len(self.values),
        }


def abba(rounds: int, a: Callable[[], float], b: Callable[[], float], names: tuple[str, str] = ("A", "B")) -> tuple[Series, Series]:
    """Run ``rounds`` pairs: A,B then B,A, so warm-up and drift hit both sides alike."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    sa, sb = Series(names[0]), Series(names[1])
    for i in range(rounds):
        order = ((a, sa), (b, sb)) if i % 2 == 0 else ((b, sb), (a, sa))
        for fn, series in order:
            series.values.append(float(fn()))
    return sa, sb


def compare(title: str, a: Series, b: Series, unit: str, *, higher_is_better: bool) -> dict:
    """Medians, min/max and the ratio a/b of medians, as a plain dict for JSON and tables."""
    sa, sb = a.summary(), b.summary()
    return {
        "title": title,
        "unit": unit,
        "higher_is_better": higher_is_better,
        "a": {"name": a.name, **sa},
        "b": {"name": b.name, **sb},
        "ratio": sa["median"] / sb["median"],
    }


def format_comparison(result: dict) -> str:
    lines = [result["title"]]
    for side in ("a", "b"):
        s = result[side]
        lines.append(
            f"  {s['name']:<30} median {s['median']:10.3f} {result['unit']}  "
            f"min {s['min']:10.3f}  max {s['max']:10.3f}  n={s['n']}"
        )
    better = "higher is better" if result["higher_is_better"] else "lower is better"
    lines.append(f"  ratio {result['a']['name']} / {result['b']['name']} (medians): {result['ratio']:.3f} ({better})")
    return "\n".join(lines)
