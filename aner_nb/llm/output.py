"""What a chat answer's text holds besides the content: reasoning and tool calls, split whole or streamed.

A request's :class:`OutputFormat` is decided when it is prepared (the
template's thinking markers, whether its prompt opened a reasoning span, the
tools and their call format when calls are to be read). The final
:class:`~aner_nb.llm.Response` gets its ``text`` (the content alone),
``reasoning`` and ``tool_calls`` from :meth:`OutputFormat.split`; a stream's
consumer (the HTTP service's SSE, the magics) uses :class:`OutputSplitter`
to send reasoning and content as they come and to hold back text that may
be a tool call, whose calls it then takes from the final Response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .reasoning import ReasoningSplitter, ThinkingMarkers, split_reasoning
from .tool_parsers import openers, parse_tool_calls
from .tools import Tool, ToolCall

__all__ = ["OutputFormat", "SplitOutput", "OutputSplitter"]


@dataclass(frozen=True)
class SplitOutput:
    content: str
    reasoning: Optional[str]
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class OutputFormat:
    """How to read one request's answer: thinking markers (``inside``: the prompt opened a span), and the
    tools whose calls are parsed (empty: none are) in ``call_format``."""

    markers: Optional[ThinkingMarkers] = None
    inside: bool = False
    tools: tuple[Tool, ...] = ()
    call_format: str = "hermes"

    @property
    def plain(self) -> bool:
        return self.markers is None and not self.tools

    def split(self, text: str) -> SplitOutput:
        reasoning = None
        if self.markers is not None:
            text, reasoning = split_reasoning(text, self.markers, self.inside)
        calls: tuple[ToolCall, ...] = ()
        if self.tools:
            text, calls = parse_tool_calls(text, self.tools, self.call_format)
        return SplitOutput(text, reasoning, calls)


class OutputSplitter:
    """Streamed text as ``("reasoning" | "content", text)`` pieces; possible tool-call text is held back.

    :meth:`finish` (given the final content) releases the content not sent yet, so the streamed content
    joins to the final one whenever the answer was not a call.
    """

    def __init__(self, fmt: OutputFormat) -> None:
        self.fmt = fmt
        self._reasoning = ReasoningSplitter(fmt.markers, fmt.inside) if fmt.markers is not None else None
        self._openers = openers(fmt.call_format) if fmt.tools else ()
        self._state = "start" if fmt.tools else "content"
        self._held = ""
        self.sent = ""  # content sent so far

    def feed(self, piece: str) -> list[tuple[str, str]]:
        parts = self._reasoning.feed(piece) if self._reasoning is not None else [("content", piece)]
        return self._route(parts)

    def finish(self, final_content: str) -> list[tuple[str, str]]:
        out = self._route(self._reasoning.finish()) if self._reasoning is not None else []
        out = [(c, t) for c, t in out if c == "reasoning"]  # content comes from the final answer
        if final_content.startswith(self.sent) and len(final_content) > len(self.sent):
            rest = final_content[len(self.sent):]
            self.sent += rest
            out.append(("content", rest))
        return out

    def _route(self, parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
        out = []
        for channel, text in parts:
            if channel == "reasoning":
                out.append((channel, text))
                continue
            sent = self._content(text)
            if sent:
                self.sent += sent
                out.append(("content", sent))
        return out

    def _content(self, text: str) -> str:
        if not self.fmt.tools:
            return text
        self._held += text
        if self._state == "held":
            return ""
        if self._state == "start":
            lead = self._held.lstrip()
            if not lead or any(o.startswith(lead) for o in (*self._openers, "```")):
                return ""
            if lead.startswith(("{", "[", "```", *self._openers)):
                self._state = "held"
                return ""
            self._state = "content"
        at = min((i for i in (self._held.find(o) for o in self._openers) if i >= 0), default=-1)
        if at >= 0:
            out, self._held, self._state = self._held[:at].rstrip(), self._held[at:], "held"
            return out
        keep = max((n for o in self._openers for n in range(1, len(o)) if self._held.endswith(o[:n])), default=0)
        body = self._held[:len(self._held) - keep]
        out = body.rstrip()
        self._held = self._held[len(out):]
        return out
