"""Reasoning models: the text between thinking markers (``<think>``...``</think>``) kept apart from the answer.

A template or vocabulary that knows ``<think>`` marks a reasoning model
(Qwen3, DeepSeek-R1 distills). Its answer may open with the markers, or
start inside them when the template's generation prompt already wrote the
opening marker. :func:`split_reasoning` splits a whole answer;
:class:`ReasoningSplitter` does the same piece by piece for streams, so the
streamed reasoning and content join to exactly what the whole answer splits
into. No markers in the answer: no reasoning (``None``), content unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["ThinkingMarkers", "THINK", "thinking_markers", "starts_inside", "split_reasoning", "ReasoningSplitter"]


@dataclass(frozen=True)
class ThinkingMarkers:
    """The opening and closing text of a reasoning span."""

    open: str = "<think>"
    close: str = "</think>"


THINK = ThinkingMarkers()


def thinking_markers(
    template_source: str, vocabulary_has: Optional[Callable[[str], bool]] = None
) -> ThinkingMarkers | None:
    """The markers a model uses: ``<think>`` when its template mentions it or its vocabulary has the token."""
    if THINK.open in template_source and THINK.close in template_source:
        return THINK
    if vocabulary_has is not None and vocabulary_has(THINK.open) and vocabulary_has(THINK.close):
        return THINK
    return None


def starts_inside(prompt_text: str, markers: ThinkingMarkers) -> bool:
    """Whether the generation prompt itself opened a reasoning span (the answer starts inside it)."""
    tail = prompt_text.rstrip()
    return tail.endswith(markers.open)


def split_reasoning(text: str, markers: ThinkingMarkers, inside: bool = False) -> tuple[str, str | None]:
    """``(content, reasoning)`` of a whole answer; reasoning is None when the answer has no reasoning span."""
    splitter = ReasoningSplitter(markers, inside)
    reasoning, content = [], []
    for channel, piece in [*splitter.feed(text), *splitter.finish()]:
        (reasoning if channel == "reasoning" else content).append(piece)
    return "".join(content), ("".join(reasoning) if splitter.saw_reasoning else None)


class ReasoningSplitter:
    """Split streamed text into ``("reasoning", text)`` and ``("content", text)`` pieces.

    Whitespace right after the opening marker, before the closing one and
    right after it is dropped; text that may be the start of a marker is held
    back until the next piece decides it.
    """

    def __init__(self, markers: ThinkingMarkers, inside: bool = False) -> None:
        self.markers = markers
        self.state = "reasoning" if inside else "start"
        self.saw_reasoning = inside
        self._held = ""
        self._lead = True  # dropping leading whitespace of the current channel

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self._held += piece
        out: list[tuple[str, str]] = []
        while True:
            before = (self.state, self._held)
            out += self._step()
            if (self.state, self._held) == before:
                return [(c, t) for c, t in out if t]

    def _step(self) -> list[tuple[str, str]]:
        m, held = self.markers, self._held
        if self.state == "start":
            stripped = held.lstrip()
            if stripped.startswith(m.open):
                self.state, self.saw_reasoning, self._lead = "reasoning", True, True
                self._held = stripped[len(m.open):]
                return []
            if m.open.startswith(stripped):
                return []  # only whitespace or a part of the opening marker so far
            self.state, self._held = "content", ""
            return [("content", held)]
        if self.state == "reasoning":
            if self._lead:
                held = held.lstrip()
                self._held = held
                if not held:
                    return []
                self._lead = False
            at = held.find(m.close)
            if at >= 0:
                self.state, self._lead = "after", True
                self._held = held[at + len(m.close):]
                return [("reasoning", held[:at].rstrip())]
            keep = _partial_suffix(held, m.close)
            body = held[:len(held) - keep]
            text = body.rstrip()  # trailing whitespace waits: it is dropped if the closing marker follows
            self._held = held[len(text):]
            return [("reasoning", text)]
        if self.state == "after":
            held = held.lstrip()
            self._held = held
            if not held:
                return []
            self.state = "content"
        out, self._held = self._held, ""
        return [("content", out)]

    def finish(self) -> list[tuple[str, str]]:
        """What is still held, at the end of the answer."""
        held, self._held = self._held, ""
        if self.state == "start":
            return [("content", held)] if held else []
        if self.state == "reasoning":
            text = held.strip() if self._lead else held.rstrip()
            return [("reasoning", text)] if text else []
        if self.state == "after":
            return []
        return [("content", held)] if held else []


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
