"""Timings panel: where the time of one or many requests went, as a stacked bar and a table.

The phases are disjoint slices of ``total_duration`` so they can be stacked:
queue, context clear, prefill (``prompt_eval_duration``), first token (the
part of ``first_token_duration`` after prefill: sampling the first token),
decode, and "other" (what ``total_duration`` leaves: template rendering,
tokenization, bookkeeping). A phase that was not measured (``-1``) is shown
as missing, never as 0.

Labels and the table's columns come from the metadata of the
:class:`~aner_nb.llm.Timings` fields (``label``, ``unit``, ``part``), so a new
field shows up here without a hand-written column list.
"""

from __future__ import annotations

import html
from dataclasses import Field
from typing import Any, Mapping, Sequence

from ..llm.response import Response
from ..llm.stream import Stream
from ..llm.timings import timing_fields
from ._static import StaticView, figure_png, fmt_count, fmt_ms, frame_html, measured, new_figure
from .answer import check_format, response_html

__all__ = [
    "SEGMENTS",
    "SUMMARY_PARTS",
    "TimingsPanel",
    "ResponsePanel",
    "ResponsesView",
    "timings_panel",
    "response_panel",
    "timings_frame",
    "segments_ns",
    "summary_fields",
    "timings_line",
    "as_responses",
]

_LABELS = {f.name: f.metadata["label"] for f in timing_fields()}

# The disjoint phases of total_duration in time order (field, colour); "other" is what the total leaves.
# first_token_duration runs from the start of work, so its phase is the part after prefill.
_PHASES: tuple[tuple[str, str], ...] = (
    ("queue_duration", "#9e9e9e"),
    ("context_clear_duration", "#8d6e63"),
    ("prompt_eval_duration", "#1f77b4"),
    ("first_token_duration", "#ff7f0e"),
    ("decode_duration", "#2ca02c"),
)
# (label, colour) of the stacked phases, in time order.
SEGMENTS: tuple[tuple[str, str], ...] = (*((_LABELS[n], c) for n, c in _PHASES), ("other", "#d0d0d0"))

# The parts of Timings that say where the time went (the summary table and the terminal line):
# waiting for a sequence, getting a context, and the run itself. Flags and settings are in to_frame().
SUMMARY_PARTS = ("queue", "pool", "run")


def summary_fields() -> tuple[list[Field], list[Field]]:
    """The Timings fields the summary shows, chosen by their metadata: ``(token counts, durations)``,
    each in field order."""
    fields = [f for f in timing_fields() if f.metadata["part"] in SUMMARY_PARTS]
    counts = [f for f in fields if f.metadata["unit"] in ("tokens", "count")]
    return counts, [f for f in fields if f.metadata["unit"] == "ns"]


def as_responses(items: Any, labels: Sequence[str] | None = None) -> list[tuple[str, Response]]:
    """Normalize a Response, a finished Stream, a list of them or a ``{label: response}`` mapping."""
    if isinstance(items, Mapping):
        pairs = [(str(k), v) for k, v in items.items()]
    else:
        seq = [items] if isinstance(items, (Response, Stream)) else list(items)
        pairs = [(f"#{i}", r) for i, r in enumerate(seq)]
    if labels is not None:
        labels = [str(x) for x in labels]
        if len(labels) != len(pairs):
            raise ValueError(f"got {len(labels)} labels for {len(pairs)} responses")
        pairs = [(lab, r) for lab, (_, r) in zip(labels, pairs)]
    out = []
    for label, r in pairs:
        if not isinstance(r, Response):
            final = r.response if isinstance(r, Stream) else None  # a finished Stream's final Response
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

    values = {name: get(getattr(t, name)) for name, _ in _PHASES}
    prefill, first = values["prompt_eval_duration"], values["first_token_duration"]
    if first is not None and prefill is not None:
        # first_token_duration runs from the call: the queue wait and the context clear happened
        # inside it, before the prefill, so the first-token segment is what is left of it.
        before = (values["queue_duration"] or 0) + (values["context_clear_duration"] or 0)
        rest = first - prefill - before
        values["first_token_duration"] = rest if rest >= 0 else None
    seg: dict[str, int | None] = {_LABELS[name]: value for name, value in values.items()}
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


class ResponsesView(StaticView):
    """A view of labelled responses: ``_pairs`` holds ``(label, Response)`` (see :func:`as_responses`)."""

    _pairs: list[tuple[str, Response]]

    @property
    def responses(self) -> list[Response]:
        return [r for _, r in self._pairs]

    @property
    def labels(self) -> list[str]:
        return [lab for lab, _ in self._pairs]


class TimingsPanel(ResponsesView):
    """Stacked time bars and token counts for one or many responses. See :func:`timings_panel`."""

    def __init__(self, responses: Any, labels: Sequence[str] | None = None) -> None:
        self._pairs = as_responses(responses, labels)

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

        count_fields, time_fields = summary_fields()
        columns = {f.name: f.metadata["label"] for f in count_fields}
        columns.update({f.name: f"{f.metadata['label']} ms" for f in time_fields})
        rows = [
            {**{label: getattr(r.timings, name) for name, label in columns.items()}, "tokens/s": r.tokens_per_second()}
            for _, r in self._pairs
        ]
        frame = pd.DataFrame(rows, index=pd.Index(self.labels, name="response"))
        counts = [columns[f.name] for f in count_fields]
        times = [columns[f.name] for f in time_fields]
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


def timings_line(response: Response) -> str:
    """One plain-text line for terminals: finish reason, completion tokens, then the summary's
    measured counts and durations (the fields :meth:`TimingsPanel.summary_frame` shows) and tokens/s."""
    t = response.timings

    def shown(fields: list[Field], fmt: Any) -> str:
        values = [(f.metadata["label"], getattr(t, f.name)) for f in fields]
        return ", ".join(f"{label} {fmt(value)}" for label, value in values if measured(value))

    count_fields, time_fields = summary_fields()
    parts = [shown(count_fields, fmt_count), shown(time_fields, lambda ns: fmt_ms(ns, 1))]
    tps = response.tokens_per_second()
    if tps >= 0:
        parts.append(f"{tps:.1f} tok/s")
    parts.append(tier_note(t))
    return f"[{response.finish_reason}] {response.usage.completion_tokens} tokens; " + "; ".join(p for p in parts if p)


_TIER_NAMES = {2: "host RAM", 3: "disk"}


def tier_note(t: Any) -> str:
    """Which prefix tier served the prompt's prefix (``prefix_cache_tier``), when a RAM or disk tier did."""
    name = _TIER_NAMES.get(t.prefix_cache_tier)
    if name is None:
        return ""
    restore = f", restore {fmt_ms(t.prefix_restore_duration, 1)}" if measured(t.prefix_restore_duration) else ""
    return f"prefix from {name} ({fmt_count(t.prefix_restored_tokens)} tokens{restore})"


class ResponsePanel(StaticView):
    """A response's text with its timings panel below it: how ``%%generate`` and ``%%chat`` end.

    Displays as an ipywidgets box (the text, then :class:`TimingsPanel`'s widget);
    the static fallback is the same as HTML, and ``text/plain`` is the whole text
    (never shortened) with :func:`timings_line`. ``format`` is how the text is
    shown (:data:`~aner_nb.widgets.answer.FORMATS`; the magics default to
    Markdown); ``source`` names the handle that answered, shown above the text
    so a cell that relied on a default handle says which one it was.
    """

    def __init__(self, response: Any, *, format: str = "text", source: str | None = None) -> None:
        ((_, self.response),) = as_responses([response])
        self.format = check_format(format)
        self.source = source
        self.timings = TimingsPanel(self.response)

    def to_frame(self) -> Any:
        """Every usage and timings field of the response (``TimingsPanel.to_frame``)."""
        return self.timings.to_frame()

    def _source_html(self) -> str:
        if self.source is None:
            return ""
        return f"<div class='aner-source'><small>answered by <code>{html.escape(self.source)}</code></small></div>"

    def _text_html(self) -> str:
        return response_html(self.response, self.format)

    def _repr_html_(self) -> str:
        return f"<div class='aner-response'>{self._source_html()}{self._text_html()}{self.timings._repr_html_()}</div>"

    def _build_widget(self) -> Any:
        import ipywidgets as w

        source = [w.HTML(self._source_html())] if self.source is not None else []
        return w.VBox([*source, w.HTML(self._text_html()), self.timings.widget], layout=w.Layout(width="100%"))

    def __repr__(self) -> str:
        by = f"; answered by {self.source}" if self.source is not None else ""
        return f"{self.response.text}\n{timings_line(self.response)}{by}"


def response_panel(response: Any, *, format: str = "text", source: str | None = None) -> ResponsePanel:
    """A Response (or a finished Stream) as its text followed by its timings panel.

    ``display(response_panel(r))`` shows what a ``%%generate`` cell ends with;
    ``format`` is ``markdown``, ``text`` (default here), ``code`` or ``json``, and
    ``source`` the name of the handle that answered.
    """
    return ResponsePanel(response, format=format, source=source)
