"""Showing a streamed answer: ONE display, updated in place, throttled.

A notebook gets a single output created with ``display(..., display_id=True)``
and updated with ``.update`` at most every ``interval`` seconds while pieces
arrive, then replaced by the answer with its timings dashboard below it
(:func:`aner_nb.widgets.response_panel`: a widget with a static HTML fallback
for saved notebooks). The text is shown in the cell's ``format`` (Markdown,
text, code or JSON) the same way while it streams and when it is done
(:func:`aner_nb.widgets.answer_html`; JSON shows as text until it is complete),
and ``text/plain`` always carries the whole text. ``source`` names the handle
that answers. ``timings`` (``LLMMagics.timings``) says what follows the
answer: ``full`` the timings dashboard, ``compact`` one line
(:func:`compact_line`: first token, tok/s, tokens, cached input tokens),
``off`` nothing. A terminal IPython cannot update an output in place, so it gets
the pieces printed as they come, then :func:`timings_line` (or the compact
line, or nothing).
"""

from __future__ import annotations

import html
import sys
import time
from typing import Any, Callable

from ..llm.output import OutputSplitter
from ..widgets.answer import answer_html, reasoning_html, response_html
from ..widgets.timings import response_panel, timings_line

__all__ = ["make_view", "UpdatingView", "PrintView", "FinalView", "NullView", "TIMINGS", "compact_line", "answer"]

TIMINGS = ("full", "compact", "off")  # what follows an answer: the dashboard, one line, nothing


def _bundle(text: str, status: str, format: str = "text", source: str | None = None,
            reasoning: str | None = None) -> dict[str, str]:
    """The in-progress (or failed) view: the text so far (a reasoning model's thinking so far collapsed
    above it) and a status line naming the handle."""
    status = f"{source}: {status}" if source is not None else status
    shown = reasoning_html(reasoning) + answer_html(text, "text" if format == "json" else format)  # partial JSON never parses
    return {
        "text/plain": f"{text}\n[{status}]",
        "text/html": f"<div class='aner-stream'>{shown}<small>{html.escape(status)}</small></div>",
    }


def compact_line(response: Any) -> str:
    """One line of timings: first token ms, decode tok/s, completion tokens, cached input tokens."""
    first = response.timings.first_token_duration
    tps = response.tokens_per_second()
    parts = [
        f"first token {first / 1e6:.1f} ms" if first >= 0 else "first token –",
        f"{tps:.1f} tok/s" if tps >= 0 else "– tok/s",
        f"{response.usage.completion_tokens} tokens",
        f"{response.usage.cached_input_tokens} cached input tokens",
    ]
    return " · ".join(parts)


def answer(response: Any, *, format: str = "text", source: str | None = None, timings: str = "full") -> Any:
    """What a finished answer shows: the response panel (``full``), or the text with a compact line
    of timings (``compact``) or with none (``off``) as a static bundle; ``source`` is named either way."""
    if timings == "full":
        return response_panel(response, format=format, source=source)
    notes = ([f"answered by {source}"] if source is not None else []) + (
        [compact_line(response)] if timings == "compact" else [])
    note = " · ".join(notes)
    small = f"<small class='aner-timings-line'>{html.escape(note)}</small>" if note else ""
    return _Bundle({
        "text/plain": f"{response.text}\n[{note}]" if note else response.text,
        "text/html": f"<div class='aner-response'>{response_html(response, format)}{small}</div>",
    })


class _Bundle:
    """A ready mime bundle that ``display`` and ``DisplayHandle.update`` show as it is."""

    def __init__(self, data: dict[str, str]) -> None:
        self.data = data

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return self.data

    def __repr__(self) -> str:
        return self.data["text/plain"]


class UpdatingView:
    """One display per request, updated in place at most every ``interval`` seconds."""

    def __init__(
        self, interval: float, *, format: str = "text", source: str | None = None,
        clock: Callable[[], float] = time.monotonic, timings: str = "full",
    ) -> None:
        self.interval = max(float(interval), 0.0)
        self.format = format
        self.source = source
        self.timings = timings
        self.clock = clock
        self.pieces: list[str] = []
        self.thought: list[str] | None = None  # a reasoning model's thinking so far (with a splitter)
        self.splitter: OutputSplitter | None = None  # set by the caller when the answer holds reasoning
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
        if self.splitter is None:
            self.pieces.append(piece)
        else:
            for channel, text in self.splitter.feed(piece):
                if channel == "reasoning":
                    self.thought = [*(self.thought or []), text]
                else:
                    self.pieces.append(text)
        now = self.clock()
        if now - self._last >= self.interval:
            self._last = now
            self.updates += 1
            self._handle.update(self._bundle("generating..."), raw=True)

    def _bundle(self, status: str) -> dict[str, str]:
        thought = None if self.thought is None else "".join(self.thought)
        return _bundle(self.text, status, self.format, self.source, thought)

    def finish(self, response: Any, *, cancelled: bool = False) -> None:
        if self._handle is None:
            return
        if response is not None:
            self._handle.update(answer(response, format=self.format, source=self.source, timings=self.timings))
        else:
            self._handle.update(self._bundle("cancelled" if cancelled else "failed"), raw=True)

    def fail(self, error: BaseException) -> None:
        if self._handle is not None:
            self._handle.update(self._bundle(f"failed: {type(error).__name__}"), raw=True)


class PrintView:
    """Terminal IPython: print pieces as they arrive (or all at the end), then a timings line."""

    def __init__(self, *, stream: bool = True, out: Any = None, source: str | None = None,
                 timings: str = "full") -> None:
        self.stream = stream
        self.out = out
        self.source = source
        self.timings = timings
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
        if response is None:
            summary = "[cancelled]" if cancelled else "[failed]"
        elif self.timings == "full":
            summary = timings_line(response)
        elif self.timings == "compact":
            summary = compact_line(response)
        else:
            summary = ""
        by = f"answered by {self.source}" if self.source is not None else ""
        self._write("\n" + "; ".join(part for part in (summary, by) if part) + "\n")

    def fail(self, error: BaseException) -> None:
        self._write(f"\n[failed: {type(error).__name__}]\n")


class FinalView:
    """``--no-stream`` in a notebook: nothing while generating, then the answer and its timings panel."""

    def __init__(self, *, format: str = "text", source: str | None = None, timings: str = "full") -> None:
        self.format = format
        self.source = source
        self.timings = timings

    def start(self) -> None:
        pass

    def add(self, piece: str) -> None:
        pass

    def finish(self, response: Any, *, cancelled: bool = False) -> None:
        from IPython.display import display

        if response is not None:
            display(answer(response, format=self.format, source=self.source, timings=self.timings))
        else:
            display(_bundle("", "cancelled" if cancelled else "failed", source=self.source), raw=True)

    def fail(self, error: BaseException) -> None:
        pass


class NullView(FinalView):
    """``--quiet``: show nothing."""

    def finish(self, response: Any, *, cancelled: bool = False) -> None:
        pass


def make_view(
    mode: str, *, interval: float, terminal: bool, format: str = "text", source: str | None = None,
    timings: str = "full",
) -> Any:
    """The view for display mode ``stream``, ``final`` or ``none``; ``format`` is how a notebook shows
    the text (a terminal prints it as it is), ``source`` the handle that answers, ``timings`` what
    follows the answer (:data:`TIMINGS`)."""
    if mode == "none":
        return NullView()
    if terminal:
        return PrintView(stream=mode == "stream", source=source, timings=timings)
    if mode == "final":
        return FinalView(format=format, source=source, timings=timings)
    return UpdatingView(interval, format=format, source=source, timings=timings)
