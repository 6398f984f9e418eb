"""Timings panel: where the time of one or many requests went, as a stacked bar and a table.

The phases are disjoint slices of ``total_duration`` so they can be stacked:
queue, context clear, prefill (``prompt_eval_duration``), first token (the
part of ``first_token_duration`` after prefill: sampling the first token),
decode, and "other" (what ``total_duration`` leaves: template rendering,
tokenization, bookkeeping). A phase that was not measured (``-1``) is shown
as missing, never as 0.
"""

from __future__ import annotations

import html
from typing import Any, Mapping, Sequence

from ..llm.response import Response
from ._static import StaticView, figure_png, fmt_ms, frame_html, measured, new_figure

__all__ = ["SEGMENTS", "TimingsPanel", "timings_panel", "timings_frame", "segments_ns", "as_responses"]

# (label, colour) of the stacked phases, in time order.
SEGMENTS: tuple[tuple[str, str], ...] = (
    ("queue", "#9e9e9e"),
    ("context clear", "#8d6e63"),
    ("prefill", "#1f77b4"),
    ("first token", "#ff7f0e"),
    ("decode", "#2ca02c"),
    ("other", "#d0d0d0"),
)


def as_responses(items: Any, labels: Sequence[str] | None = None) -> list[tuple[str, Response]]:
    """Normalize a Response, a finished Stream, a list of them or a ``{label: response}`` mapping."""
    if isinstance(items, Mapping):
        pairs = [(str(k), v) for k, v in items.items()]
    else:
        seq = [items] if isinstance(items, Response) or hasattr(items, "response") else list(items)
        pairs = [(f"#{i}", r) for i, r in enumerate(seq)]
    if labels is not None:
        labels = [str(x) for x in labels]
        if len(labels) != len(pairs):
            raise ValueError(f"got {len(labels)} labels for {len(pairs)} responses")
        pairs = [(lab, r) for lab, (_, r) in zip(labels, pairs)]
    out = []
    for label, r in pairs:
        if not isinstance(r, Response):
            final = getattr(r, "response", None)  # a Stream exposes its final Response
            if not isinstance(final, Response):
                raise TypeError(f"expected a Response (or a finished Stream), got {type(r).__name__}")
            r = final
        out.append((label, r))
    if not out:
        raise ValueError("no responses given")
    if len({lab for lab, _ in out}) != len(out):
        raise ValueError(f"labels must be unique, got {[lab for lab, _ in out]}")
    return out


def segments_ns(response: Response) -> dict[str, int | None]:
    """The stacked phases of one response in nanoseconds; ``None`` where not measured."""
    t = response.timings

    def get(v: int) -> int | None:
        return v if measured(v) else None

    prefill = get(t.prompt_eval_duration)
    first = get(t.first_token_duration)
    if first is not None and prefill is not None:
        # first_token_duration runs from the start of work and includes prefill.
        first = first - prefill if first >= prefill else None
    seg: dict[str, int | None] = {
        "queue": get(t.queue_duration),
        "context clear": get(t.context_clear_duration),
        "prefill": prefill,
        "first token": first,
        "decode": get(t.decode_duration),
    }
    total = get(t.total_duration)
    other = None
    if total is not None:
        rest = total - sum(v for v in seg.values() if v is not None)
        other = rest if rest >= 0 else None
    seg["other"] = other
    return seg


def timings_frame(responses: Any, labels: Sequence[str] | None = None) -> Any:
    """All usage and timings fields, one row per response (``Response.to_frame``); -1 is NA."""
    import pandas as pd

    pairs = as_responses(responses, labels)
    frame = pd.concat([r.to_frame() for _, r in pairs], ignore_index=True)
    frame.index = pd.Index([lab for lab, _ in pairs], name="response")
    return frame


class TimingsPanel(StaticView):
    """Stacked time bars and token counts for one or many responses. See :func:`timings_panel`."""

    def __init__(self, responses: Any, labels: Sequence[str] | None = None) -> None:
        self._pairs = as_responses(responses, labels)

    @property
    def responses(self) -> list[Response]:
        return [r for _, r in self._pairs]

    @property
    def labels(self) -> list[str]:
        return [lab for lab, _ in self._pairs]

    def to_frame(self) -> Any:
        """Every usage and timings field, one row per response, unmeasured as NA."""
        return timings_frame([r for _, r in self._pairs], self.labels)

    def segments_frame(self) -> Any:
        """The stacked phases in milliseconds (Float64, NA where not measured)."""
        import pandas as pd

        rows = [{k: (None if v is None else v / 1e6) for k, v in segments_ns(r).items()} for _, r in self._pairs]
        frame = pd.DataFrame(rows, index=pd.Index(self.labels, name="response"), dtype="Float64")
        return frame.add_suffix(" ms")

    def summary_frame(self) -> Any:
        """The numbers the panel shows: token counts, phase milliseconds, tokens per second."""
        import pandas as pd

        rows = []
        for _, r in self._pairs:
            t = r.timings
            tps = r.tokens_per_second()
            rows.append(
                {
                    "prompt tokens": t.prompt_tokens,
                    "cached input tokens": t.cached_input_tokens,
                    "evaluated prompt tokens": t.evaluated_prompt_tokens,
                    "generated tokens": t.generated_tokens,
                    "decode calls": t.decode_calls,
                    "queue ms": t.queue_duration,
                    "context clear ms": t.context_clear_duration,
                    "prefill ms": t.prompt_eval_duration,
                    "first token ms": t.first_token_duration,
                    "decode ms": t.decode_duration,
                    "total ms": t.total_duration,
                    "tokens/s": tps,
                }
            )
        frame = pd.DataFrame(rows, index=pd.Index(self.labels, name="response"))
        counts = [c for c in frame.columns if not c.endswith(" ms") and c != "tokens/s"]
        times = [c for c in frame.columns if c.endswith(" ms")]
        frame[counts] = frame[counts].astype("Int64").mask(frame[counts] < 0)
        frame[times] = (frame[times].astype("Float64") / 1e6).mask(frame[times] < 0)
        frame["tokens/s"] = frame["tokens/s"].astype("Float64").mask(frame["tokens/s"] < 0)
        frame.insert(0, "finish", [r.finish_reason for _, r in self._pairs])
        return frame

    # -- rendering ---------------------------------------------------------------
    def _bars_html(self) -> str:
        segs = [segments_ns(r) for _, r in self._pairs]
        scale = max((sum(v for v in s.values() if v is not None) for s in segs), default=0) or 1
        colours = dict(SEGMENTS)
        lines = []
        for (label, r), seg in zip(self._pairs, segs):
            parts = []
            for name, value in seg.items():
                if value is None or value <= 0:
                    continue
                width = 100.0 * value / scale
                tip = html.escape(f"{name}: {fmt_ms(value)}", quote=True)
                parts.append(
                    f"<div class='aner-seg' data-segment='{name}' title='{tip}' "
                    f"style='width:{width:.3f}%;background:{colours[name]};height:100%'></div>"
                )
            missing = [n for n, v in seg.items() if v is None]
            note = f" <small>not measured: {html.escape(', '.join(missing))}</small>" if missing else ""
            lines.append(
                f"<div style='margin:2px 0'><code>{html.escape(label)}</code> "
                f"{fmt_ms(r.timings.total_duration)} total{note}"
                f"<div style='display:flex;height:14px;width:100%;background:#f4f4f4'>{''.join(parts)}</div></div>"
            )
        legend = " ".join(
            f"<span style='display:inline-block;width:10px;height:10px;background:{c}'></span> {n}"
            for n, c in SEGMENTS
        )
        return f"<div class='aner-bars'>{''.join(lines)}<small>{legend}</small></div>"

    def _table_html(self) -> str:
        return frame_html(self.summary_frame())

    def _repr_html_(self) -> str:
        return f"<div class='aner-timings'>{self._bars_html()}{self._table_html()}</div>"

    def _build_widget(self) -> Any:
        import ipywidgets as w

        return w.VBox(
            [w.HTML(self._bars_html(), layout=w.Layout(width="100%")), w.HTML(self._table_html())],
            layout=w.Layout(width="100%"),
        )

    def figure(self, *, figsize: tuple[float, float] | None = None, dpi: int = 100) -> Any:
        """A matplotlib horizontal stacked bar chart of the phases (Agg, not pyplot)."""
        n = len(self._pairs)
        fig = new_figure(figsize or (8.0, 1.2 + 0.5 * n), dpi)
        ax = fig.add_subplot(1, 1, 1)
        colours = dict(SEGMENTS)
        for i, (_, r) in enumerate(self._pairs):
            left = 0.0
            for name, value in segments_ns(r).items():
                if value is None:
                    continue
                ax.barh(i, value / 1e6, left=left, color=colours[name], label=name if i == 0 else None)
                left += value / 1e6
        ax.set_yticks(range(n), self.labels)
        ax.invert_yaxis()
        ax.set_xlabel("milliseconds")
        handles, names = ax.get_legend_handles_labels()
        if handles:
            fig.legend(handles, names, loc="upper center", fontsize="small", ncols=len(handles), frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
        return fig

    def to_png(self, path: Any = None, *, dpi: int = 100) -> bytes:
        """The stacked bar chart as PNG bytes (also written to ``path`` when given)."""
        data = figure_png(self.figure(dpi=dpi), dpi)
        if path is not None:
            with open(path, "wb") as fh:
                fh.write(data)
        return data

    def __repr__(self) -> str:
        return f"<TimingsPanel {len(self._pairs)} response(s)>"


def timings_panel(responses: Any, *, labels: Sequence[str] | None = None) -> TimingsPanel:
    """Show where the time went for a Response (or a list / ``{label: response}`` of them).

    Returns a :class:`TimingsPanel`: displays as an ipywidgets panel with an
    HTML fallback; ``to_frame()`` gives every field, ``summary_frame()`` the
    numbers shown, ``to_png()`` a chart.
    """
    return TimingsPanel(responses, labels)

