"""Showing a streamed answer: ONE display, updated in place, throttled.

A notebook gets a single output created with ``display(..., display_id=True)``
and updated with ``.update`` at most every ``interval`` seconds while pieces
arrive, then replaced by the answer with its timings dashboard below it
(:func:`aner_nb.widgets.response_panel`: a widget with a static HTML fallback
for saved notebooks). The text is shown in the cell's ``format`` (Markdown,
text, code or JSON) the same way while it streams and when it is done
(:func:`aner_nb.widgets.answer_html`; JSON shows as text until it is complete),
and ``text/plain`` always carries the whole text. ``source`` names the handle
that answers. A terminal IPython cannot update an output in place, so it gets
the pieces printed as they come, then :func:`timings_line`.
"""

from __future__ import annotations

import html
import sys
import time
from typing import Any, Callable

from ..widgets.answer import answer_html
from ..widgets.timings import response_panel, timings_line

__all__ = ["make_view", "UpdatingView", "PrintView", "FinalView", "NullView"]


def _bundle(text: str, status: str, format: str = "text", source: str | None = None) -> dict[str, str]:
    """The in-progress (or failed) view: the text so far and a status line naming the handle."""
    status = f"{source}: {status}" if source is not None else status
    shown = answer_html(text, "text" if format == "json" else format)  # partial JSON never parses
    return {
        "text/plain": f"{text}\n[{status}]",
        "text/html": f"<div class='aner-stream'>{shown}<small>{html.escape(status)}</small></div>",
    }


def _by(source: str | None) -> str:
    return f"; answered by {source}" if source is not None else ""


class UpdatingView:
    """One display per request, updated in place at most every ``interval`` seconds."""

    def __init__(
        self, interval: float, *, format: str = "text", source: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = max(float(interval), 0.0)
        self.format = format
        self.source = source
        self.clock = clock
        self.pieces: list[str] = []
        self.updates = 0  # in-place updates sent while streaming (tests check the throttle)
        self._handle: Any = None
        self._last = 0.0

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def start(self) -> None:
        from IPython.display import display

        self._handle = display(self._bundle("generating..."), raw=True, display_id=True)
        self._last = self.clock()

    def add(self, piece: str) -> None:
        self.pieces.append(piece)
        now = self.clock()
        if now - self._last >= self.interval:
            self._last = now
            self.updates += 1
            self._handle.update(self._bundle("generating..."), raw=True)

    def _bundle(self, status: str) -> dict[str, str]:
        return _bundle(self.text, status, self.format, self.source)

    def finish(self, response: Any, *, cancelled: bool = False) -> None:
        if self._handle is None:
            return
        if response is not None:
            self._handle.update(response_panel(response, format=self.format, source=self.source))
        else:
            self._handle.update(self._bundle("cancelled" if cancelled else "failed"), raw=True)

    def fail(self, error: BaseException) -> None:
        if self._handle is not None:
            self._handle.update(self._bundle(f"failed: {type(error).__name__}"), raw=True)


class PrintView:
    """Terminal IPython: print pieces as they arrive (or all at the end), then a timings line."""

    def __init__(self, *, stream: bool = True, out: Any = None, source: str | None = None) -> None:
        self.stream = stream
        self.out = out
        self.source = source
        self.pieces: list[str] = []

    def _write(self, text: str) -> None:
        out = self.out or sys.stdout
        out.write(text)
        out.flush()

    def start(self) -> None:
        pass

    def add(self, piece: str) -> None:
        self.pieces.append(piece)
        if self.stream:
            self._write(piece)

    def finish(self, response: Any, *, cancelled: bool = False) -> None:
        if not self.stream:
            self._write(response.text if response is not None else "".join(self.pieces))
        summary = timings_line(response) if response is not None else ("[cancelled]" if cancelled else "[failed]")
        self._write(f"\n{summary}{_by(self.source)}\n")

    def fail(self, error: BaseException) -> None:
        self._write(f"\n[failed: {type(error).__name__}]\n")


class FinalView:
    """``--no-stream`` in a notebook: nothing while generating, then the answer and its timings panel."""

    def __init__(self, *, format: str = "text", source: str | None = None) -> None:
        self.format = format
        self.source = source

    def start(self) -> None:
        pass

    def add(self, piece: str) -> None:
        pass

    def finish(self, response: Any, *, cancelled: bool = False) -> None:
        from IPython.display import display

        if response is not None:
            display(response_panel(response, format=self.format, source=self.source))
        else:
            display(_bundle("", "cancelled" if cancelled else "failed", source=self.source), raw=True)

    def fail(self, error: BaseException) -> None:
        pass


class NullView(FinalView):
    """``--quiet``: show nothing."""

    def finish(self, response: Any, *, cancelled: bool = False) -> None:
        pass


def make_view(
    mode: str, *, interval: float, terminal: bool, format: str = "text", source: str | None = None
) -> Any:
    """The view for display mode ``stream``, ``final`` or ``none``; ``format`` is how a notebook shows
    the text (a terminal prints it as it is), ``source`` the handle that answers."""
    if mode == "none":
        return NullView()
    if terminal:
        return PrintView(stream=mode == "stream", source=source)
    if mode == "final":
        return FinalView(format=format, source=source)
    return UpdatingView(interval, format=format, source=source)
