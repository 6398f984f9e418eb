"""What a verification step of k rows costs on this machine, measured once per model, build, CPU and threads.

The draft policy (:mod:`draft_policy`) weighs expected accepted tokens
against ``D(k) / D(1)``, the cost of a k-row decode step (logits on every
row, as verification needs) over a one-row step. That ratio depends on the
model (a 262k-token vocabulary makes every row pay a large output product),
the build's kernels (some pair batch columns, so odd counts cost like the
next even one), the CPU and the thread count, so it is measured, not
assumed: a throwaway context with the lease's engine settings evaluates a
short prompt, then steps of each count in :data:`PROBE_ROWS` (up to the
lease's ``speculative_tokens + 1``) in interleaved rounds after a warm-up,
each between two one-row steps. A count's cost is the median over rounds of
its time over those neighbours' (:func:`paired_ratios`): on a shared
machine a slow minute inflates a step and its neighbours alike, where
separate medians let one slow one-row sample scale every ratio (on a 2-vCPU
VM, a cached table's one-row step of 21.5 ms, where Gemma's decode loop
took 15.4 ms, made every count look 28% cheaper than it was). The
result is cached on disk under the
cache directory keyed by everything it depends on; a cache file that does
not parse, names another key or holds implausible numbers is measured
again and replaced (atomically).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from ._engine import Batch, ContextParams, NativeContext, NativeModel, engine_build
from .cache import cache_dir
from .cpu_guard import build_signature, cpu_signature
from .draft_policy import MAX_SPECULATIVE_TOKENS, RowCosts

__all__ = [
    "PROBE_ROWS", "PROBE_PREFIX", "PROBE_ROUNDS", "cost_key", "cost_path", "paired_ratios", "measure_row_costs", "row_costs",
]

log = logging.getLogger("aner_nb.llm")

PROBE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 40, 48, 56, 65)
PROBE_PREFIX = 64  # KV positions before the measured rows, as after a short prompt
PROBE_ROUNDS = 4
# 2: points measured since idle OpenMP teams are freed (_engine.release_compute_threads); a version-1 point
# could include every graph's wait for a worker that another thread's idle team had throttled.
# 3: each count against its neighbouring one-row steps (paired_ratios); a version-2 table could hold a
# one-row median from a slow moment, and every ratio was off by as much.
_VERSION = 3
_MAX_SECONDS = 60.0  # a cached step time above this is not a measurement of a decode step


def _counts(rows: int) -> list[int]:
    counts = [k for k in PROBE_ROWS if k < rows]
    return counts + [rows]


def cost_key(fingerprint: str, params: ContextParams) -> dict[str, Any]:
    """Everything the costs depend on: the model, the engine build, the CPU and the context's engine settings."""
    return {
        "version": _VERSION, "model": fingerprint, "build": build_signature(), "engine": engine_build(),
        "cpu": cpu_signature()[0], "threads": params.n_threads, "threads_batch": params.n_threads_batch,
        "n_ubatch": params.n_ubatch, "flash_attention": params.flash_attention,
        "kv_cache_type": params.kv_cache_type, "offload": params.offload,
        "adapter": params.adapter is not None,
    }


def cost_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "row-costs" / f"{digest}.json"


def paired_ratios(rounds: Sequence[Sequence[tuple[int, float, float]]]) -> dict[int, float]:
    """Each count's cost over a one-row step: the median over rounds of its time over its neighbours' mean.

    ``rounds`` holds, per round, ``(rows, seconds, one-row seconds around it)`` for each
    count; the one-row count's own figure is 1.0 by definition.
    """
    ratios: dict[int, list[float]] = {}
    for round_ in rounds:
        for k, seconds, around in round_:
            ratios.setdefault(k, []).append(seconds / around)
    return {k: 1.0 if k == 1 else statistics.median(v) for k, v in sorted(ratios.items())}


def measure_row_costs(model: NativeModel, params: ContextParams, rows: int, *, rounds: int = PROBE_ROUNDS) -> list[tuple[int, float]]:
    """Seconds of a decode step of each probed count up to ``rows``: :func:`paired_ratios` times the one-row median.

    One warm-up round first; every step of ``k`` rows sits between two one-row steps at the same
    positions, which its ratio is taken over.
    """
    counts = _counts(rows)
    n_ctx = -(-(PROBE_PREFIX + rows) // 256) * 256
    probe = replace(params, n_ctx=n_ctx, n_seq_max=1, n_batch=max(params.n_batch, rows, PROBE_PREFIX),
                    prefix_reuse=None, embeddings=False)
    ctx = NativeContext(model, probe)
    batch = Batch(max(rows, PROBE_PREFIX))
    try:
        tokens = [(i * 7919 + 13) % model.n_vocab for i in range(PROBE_PREFIX + rows)]
        batch.clear()
        for pos in range(PROBE_PREFIX):
            batch.add(tokens[pos], pos, 0, logits=pos == PROBE_PREFIX - 1)
        _decode(ctx, batch)

        def step(k: int) -> float:
            batch.clear()
            for i in range(k):
                batch.add(tokens[PROBE_PREFIX + i], PROBE_PREFIX + i, 0, logits=True)
            t0 = time.perf_counter()
            _decode(ctx, batch)
            elapsed = time.perf_counter() - t0
            if not ctx.seq_rm(0, PROBE_PREFIX, -1):
                raise RuntimeError("the row-cost probe could not remove its rows")
            return elapsed

        measured: list[list[tuple[int, float, float]]] = []
        for round_ in range(rounds + 1):
            samples = []
            for k in counts if round_ % 2 else reversed(counts):  # alternate the order, so drift hits all alike
                before = step(1)
                seconds = step(k)
                samples.append((k, seconds, (before + step(1)) / 2))
            if round_:
                measured.append(samples)
        one_row = statistics.median(around for samples in measured for _, _, around in samples)
        return [(k, ratio * one_row) for k, ratio in paired_ratios(measured).items()]
    finally:
        batch.free()
        ctx.free()


def _decode(ctx: NativeContext, batch: Batch) -> None:
    rc = ctx.decode(batch)
    if rc != 0:
        raise RuntimeError(f"the row-cost probe's decode failed (llama_decode returned {rc})")


def _read(path: Path, key: dict[str, Any], rows: int) -> list[tuple[int, float]] | None:
    """The cached points when the file is this key's and plausible, else None (then it is measured again)."""
    try:
        if path.stat().st_size > 64 * 1024:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested past the parser, under the size cap
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    points = data.get("points")
    if not isinstance(points, list) or not 1 <= len(points) <= len(PROBE_ROWS) + 1:
        return None
    out: list[tuple[int, float]] = []
    for item in points:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and isinstance(item[1], float)):
            return None
        k, s = item
        if not (1 <= k <= MAX_SPECULATIVE_TOKENS + 1 and math.isfinite(s) and 0 < s < _MAX_SECONDS):
            return None
        if out and k <= out[-1][0]:
            return None
        out.append((k, s))
    if out[0][0] != 1 or out[-1][0] < rows:
        return None
    return out


def _write(path: Path, key: dict[str, Any], points: list[tuple[int, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "points": [list(p) for p in points]}, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def row_costs(model: NativeModel, fingerprint: str, params: ContextParams, rows: int) -> RowCosts:
    """The measured costs of 1..``rows`` rows for contexts made with ``params`` (cached on disk)."""
    if not 1 <= rows <= MAX_SPECULATIVE_TOKENS + 1:
        raise ValueError(f"rows must be in 1..{MAX_SPECULATIVE_TOKENS + 1}, got {rows}")
    key = cost_key(fingerprint, params)
    path = cost_path(key)
    points = _read(path, key, rows)
    if points is None:
        t0 = time.perf_counter()
        points = measure_row_costs(model, params, rows)
        log.info("measured decode row costs up to %d rows in %.2f s: %s", rows, time.perf_counter() - t0,
                 ", ".join(f"{k}:{s * 1e3:.2f}ms" for k, s in points))
        try:
            _write(path, key, points)
        except OSError as exc:  # a read-only cache directory costs a measurement per lease, nothing more
            log.warning("could not cache row costs at %s: %s", path, exc)
    return RowCosts.from_points(points)
