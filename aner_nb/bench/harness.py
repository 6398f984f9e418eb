"""Paired request benchmarks: the same cases on several sides, ABBA order, one DataFrame.

A *side* is a name and a function that runs one :class:`Case` and returns a
row of measurements (``lease_side`` builds one from any lease). Every round
runs every case on every side; even rounds go forward through the sides, odd
rounds backward, so warm-up effects and drift hit all sides alike. Warm-up
rounds are run and dropped. The result keeps every row, a manifest of what was
measured (package versions, model fingerprint, device, threads, profile), and
summarises medians with min/max and ratios against a baseline side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import pandas as pd

from ..llm.progress import progress_bar
from .evidence import environment, exclusive, lease_settings, load_average

__all__ = ["Case", "Side", "BenchResult", "lease_side", "run_sides", "manifest", "METRICS"]

# Metrics a lease side reports (milliseconds, tokens, tokens per second).
METRICS = (
    "first_token_ms",
    "prompt_eval_ms",
    "decode_ms",
    "total_ms",
    "completion_tokens",
    "decode_tokens_per_s",
    "cached_input_tokens",
    "speculative_proposed",
    "speculative_accepted",
)


@dataclass(frozen=True)
class Case:
    """One request: the same prompt, budget and seed on every side."""

    name: str
    prompt: str
    max_tokens: int = 64
    seed: int = 0
    temperature: float = 0.0


@dataclass(frozen=True)
class Side:
    name: str
    run: Callable[[Case], Mapping[str, Any]]


def _ms(ns: int) -> float:
    return float("nan") if ns < 0 else ns / 1e6


def response_row(response: Any) -> dict[str, Any]:
    """Measurements of one Response, -1 (not measured) as NaN."""
    t = response.timings
    tps = response.tokens_per_second()
    return {
        "first_token_ms": _ms(t.first_token_duration),
        "prompt_eval_ms": _ms(t.prompt_eval_duration),
        "decode_ms": _ms(t.decode_duration),
        "total_ms": _ms(t.total_duration),
        "completion_tokens": response.usage.completion_tokens,
        "decode_tokens_per_s": float("nan") if tps < 0 else tps,
        "cached_input_tokens": response.usage.cached_input_tokens,
        "speculative_proposed": float("nan") if t.speculative_proposed_tokens < 0 else t.speculative_proposed_tokens,
        "speculative_accepted": float("nan") if t.speculative_accepted_tokens < 0 else t.speculative_accepted_tokens,
        "output_hash": response.output_hash,
        "text": response.text,
        "tokens": response.tokens,
    }


def lease_side(name: str, lease: Any) -> Side:
    """A side that sends each case to ``lease.generate``."""

    def run(case: Case) -> dict[str, Any]:
        r = lease.generate(case.prompt, max_tokens=case.max_tokens, seed=case.seed, temperature=case.temperature)
        return response_row(r)

    return Side(name, run)


def manifest(model: Any = None, **extra: Any) -> dict[str, Any]:
    """What a result was measured with: machine, build, packages, model fingerprint and resolved settings."""
    out: dict[str, Any] = environment()
    if model is not None:
        settings = lease_settings(model)
        out["model"] = {
            "name": model.name,
            "fingerprint": model.fingerprint,
            "architecture": model.architecture,
            "device": model.device,
            **(settings.as_dict() if settings is not None else {}),
        }
    out.update(extra)
    return out


@dataclass
class BenchResult:
    """Every measured row plus the manifest; summaries are computed from the rows."""

    frame: pd.DataFrame
    manifest: dict[str, Any] = field(default_factory=dict)
    baseline: str = ""

    def summary(self, metrics: Sequence[str] = ("first_token_ms", "decode_tokens_per_s", "total_ms")) -> pd.DataFrame:
        """Median, min and max per side and metric, and the ratio of medians to the baseline side."""
        rows = []
        for side, group in self.frame.groupby("side", sort=False):
            for metric in metrics:
                values = group[metric].astype(float).dropna()
                if values.empty:
                    continue
                rows.append({"side": side, "metric": metric, "median": values.median(), "min": values.min(),
                             "max": values.max(), "n": len(values)})
        table = pd.DataFrame(rows)
        if table.empty:
            return table
        base = table[table.side == self.baseline].set_index("metric")["median"]
        table["ratio_to_baseline"] = [_over(row["median"], base.get(row["metric"])) for _, row in table.iterrows()]
        return table

    def ratio(self, side: str, metric: str) -> float:
        """Median of ``metric`` on ``side`` over its median on the baseline."""
        f = self.frame
        return float(f[f.side == side][metric].median() / f[f.side == self.baseline][metric].median())

    def paired(self, side: str, metric: str, *, over: str | None = None) -> pd.Series:
        """Per round and case: ``metric`` on ``side`` over the same round's and case's on ``over`` (the baseline)."""
        f = self.frame
        a = f[f.side == side].set_index(["round", "case"])[metric].astype(float)
        b = f[f.side == (over or self.baseline)].set_index(["round", "case"])[metric].astype(float)
        return (a / b).dropna()

    def same_outputs(self, side: str) -> pd.Series:
        """Per case: does ``side`` produce the baseline's output (compared by output hash)?"""
        f = self.frame
        base = f[f.side == self.baseline].groupby("case")["output_hash"].first()
        other = f[f.side == side].groupby("case")["output_hash"].first()
        return (base == other).rename(f"{side} == {self.baseline}")


def run_sides(
    sides: Sequence[Side],
    cases: Sequence[Case],
    *,
    rounds: int = 3,
    warmup: int = 1,
    baseline: str | None = None,
    manifest_: Mapping[str, Any] | None = None,
    progress: bool | None = False,
) -> BenchResult:
    """Run every case on every side ``warmup + rounds`` times (ABBA order) and collect the rows.

    ``progress`` shows a ``tqdm.auto`` bar over the requests, warm-up included (``None``:
    when interactive, as ``llm.load``; default False, so scripts and benchmarks print
    nothing extra; ``%llm bench`` passes None).
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got {rounds}, {warmup}")
    rows = []
    total = (warmup + rounds) * len(cases) * len(sides)
    with exclusive("bench.run_sides"), progress_bar(progress, total=total, desc="bench", unit="req") as bar:
        load_start = load_average()
        for r in range(warmup + rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for case in cases:
                for side in order:
                    row = dict(side.run(case))
                    bar.update(1)
                    if r >= warmup:
                        rows.append({"side": side.name, "round": r - warmup, "case": case.name, **row})
        facts = {"rounds": rounds, "warmup": warmup, "order": "ABBA", "load_average_start": load_start,
                 "load_average_end": load_average()}
    return BenchResult(pd.DataFrame(rows), {**dict(manifest_ or {}), **facts}, baseline or sides[0].name)


def _over(value: float, base: "float | None") -> float:
    """``value / base``; NaN where the baseline has no such metric or a zero median (a count the baseline never has)."""
    if base is None or not base or base != base:
        return float("nan")
    return float(value / base)
