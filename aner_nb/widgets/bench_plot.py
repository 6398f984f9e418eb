"""Benchmark plots: medians with min/max whiskers for paired A/B results.

Input is the long frame of :func:`bench_frame` (one row per benchmark side),
built from :func:`aner_nb.bench.paired.compare` result dicts, or any frame
with the columns ``title``, ``name``, ``median``, ``min``, ``max`` (``unit``,
``n``, ``ratio`` and ``higher_is_better`` are shown when present). Each
benchmark title gets its own axes, since units differ.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ._static import figure_png, frame_html, new_figure, png_img_tag

__all__ = ["BENCH_COLUMNS", "bench_frame", "BenchPlot", "bench_plot"]

BENCH_COLUMNS = ("title", "name", "median", "min", "max")
_SIDE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def bench_frame(results: "Mapping[str, Any] | Iterable[Mapping[str, Any]]") -> Any:
    """``compare()`` result dicts (one or a list) as a long frame: one row per (title, side)."""
    import pandas as pd

    if isinstance(results, Mapping):
        results = [results]
    rows = []
    for res in results:
        for side in ("a", "b"):
            s = res[side]
            rows.append(
                {
                    "title": res["title"],
                    "unit": res.get("unit", ""),
                    "higher_is_better": res.get("higher_is_better"),
                    "side": side,
                    "name": s["name"],
                    "median": float(s["median"]),
                    "min": float(s["min"]),
                    "max": float(s["max"]),
                    "n": s.get("n"),
                    "ratio": res.get("ratio"),
                }
            )
    if not rows:
        raise ValueError("no benchmark results given")
    return pd.DataFrame(rows)


def _as_frame(data: Any) -> Any:
    import pandas as pd

    if isinstance(data, pd.DataFrame):
        frame = data.copy()
        if "name" not in frame.columns and "side" in frame.columns:
            frame["name"] = frame["side"]
    else:
        frame = bench_frame(data)
    missing = [c for c in BENCH_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(
            f"benchmark frame lacks {', '.join(missing)}; it needs {', '.join(BENCH_COLUMNS)} "
            "(bench_frame(compare_results) builds one)"
        )
    if frame.empty:
        raise ValueError("benchmark frame is empty")
    bad = frame[(frame["min"] > frame["median"]) | (frame["median"] > frame["max"])]
    if not bad.empty:
        raise ValueError(f"min <= median <= max does not hold for rows {list(bad.index)}")
    return frame.reset_index(drop=True)


class BenchPlot:
    """A benchmark figure and its data. See :func:`bench_plot`."""

    def __init__(self, data: Any, *, figsize: tuple[float, float] | None = None, dpi: int = 100) -> None:
        self.frame = _as_frame(data)
        self.titles = list(dict.fromkeys(self.frame["title"]))
        self.figsize = figsize or (max(4.5, 3.8 * len(self.titles)), 4.0)
        self.dpi = dpi
        self._figure: Any = None

    @property
    def size_px(self) -> tuple[int, int]:
        """(width, height) of the PNG in pixels."""
        return round(self.figsize[0] * self.dpi), round(self.figsize[1] * self.dpi)

    @property
    def figure(self) -> Any:
        """The matplotlib Figure (Agg canvas, not pyplot)."""
        if self._figure is None:
            self._figure = self._draw()
        return self._figure

    def _draw(self) -> Any:
        fig = new_figure(self.figsize, self.dpi)
        axes = fig.subplots(1, len(self.titles), squeeze=False)[0]
        for ax, title in zip(axes, self.titles):
            rows = self.frame[self.frame["title"] == title]
            xs = range(len(rows))
            med, lo, hi = rows["median"].to_numpy(float), rows["min"].to_numpy(float), rows["max"].to_numpy(float)
            colours = [_SIDE_COLOURS[i % len(_SIDE_COLOURS)] for i in xs]
            ax.bar(xs, med, color=colours, alpha=0.75, width=0.6)
            ax.errorbar(xs, med, yerr=[med - lo, hi - med], fmt="none", ecolor="black", capsize=8, linewidth=1.2)
            for x, m in zip(xs, med):
                ax.annotate(f"{m:.3g}", (x, m), textcoords="offset points", xytext=(8, 2), fontsize=8)
            ax.set_xticks(list(xs), [str(n) for n in rows["name"]], fontsize=8)
            unit = rows["unit"].iloc[0] if "unit" in rows.columns else ""
            ax.set_ylabel(f"median ({unit}), whiskers min..max" if unit else "median, whiskers min..max", fontsize=8)
            ax.set_ylim(bottom=0)
            heading = str(title)
            if "ratio" in rows.columns and rows["ratio"].notna().any():
                heading += f"\nratio {float(rows['ratio'].iloc[0]):.3f}"
                if "higher_is_better" in rows.columns and rows["higher_is_better"].notna().any():
                    heading += " (higher is better)" if bool(rows["higher_is_better"].iloc[0]) else " (lower is better)"
            ax.set_title(heading, fontsize=9)
        fig.tight_layout()
        return fig

    def to_png(self, path: Any = None) -> bytes:
        """PNG bytes of ``size_px`` (also written to ``path`` when given)."""
        data = figure_png(self.figure, self.dpi)
        if path is not None:
            with open(path, "wb") as fh:
                fh.write(data)
        return data

    def to_frame(self) -> Any:
        return self.frame.copy()

    def _repr_png_(self) -> bytes:
        return self.to_png()

    def _repr_html_(self) -> str:
        alt = "benchmark medians with min/max whiskers: " + ", ".join(map(str, self.titles))
        return f"<div class='aner-bench'>{png_img_tag(self.to_png(), alt)}{frame_html(self.frame)}</div>"

    @property
    def widget(self) -> Any:
        """The chart as an ipywidgets Image, for embedding in dashboards."""
        import ipywidgets as w

        return w.Image(value=self.to_png(), format="png")

    def __repr__(self) -> str:
        return f"<BenchPlot {len(self.titles)} benchmark(s): {', '.join(map(str, self.titles))}>"


def bench_plot(data: Any, *, figsize: tuple[float, float] | None = None, dpi: int = 100) -> BenchPlot:
    """Plot paired benchmark results: a bar at each side's median, whiskers from min to max.

    ``data``: a frame (see :func:`bench_frame`) or ``compare()`` result dicts.
    Displays as PNG/HTML; ``to_png(path)`` writes the image.
    """
    return BenchPlot(data, figsize=figsize, dpi=dpi)
