"""Reading tool calls out of a model's text, per family format; plain content when the model did not call.

Formats (:data:`~aner_nb.llm.tools.CALL_FORMATS`): ``hermes`` (Hermes, Qwen
2.5/3 and the generic block: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``),
``llama3`` (Llama 3.x: the whole answer is ``{"name": ..., "parameters": ...}``,
optionally after ``<|python_tag|>``, several separated by ``;``) and
``mistral`` (``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]``). Every
format also falls back to a bare call object as the whole answer. A call
counts only when its name is one of the request's tools and its arguments
are a JSON object; otherwise the text is returned unchanged as content. An
answer cut inside its last ``<tool_call>`` (``max_tokens``) keeps the
complete calls before it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Sequence

from .tools import CALL_FORMATS, Tool, ToolCall, new_call_id

__all__ = ["call_format", "parse_tool_calls", "openers", "ParsedCalls"]

ParsedCalls = tuple[str, tuple[ToolCall, ...]]  # (content without the call markup, calls)

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.S)
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def call_format(template_source: str) -> str:
    """The call format a template's family uses (``hermes`` also for templates that know no tools)."""
    if _MISTRAL in template_source:
        return "mistral"
    if "<tool_call>" in template_source:
        return "hermes"
    if _PYTHON_TAG in template_source or ("<|start_header_id|>" in template_source and "tools" in template_source):
        return "llama3"
    return "hermes"


def openers(fmt: str) -> tuple[str, ...]:
    """Text that starts a call in ``fmt`` anywhere in an answer (a stream holds text back from there)."""
    return {"hermes": ("<tool_call>",), "mistral": (_MISTRAL,), "llama3": (_PYTHON_TAG,)}[fmt]


def _call(obj: Any, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def _objects(text: str, separators: str) -> list[Any] | None:
    """The JSON values ``text`` consists of (separated by whitespace or ``separators``), or None."""
    out, at = [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return out
        try:
            value, at = _DECODER.raw_decode(text, at)
        except ValueError:
            return None
        out.append(value)


def _all_calls(values: Sequence[Any] | None, names: frozenset[str]) -> tuple[ToolCall, ...]:
    if not values:
        return ()
    flat: list[Any] = []
    for v in values:
        flat += v if isinstance(v, list) else [v]
    calls = [_call(v, names) for v in flat]
    return tuple(calls) if calls and all(c is not None for c in calls) else ()  # type: ignore[arg-type]


def _hermes(text: str, names: frozenset[str]) -> ParsedCalls | None:
    blocks = list(_HERMES.finditer(text))
    if not blocks:
        return None
    values: list[Any] = []
    for block in blocks:
        objects = _objects(block.group(1), "")
        if objects is None:
            if block is blocks[-1] and not block.group(2) and values:
                break  # the answer was cut inside its last call (max_tokens): the complete calls count
            return None
        values += objects
    calls = _all_calls(values, names)
    if not calls:
        return None
    content = _HERMES.sub("", text).strip()
    return content, calls


def _llama3(text: str, names: frozenset[str]) -> ParsedCalls | None:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):]
    calls = _all_calls(_objects(body, ";"), names)
    return ("", calls) if calls else None


def _mistral(text: str, names: frozenset[str]) -> ParsedCalls | None:
    at = text.find(_MISTRAL)
    if at < 0:
        return None
    calls = _all_calls(_objects(text[at + len(_MISTRAL):], ","), names)
    return (text[:at].strip(), calls) if calls else None


_PARSERS: dict[str, Callable[[str, frozenset[str]], "ParsedCalls | None"]] = {
    "hermes": _hermes, "llama3": _llama3, "mistral": _mistral,
}


def parse_tool_calls(text: str, tools: Sequence[Tool], fmt: str) -> ParsedCalls:
    """``(content, calls)`` of an answer in format ``fmt``; ``(text, ())`` when it holds no valid call."""
    if fmt not in CALL_FORMATS:
        raise ValueError(f"unknown call format {fmt!r}")
    names = frozenset(t.name for t in tools)
    parsed = _PARSERS[fmt](text, names)
    if parsed is None:  # the generic fallback: the whole answer is call objects (any family writes these)
        fenced = re.fullmatch(r"\s*```(?:json)?\s*(.*?)\s*```\s*", text, re.S)
        calls = _all_calls(_objects(fenced.group(1) if fenced else text, ";"), names)
        parsed = ("", calls) if calls else None
    return parsed if parsed is not None else (text, ())
