"""Shared helpers for the static fallbacks: number formatting, HTML tables, PNG rendering.

Every view in this package can render itself without a live kernel (HTML,
DataFrame, PNG), so saved notebooks, GitHub and nbval show real output. The
``-1`` of :class:`~aner_nb.llm.Timings` ("not measured") is shown as a dash,
never as ``0``.
"""

from __future__ import annotations

import base64
import html
import io
import struct
from typing import Any, Iterable, Sequence

__all__ = [
    "MISSING",
    "measured",
    "fmt_ms",
    "fmt_count",
    "fmt_float",
    "fmt_bytes",
    "html_table",
    "frame_html",
    "axis_bytes",
    "new_figure",
    "figure_png",
    "png_size",
    "png_img_tag",
    "StaticView",
]

MISSING = "–"


def measured(value: Any) -> bool:
    """True for a real number; False for ``-1`` (not measured), ``None`` and NA/NaN."""
    if value is None or isinstance(value, bool):
        return False
    try:
        v = float(value)
    except (TypeError, ValueError):
        return False
    return v == v and v >= 0  # NaN != NaN


def fmt_ms(ns: Any, digits: int = 2) -> str:
    """Nanoseconds as milliseconds, or a dash when not measured."""
    return f"{float(ns) / 1e6:.{digits}f} ms" if measured(ns) else MISSING


def fmt_count(value: Any) -> str:
    return f"{int(value):,}" if measured(value) else MISSING


def fmt_float(value: Any, digits: int = 2) -> str:
    return f"{float(value):,.{digits}f}" if measured(value) else MISSING


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: Any) -> str:
    """Bytes in binary units (KiB = 1024 B), or a dash when unknown."""
    if not measured(n):
        return MISSING
    value, unit = float(n), _UNITS[0]
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:,.2f} {unit}"


def html_table(rows: Iterable[Sequence[Any]], header: Sequence[str] | None = None, *, escape: bool = True) -> str:
    """A small HTML table; the first cell of each row is a header cell."""
    esc = html.escape if escape else str
    head = ""
    if header:
        head = "<tr>" + "".join(f"<th>{esc(str(h))}</th>" for h in header) + "</tr>"
    body = []
    for row in rows:
        first, *rest = row
        cells = "".join(f"<td style='text-align:right'>{esc(str(c))}</td>" for c in rest)
        body.append(f"<tr><th style='text-align:left'>{esc(str(first))}</th>{cells}</tr>")
    return f"<table class='aner-table'>{head}{''.join(body)}</table>"


def _cell(value: Any) -> str:
    import pandas as pd

    if value is None or (not isinstance(value, (str, bytes)) and pd.isna(value)):
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def frame_html(frame: Any) -> str:
    """A DataFrame as HTML: missing values (NA, -1 masked) as a dash, floats with 2 decimals."""
    cells = frame.astype(object).map(_cell)
    return cells.to_html(border=0, escape=True)


def axis_bytes(value: float, _pos: Any = None) -> str:
    """Compact byte label for chart axes (3 significant digits, binary units)."""
    value, unit = float(value), _UNITS[0]
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    return f"{value:.3g} {unit}"


def new_figure(figsize: tuple[float, float], dpi: int) -> Any:
    """A matplotlib Figure on the Agg canvas, outside pyplot: no global state, headless safe."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def figure_png(fig: Any, dpi: int | None = None) -> bytes:
    """PNG bytes of ``fig`` at exactly ``figsize x dpi`` pixels (no tight bounding box)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi or fig.dpi)
    return buf.getvalue()


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels read from a PNG header."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG image")
    return struct.unpack(">II", data[16:24])


def png_img_tag(data: bytes, alt: str) -> str:
    uri = base64.b64encode(data).decode("ascii")
    return f"<img alt='{html.escape(alt, quote=True)}' src='data:image/png;base64,{uri}'/>"


class StaticView:
    """Display protocol shared by the views: a live widget plus static HTML (and PNG).

    In Jupyter the widget view is rendered; frontends without widget state
    (nbconvert, GitHub, nbval, a saved notebook) fall back to ``text/html``.
    Subclasses provide ``_build_widget()`` and ``_repr_html_()``.
    """

    _widget: Any = None

    @property
    def widget(self) -> Any:
        """The ipywidgets view (built on first use)."""
        if self._widget is None:
            self._widget = self._build_widget()
        return self._widget

    def _build_widget(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _repr_html_(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kwargs: Any) -> dict[str, Any]:
        data = dict(self.widget._repr_mimebundle_() or {})
        data["text/html"] = self._repr_html_()
        data["text/plain"] = repr(self)
        png = getattr(self, "_repr_png_", None)
        if png is not None:
            data["image/png"] = base64.b64encode(png()).decode("ascii")
        return data
