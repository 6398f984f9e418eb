"""KV budget calculator: KV-cache bytes by formula, next to the weights, against a memory budget.

The numbers are :func:`aner_nb.llm.kv_estimate` (cells x layers x kv_heads
x (K row + V row), the context padded to 256 cells as llama.cpp does; f16 row = head_dim x 2 bytes, q8_0 = 34 bytes per 32
elements, q4_0 = 18 bytes per 32) times ``slots``, the number of contexts
alive at once (active requests, idle pooled contexts, prefix-cache entries).
It is an estimate of the KV tensors only; what it leaves out is written under
the chart.
"""

from __future__ import annotations

import html
import textwrap
from dataclasses import dataclass
from typing import Any, Mapping

from ..llm.artifact import ModelFacts
from ..llm.errors import ConfigurationError
from ..llm.memory import KV_CACHE_TYPES, KV_CELL_PADDING, kv_cells, kv_estimate, kv_row_bytes
from ..llm.protocol import Lease
from ..llm.summary import KV_EXCLUDES
from ._static import StaticView, axis_bytes, figure_png, fmt_bytes, fmt_count, frame_html, html_table, new_figure, png_img_tag

__all__ = ["KVFacts", "kv_facts", "KVBudget", "kv_budget", "DEFAULT_BUDGET_BYTES", "MAX_CONTEXT", "KV_COLOURS"]

DEFAULT_BUDGET_BYTES = 8 * 2**30  # 8 GiB
MAX_CONTEXT = 65536  # the largest context a lease accepts
KV_COLOURS = {"f16": "#1f77b4", "q8_0": "#ff7f0e", "q4_0": "#2ca02c"}


@dataclass(frozen=True)
class KVFacts:
    """The model numbers the KV formula needs, plus the weights size (-1 when unknown)."""

    name: str
    layers: int
    kv_heads: int
    head_dim_k: int
    head_dim_v: int
    weights_bytes: int = -1
    context_length: int = 0  # declared training context; 0 when unknown
    sliding_window: int = 0
    context: int = 4096  # the calculator's starting context
    kv_cache_type: str = "f16"


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


def _from_model_facts(f: ModelFacts, **extra: Any) -> KVFacts:
    context = min(f.context_length or 4096, 4096)
    values = dict(
        name=f.name, layers=f.layers, kv_heads=f.kv_heads, head_dim_k=f.head_dim_k, head_dim_v=f.head_dim_v,
        weights_bytes=f.tensor_bytes, context_length=f.context_length, sliding_window=f.sliding_window,
        context=context,
    )
    values.update(extra)
    return KVFacts(**values)


def kv_facts(source: Any) -> KVFacts:
    """Normalize a lease (``LLMModel``), a :class:`ModelFacts`, a mapping or a :class:`KVFacts`.

    A mapping needs ``layers``, ``kv_heads`` and ``head_dim_k``/``head_dim_v``
    (or one ``head_dim`` for both); optional: ``name``, ``weights_bytes``
    (or ``tensor_bytes``), ``context_length``, ``sliding_window``, ``context``,
    ``kv_cache_type``.
    """
    if isinstance(source, KVFacts):
        return source
    if isinstance(source, ModelFacts):
        return _from_model_facts(source)
    if isinstance(source, Mapping):
        m = dict(source)
        missing = [k for k in ("layers", "kv_heads") if k not in m]
        if "head_dim" in m:
            m.setdefault("head_dim_k", m["head_dim"])
            m.setdefault("head_dim_v", m["head_dim"])
        missing += [k for k in ("head_dim_k", "head_dim_v") if k not in m]
        if missing:
            raise ValueError(f"KV facts mapping lacks {', '.join(missing)}; it needs layers, kv_heads, head_dim_k, head_dim_v")
        context_length = _int("context_length", m.get("context_length", 0))
        return KVFacts(
            name=str(m.get("name", "model")),
            layers=_int("layers", m["layers"]),
            kv_heads=_int("kv_heads", m["kv_heads"]),
            head_dim_k=_int("head_dim_k", m["head_dim_k"]),
            head_dim_v=_int("head_dim_v", m["head_dim_v"]),
            weights_bytes=_int("weights_bytes", m.get("weights_bytes", m.get("tensor_bytes", -1))),
            context_length=context_length,
            sliding_window=_int("sliding_window", m.get("sliding_window", 0)),
            context=_int("context", m.get("context", min(context_length or 4096, 4096))),
            kv_cache_type=str(m.get("kv_cache_type", "f16")),
        )
    if isinstance(source, Lease):
        facts = source.facts
        summary = source.memory_summary()
        weights = summary.weights_bytes if summary.weights_bytes >= 0 else facts.tensor_bytes
        return _from_model_facts(facts, weights_bytes=weights, context=summary.context, kv_cache_type=summary.kv_cache_type)
    raise TypeError(
        f"kv_budget needs a model lease, ModelFacts, KVFacts or a mapping of facts, got {type(source).__name__}"
    )


def _row(head_dim: int, kv_type: str) -> int | None:
    try:
        return kv_row_bytes(head_dim, kv_type)
    except ConfigurationError:
        return None  # head_dim is not a whole number of blocks of this type


class KVBudget(StaticView):
    """The calculator's state (context, KV type, slots, budget) and its views. See :func:`kv_budget`."""

    _syncing = False
    _png: "tuple[tuple, bytes] | None" = None

    def __init__(
        self,
        facts: KVFacts,
        *,
        context: int | None = None,
        kv_cache_type: str | None = None,
        slots: int = 1,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        self.facts = facts
        self.context = facts.context
        self.kv_cache_type = facts.kv_cache_type
        self.slots = 1
        self.budget_bytes = DEFAULT_BUDGET_BYTES
        self.update(
            context=facts.context if context is None else context,
            kv_cache_type=kv_cache_type or facts.kv_cache_type,
            slots=slots,
            budget_bytes=budget_bytes,
        )

    # -- arithmetic ----------------------------------------------------------------
    @property
    def context_limit(self) -> int:
        """The largest context the calculator offers: the model's declared context, at most 65536."""
        return min(self.facts.context_length or MAX_CONTEXT, MAX_CONTEXT)

    def update(self, **changes: Any) -> "KVBudget":
        """Change ``context``, ``kv_cache_type``, ``slots`` and/or ``budget_bytes`` (validated)."""
        unknown = set(changes) - {"context", "kv_cache_type", "slots", "budget_bytes"}
        if unknown:
            raise TypeError(f"unknown settings {sorted(unknown)}; use context, kv_cache_type, slots, budget_bytes")
        context = _int("context", changes.get("context", self.context))
        slots = _int("slots", changes.get("slots", self.slots))
        budget = changes.get("budget_bytes", self.budget_bytes)
        kv_type = changes.get("kv_cache_type", self.kv_cache_type)
        if not 1 <= context <= MAX_CONTEXT:
            raise ValueError(f"context must be 1..{MAX_CONTEXT}, got {context}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not budget > 0:
            raise ValueError(f"budget_bytes must be a positive number, got {budget!r}")
        if kv_type not in KV_CACHE_TYPES:
            raise ValueError(f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_type!r}")
        reason = self.unusable(kv_type)
        if reason:
            raise ValueError(reason)
        self.context, self.slots, self.budget_bytes, self.kv_cache_type = context, slots, int(budget), kv_type
        if self._widget is not None:
            self._refresh_widget()
        return self

    def row_bytes(self, kv_cache_type: str | None = None) -> tuple[int | None, int | None]:
        """Bytes of one K row and one V row (one layer, one KV head, one cell)."""
        t = kv_cache_type or self.kv_cache_type
        return _row(self.facts.head_dim_k, t), _row(self.facts.head_dim_v, t)

    def unusable(self, kv_cache_type: str) -> str | None:
        """Why ``kv_cache_type`` cannot store this model's head dims; None when it can."""
        if None not in self.row_bytes(kv_cache_type):
            return None
        return (
            f"{kv_cache_type} needs head dims that are multiples of 32; this model has K {self.facts.head_dim_k}, "
            f"V {self.facts.head_dim_v}"
        )

    def kv_bytes(self, kv_cache_type: str | None = None, context: int | None = None) -> int | None:
        """``llm.kv_estimate`` for one context; None when the type cannot store these head dims."""
        f, t = self.facts, kv_cache_type or self.kv_cache_type
        if None in self.row_bytes(t):
            return None
        return kv_estimate(context or self.context, f.layers, f.kv_heads, f.head_dim_k, f.head_dim_v, t)

    def total_kv_bytes(self, kv_cache_type: str | None = None, context: int | None = None) -> int | None:
        """KV bytes of all ``slots`` contexts."""
        one = self.kv_bytes(kv_cache_type, context)
        return None if one is None else one * self.slots

    def max_context(self, kv_cache_type: str | None = None) -> int | None:
        """The largest context whose weights + KV (all slots) fit the budget, capped at ``context_limit``."""
        block = self.kv_bytes(kv_cache_type, KV_CELL_PADDING)  # llama.cpp allocates cells in blocks of 256
        if block is None:
            return None
        free = self.budget_bytes - max(self.facts.weights_bytes, 0)
        return max(0, min(free // (block * self.slots) * KV_CELL_PADDING, self.context_limit))

    def to_frame(self) -> Any:
        """One row per KV type: row bytes, KV bytes, weights + KV, fit and the largest fitting context."""
        import pandas as pd

        f = self.facts
        rows = []
        for t in KV_CACHE_TYPES:
            k, v = self.row_bytes(t)
            one, total = self.kv_bytes(t), self.total_kv_bytes(t)
            weights = f.weights_bytes if f.weights_bytes >= 0 else None
            both = None if total is None or weights is None else total + weights
            rows.append(
                {
                    "K row bytes": k,
                    "V row bytes": v,
                    "bytes per token": None if one is None else one // self.context,
                    "context": self.context,
                    "slots": self.slots,
                    "KV bytes per context": one,
                    "KV bytes": total,
                    "weights bytes": weights,
                    "weights + KV bytes": both,
                    "budget bytes": self.budget_bytes,
                    "fits budget": None if total is None else (both if both is not None else total) <= self.budget_bytes,
                    "max context in budget": self.max_context(t),
                }
            )
        frame = pd.DataFrame(rows, index=pd.Index(list(KV_CACHE_TYPES), name="kv_cache_type"))
        for c in frame.columns:
            frame[c] = frame[c].astype("boolean" if c == "fits budget" else "Int64")
        return frame

    def formula_text(self) -> str:
        """The formula with this model's numbers, and what the estimate excludes."""
        f, t = self.facts, self.kv_cache_type
        k, v = self.row_bytes(t)
        total = self.total_kv_bytes()
        cells = kv_cells(self.context)[0]
        lines = [
            "KV bytes = slots x cells x layers x kv_heads x (K row + V row)",
            f"  = {self.slots} x {cells} x {f.layers} x {f.kv_heads} x ({k} + {v}) = {total:,} bytes ({t})",
            "Row bytes: f16 = head_dim x 2; q8_0 = head_dim / 32 x 34; q4_0 = head_dim / 32 x 18 "
            f"(head dims: K {f.head_dim_k}, V {f.head_dim_v}).",
        ]
        if cells != self.context:
            lines.append(f"llama.cpp pads the context to a multiple of {KV_CELL_PADDING} cells: {self.context} -> {cells}.")
        if f.sliding_window:
            lines.append(
                f"Sliding-window layers keep about {f.sliding_window} cells, so this is an upper bound for this model."
            )
        lines.append(f"Excludes the weights (shown separately), {KV_EXCLUDES}.")
        return "\n".join(lines)

    # -- chart ---------------------------------------------------------------------------
    def figure(self, *, figsize: tuple[float, float] = (8.0, 5.5), dpi: int = 100) -> Any:
        """KV bytes (all slots) vs context for f16/q8_0/q4_0, the budget line and the formula under it."""
        import numpy as np
        from matplotlib.ticker import FuncFormatter, LogLocator

        fig = new_figure(figsize, dpi)
        ax = fig.add_axes((0.11, 0.36, 0.86, 0.56))
        hi = max(self.context_limit, self.context)
        lo = min(256, self.context)
        xs = np.unique(np.concatenate([np.geomspace(lo, hi, 48).round().astype(int), [self.context]]))
        for t in KV_CACHE_TYPES:
            per = self.total_kv_bytes(t, 1)
            if per is None:
                continue
            ax.plot(xs, xs * per, color=KV_COLOURS[t], label=t, linewidth=2 if t == self.kv_cache_type else 1.2)
        current = self.total_kv_bytes()
        ax.plot([self.context], [current], "o", color=KV_COLOURS[self.kv_cache_type], markersize=8,
                label=f"{self.kv_cache_type} at {self.context}: {fmt_bytes(current)}")
        budget = self.budget_bytes
        ax.axhline(budget, color="#b71c1c", linestyle="-", linewidth=1.5, label=f"memory budget {fmt_bytes(budget)}")
        ax.plot([xs[-1]], [budget], marker="v", color="#b71c1c", markersize=9)
        w = self.facts.weights_bytes
        if 0 < w < budget:
            ax.axhline(budget - w, color="#b71c1c", linestyle="--", linewidth=1,
                       label=f"budget minus weights ({fmt_bytes(w)})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_locator(LogLocator(base=2, numticks=10))
        ax.yaxis.set_major_formatter(FuncFormatter(axis_bytes))
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"KV bytes ({self.slots} slot{'s' if self.slots != 1 else ''})")
        ax.set_title(f"KV cache of {self.facts.name}")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
        text = "\n".join(textwrap.fill(line, 120) for line in self.formula_text().splitlines())
        fig.text(0.02, 0.02, text, fontsize=7.5, family="monospace", va="bottom", ha="left")
        return fig

    def to_png(self, path: Any = None, *, figsize: tuple[float, float] = (8.0, 5.5), dpi: int = 100) -> bytes:
        """The chart as PNG bytes of ``figsize x dpi`` pixels (also written to ``path`` when given)."""
        key = (self.context, self.kv_cache_type, self.slots, self.budget_bytes, tuple(figsize), dpi)
        cached = self._png
        if cached is not None and cached[0] == key:
            data = cached[1]  # displaying HTML and PNG of one state renders once
        else:
            data = figure_png(self.figure(figsize=figsize, dpi=dpi), dpi)
            self._png = (key, data)
        if path is not None:
            with open(path, "wb") as fh:
                fh.write(data)
        return data

    def _repr_png_(self) -> bytes:
        return self.to_png()

    # -- views ---------------------------------------------------------------------------
    def _readout_html(self) -> str:
        f = self.facts
        total = self.total_kv_bytes()
        weights = f.weights_bytes if f.weights_bytes >= 0 else None
        both = None if weights is None else total + weights
        fits = (both if both is not None else total) <= self.budget_bytes
        rows = [
            ("model", f.name),
            ("KV cache type / context / slots", f"{self.kv_cache_type} / {self.context:,} / {self.slots}"),
            ("KV bytes (formula)", f"{fmt_count(total)} B = {fmt_bytes(total)}"),
            ("weights", fmt_bytes(weights)),
            ("weights + KV", fmt_bytes(both)),
            ("memory budget", fmt_bytes(self.budget_bytes)),
            ("fits", "yes" if fits else "NO"),
            ("largest context in budget", fmt_count(self.max_context())),
        ]
        return html_table(rows)

    def _formula_html(self) -> str:
        return f"<pre style='font-size:smaller;white-space:pre-wrap'>{html.escape(self.formula_text())}</pre>"

    def _repr_html_(self) -> str:
        return (
            f"<div class='aner-kv'>{self._readout_html()}{png_img_tag(self.to_png(), 'KV bytes vs context')}"
            f"{self._formula_html()}{frame_html(self.to_frame())}</div>"
        )

    def _build_widget(self) -> Any:
        import ipywidgets as w

        self._controls = {
            "context": w.IntSlider(value=self.context, min=1, max=max(self.context_limit, self.context),
                                   description="context", continuous_update=False),
            "kv_cache_type": w.Dropdown(options=[t for t in KV_CACHE_TYPES if self.kv_bytes(t) is not None],
                                        value=self.kv_cache_type, description="KV type"),
            "slots": w.IntSlider(value=self.slots, min=1, max=max(64, self.slots), description="slots",
                                 continuous_update=False,
                                 tooltip="contexts alive at once: active requests, pooled contexts, prefix entries"),
            "budget_gib": w.BoundedFloatText(value=self.budget_bytes / 2**30, min=0.001, max=1e6, step=1,
                                             description="budget GiB"),
        }
        self._readout = w.HTML()
        self._chart = w.Image(format="png")
        self._formula = w.HTML()
        for name, control in self._controls.items():
            control.observe(self._on_control, names="value")
        box = w.VBox([w.HBox(list(self._controls.values())[:2]), w.HBox(list(self._controls.values())[2:]),
                      self._readout, self._chart, self._formula])
        self._widget = box
        self._refresh_widget()
        return box

    def _on_control(self, change: Mapping[str, Any]) -> None:
        if self._syncing:
            return  # our own refresh setting the controls, not the user
        c = self._controls
        try:
            self.update(context=c["context"].value, kv_cache_type=c["kv_cache_type"].value, slots=c["slots"].value,
                        budget_bytes=int(c["budget_gib"].value * 2**30))
        except ValueError as exc:
            self._readout.value = f"<p style='color:#b71c1c'>{html.escape(str(exc))}</p>"

    def _refresh_widget(self) -> None:
        c = self._controls
        self._syncing = True
        try:
            c["context"].value, c["kv_cache_type"].value, c["slots"].value = self.context, self.kv_cache_type, self.slots
            c["budget_gib"].value = self.budget_bytes / 2**30
        finally:
            self._syncing = False
        self._readout.value = self._readout_html()
        self._chart.value = self.to_png()
        self._formula.value = self._formula_html()

    def __repr__(self) -> str:
        return (
            f"<KVBudget {self.facts.name!r} {self.kv_cache_type} ctx={self.context} slots={self.slots} "
            f"kv={fmt_bytes(self.total_kv_bytes())}>"
        )


def kv_budget(
    model_or_facts: Any,
    *,
    context: int | None = None,
    kv_cache_type: str | None = None,
    slots: int = 1,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> KVBudget:
    """An interactive KV calculator for a lease, a ModelFacts or a mapping of facts.

    Defaults come from the lease (its context and KV type) or the facts.
    Displays as sliders/dropdowns with a readout and the chart; the static
    fallback is HTML with the PNG chart; ``to_frame()`` has every KV type.
    """
    return KVBudget(kv_facts(model_or_facts), context=context, kv_cache_type=kv_cache_type, slots=slots,
                    budget_bytes=budget_bytes)

