"""Pure functions behind ``%llm list``, ``%llm info``, ``%llm kv`` and ``%llm bench``.

They take handles (or a namespace) and return pandas DataFrames; no IPython
here, so the same tables are one call away from plain Python.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping

from .. import llm
from ..llm import Lease
from ..llm.errors import ConfigurationError
from ..widgets.kv_budget import kv_budget

__all__ = [
    "is_handle",
    "is_output_cache_name",
    "handle_kind",
    "handle_table",
    "handle_info",
    "kv_table",
    "BENCH_METRICS",
    "bench_table",
    "bench_outputs",
]

_OUTPUT_CACHE = re.compile(r"^(_{1,3}|_\d+)$")
LIST_COLUMNS = ("name", "kind", "architecture", "profile", "device", "context", "fingerprint", "state")


def is_output_cache_name(name: str) -> bool:
    """``_``, ``__``, ``___`` and ``_N``: IPython's output cache, not user variables."""
    return bool(_OUTPUT_CACHE.match(name))


def is_handle(obj: Any) -> bool:
    """Whether ``obj`` holds native memory: any lease of :mod:`aner_nb.llm` (a model lease, a
    batching lease, a session), i.e. an instance of the :class:`~aner_nb.llm.Lease` protocol."""
    return isinstance(obj, Lease)


# The ``kind`` column of ``%llm list`` / ``%llm info``, from the lease's ``kind``: ordinary, latency and
# adapter leases are all a ``lease`` there (the ``profile`` column tells their profiles apart).
_HANDLE_KINDS = {"session": "session", "throughput": "batching"}


def handle_kind(obj: Lease) -> str:
    """``lease``, ``batching`` (a throughput lease) or ``session``."""
    return _HANDLE_KINDS.get(obj.kind, "lease")


def _get(obj: Any, attr: str, default: Any = None) -> Any:
    try:
        return getattr(obj, attr)
    except Exception:  # a metadata property must never break a listing
        return default


def _profile_kind(obj: Any) -> Any:
    """``ordinary``, ``latency`` or ``throughput``, from the lease's profile."""
    profile = _get(obj, "profile")
    return _get(profile, "kind") if profile is not None else None


def _row(name: str, obj: Any, model: Any) -> dict[str, Any]:
    src = model if model is not None else obj
    fingerprint = _get(src, "fingerprint")
    return {
        "name": name,
        "kind": handle_kind(obj),
        "architecture": _get(src, "architecture"),
        "profile": _profile_kind(src),
        "device": _get(src, "device"),
        "context": _get(src, "context"),
        "fingerprint": fingerprint[:12] if isinstance(fingerprint, str) else None,
        "state": "closed" if _get(obj, "closed", False) else "open",
    }


def handle_table(namespace: Mapping[str, Any], *, parents: Mapping[int, Any] | None = None) -> Any:
    """A DataFrame with one row per handle bound in ``namespace`` (e.g. ``globals()``).

    ``parents`` maps ``id(session)`` to the lease it was opened on, so session
    rows can show that lease's metadata (sessions keep none of their own).
    """
    import pandas as pd

    rows = []
    for name, obj in list(namespace.items()):
        if is_output_cache_name(name) or not is_handle(obj):
            continue
        rows.append(_row(name, obj, (parents or {}).get(id(obj))))
    return pd.DataFrame(rows, columns=list(LIST_COLUMNS))


def handle_info(handle: Any, *, model: Any = None) -> Any:
    """One handle's metadata, load summary, memory summary and KV estimate as a field/value DataFrame.

    ``model`` is the lease a session was opened on: sessions keep no
    metadata of their own, so the lease's is shown for them.
    """
    import pandas as pd

    if not is_handle(handle):
        raise ConfigurationError(f"handle_info() needs a lease or session, got {type(handle).__name__}")
    info: dict[str, Any] = {"kind": handle_kind(handle), "state": "closed" if handle.closed else "open"}
    for attr in ("name", "architecture", "device", "context", "fingerprint", "path", "chat_template"):
        value = _get(handle, attr)
        if value is None and model is not None:
            value = _get(model, attr)
        if value is not None:
            info[attr] = value
    profile = _get(handle, "profile")
    if profile is not None:
        if profile.batching is not None:
            info["max_sequences"] = profile.batching.max_sequences
        info["profile"] = _profile_kind(handle)
        info.update(_fields("optimizer", profile.optimizer))
        info["max_idle_contexts"] = profile.max_idle_contexts
    if handle.kind == "session":
        info["turns"] = sum(1 for m in handle.messages if m["role"] == "user")
        info["cached_tokens"] = handle.cached_tokens
    info["supports"] = ", ".join(f for f in llm.FEATURES if handle.supports(f)) or "(closed)"
    info.update(_fields("load", handle.load_summary()))
    if not handle.closed:
        info.update(_fields("memory", handle.memory_summary()))
    return pd.DataFrame({"value": pd.Series(info, dtype=object)})


def _holdings_line(holdings: Iterable[Any]) -> str:
    """Holdings (:class:`~aner_nb.llm.summary.Holding`): one readable line each, with its scope."""
    return "; ".join(f"{h.what}: {h.count}, {h.bytes:,} B ({h.scope})" for h in holdings)


def _fields(prefix: str, value: Any) -> dict[str, Any]:
    """``prefix.field`` rows of a frozen dataclass's fields, read as attributes (holdings as one line)."""
    rows: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        rows[f"{prefix}.{f.name}"] = _holdings_line(item) if f.name in ("resident", "bounds") else item
    return rows


def kv_table(
    handle: Any, *, context: int | None = None, kv_cache_type: str | None = None, slots: int = 1
) -> Any:
    """KV bytes of ``slots`` resident contexts of ``context`` cells for this handle's model.

    With ``kv_cache_type=None`` every KV type is listed (a type the model's
    head size cannot use is shown as missing with the reason). The model's
    shape comes from the lease's ``facts`` (its GGUF header); the numbers are
    those of the KV budget calculator (:func:`aner_nb.widgets.kv_budget`),
    which shows the same estimate interactively.
    """
    import pandas as pd

    facts = _get(handle, "facts") if is_handle(handle) and handle.kind != "session" else None
    if facts is None:
        raise ConfigurationError(f"kv_table() needs a lease with a model path, got {type(handle).__name__}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ConfigurationError(f"slots must be an integer >= 1, got {slots!r}")
    context = _get(handle, "context") if context is None else context
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ConfigurationError(f"context must be an integer >= 1, got {context!r}")
    if kv_cache_type is not None and kv_cache_type not in llm.KV_CACHE_TYPES:
        allowed = ", ".join(llm.KV_CACHE_TYPES)
        raise ConfigurationError(f"kv_cache_type must be one of {allowed}, got {kv_cache_type!r}")
    budget = kv_budget(facts, slots=slots)
    if kv_cache_type is not None and budget.unusable(kv_cache_type):
        raise ConfigurationError(budget.unusable(kv_cache_type))
    current = None if handle.closed else handle.memory_summary().kv_cache_type
    f = budget.facts
    rows = []
    for kv_type in (kv_cache_type,) if kv_cache_type is not None else llm.KV_CACHE_TYPES:
        total = budget.total_kv_bytes(kv_type, context)
        note = budget.unusable(kv_type) or (
            f"upper bound: sliding-window layers keep about {f.sliding_window} cells" if f.sliding_window else "")
        rows.append({
            "kv_cache_type": kv_type, "context": context, "slots": slots,
            "layers": f.layers, "kv_heads": f.kv_heads, "head_dim_k": f.head_dim_k, "head_dim_v": f.head_dim_v,
            "bytes_per_slot": budget.kv_bytes(kv_type, context), "total_bytes": total,
            "total_mib": None if total is None else round(total / 2**20, 3),
            "current": kv_type == current, "note": note,
        })
    frame = pd.DataFrame(rows)
    for col in ("bytes_per_slot", "total_bytes"):
        frame[col] = frame[col].astype("Int64")
    frame["total_mib"] = frame["total_mib"].astype("Float64")
    return frame


BENCH_METRICS = ("first_token_ms", "decode_tokens_per_s", "total_ms")


def bench_table(result: Any, metrics: Iterable[str] = BENCH_METRICS) -> Any:
    """The summary of a :class:`aner_nb.bench.BenchResult`: one row per (side, metric).

    Median, min, max, number of measured requests and the ratio of medians to
    the baseline side (``result.summary()``), baseline rows first.
    """
    table = result.summary(tuple(metrics))
    if table.empty:
        return table
    rank = {side: i for i, side in enumerate(_bench_sides(result))}
    return table.sort_values("side", key=lambda c: c.map(rank), kind="stable").reset_index(drop=True)


def _bench_sides(result: Any) -> list[str]:
    """The sides of a BenchResult, baseline first, then in the order they first ran."""
    sides = list(result.frame["side"].drop_duplicates()) if not result.frame.empty else []
    return sorted(sides, key=lambda side: side != result.baseline)


def bench_outputs(result: Any) -> Any:
    """Per case and side of a BenchResult: median completion and cached input tokens, and
    whether the side's output is identical to the baseline's (by output hash)."""
    import pandas as pd

    frame = result.frame
    columns = ["case", "side", "completion_tokens", "cached_input_tokens", "same_output_as_baseline"]
    if frame.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for side in _bench_sides(result):
        same = result.same_outputs(side)
        for case, group in frame[frame.side == side].groupby("case", sort=False):
            rows.append({
                "case": case,
                "side": side,
                "completion_tokens": group["completion_tokens"].median(),
                "cached_input_tokens": group["cached_input_tokens"].median(),
                "same_output_as_baseline": bool(same.get(case, False)),
            })
    table = pd.DataFrame(rows, columns=columns)
    order = {case: i for i, case in enumerate(frame["case"].drop_duplicates())}
    return table.sort_values("case", key=lambda c: c.map(order), kind="stable").reset_index(drop=True)
