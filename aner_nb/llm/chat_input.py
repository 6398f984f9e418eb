"""What a chat request gives its template besides the messages, and how its answer is to be read.

One request's tools, ``tool_choice`` and ``chat_template_kwargs`` become a
:class:`ChatInput`: the messages the template renders (the request's own;
rewritten for the generic tools block when the template does not handle
tools, see :func:`aner_nb.llm.tools.generic_messages`), the template's
``tools`` and extra variables, which message indices are trusted, the grammar
a ``required`` or named ``tool_choice`` imposes, and the
:class:`~aner_nb.llm.output.OutputFormat` that splits the answer's text into
content, reasoning and tool calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from .errors import InvalidRequestError
from .output import OutputFormat
from .reasoning import starts_inside, thinking_markers
from .sampling import tool_grammar
from .tool_parsers import call_format
from .tools import ForcedTool, generic_messages

if TYPE_CHECKING:
    from .options import RequestSettings
    from .weights import SharedWeights

__all__ = ["ChatInput", "chat_input"]


@dataclass(frozen=True)
class ChatInput:
    messages: tuple[Mapping[str, Any], ...]
    tools: Optional[tuple[dict[str, Any], ...]]  # the template's ``tools`` (None: not given)
    variables: tuple[tuple[str, Any], ...]
    trusted: frozenset[int]
    grammar: Optional[str]  # the constraint of tool_choice required / named
    output: OutputFormat

    def render(self, weights: "SharedWeights") -> str:
        return weights.template.render(self.messages, add_generation_prompt=True, tools=self.tools,
                                       variables=self.variables)


def _has_special_text(weights: "SharedWeights", text: str) -> bool:
    native = weights.native
    return native.tokenize(text, parse_special=True) != native.tokenize(text, parse_special=False)


def _vocabulary_has(weights: "SharedWeights"):  # noqa: ANN202 - a predicate
    native = weights.native

    def has(text: str) -> bool:
        ids = native.tokenize(text, parse_special=True)
        return len(ids) == 1 and native.parsed_special(ids[0])

    return has


def _check_tool_texts(weights: "SharedWeights", messages: Sequence[Mapping[str, Any]], tools: Sequence[Any]) -> None:
    """Tool definitions and earlier calls' names and arguments are caller text too: the template renders them
    outside the content slots, so special-token text in them is refused (unless allow_special_tokens)."""
    for i, tool in enumerate(tools):
        if _has_special_text(weights, tool.description + tool.parameters_json):
            raise InvalidRequestError(f"tools[{i}] contains special-token text (such as the template's turn "
                                      "markers); remove it, or pass allow_special_tokens=True",
                                      param=f"tools[{i}].function")
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls") or ()):
            if _has_special_text(weights, json.dumps(call["function"], ensure_ascii=False)):
                raise InvalidRequestError(
                    f"messages[{i}].tool_calls[{j}] contains special-token text; remove it, or pass "
                    "allow_special_tokens=True", param=f"messages[{i}].tool_calls[{j}].function.arguments")


def chat_input(
    weights: "SharedWeights", messages: Sequence[Mapping[str, Any]], request: "RequestSettings",
    trusted: frozenset[int] = frozenset(),
) -> ChatInput:
    """The template input and answer format of one chat request (its settings already checked)."""
    template = weights.template
    choice = request.tool_choice
    tools = request.tools if choice != "none" else ()
    forced = tools and (choice == "required" or isinstance(choice, ForcedTool))
    fmt = call_format(template.source)
    uses_tools = bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if uses_tools and not template.handles_tools:
        rendered = tuple(generic_messages(messages, tools))
        shift = len(rendered) - len(messages)
        trusted = frozenset(i + shift for i in trusted)
        template_tools = None
        fmt = "hermes"  # the generic block asks for <tool_call> tags
    else:
        rendered = tuple(messages)
        template_tools = tuple(t.as_openai() for t in tools) if tools else None
        if not request.allow_special_tokens:
            _check_tool_texts(weights, messages, tools)
    grammar = None
    if forced:
        chosen = tools if choice == "required" else tuple(t for t in tools if t.name == choice.name)
        grammar = tool_grammar(weights.native, chosen, fmt, parallel=request.parallel_tool_calls)
    markers = thinking_markers(template.source, _vocabulary_has(weights))
    out = ChatInput(rendered, template_tools, request.chat_template_kwargs, trusted, grammar,
                    OutputFormat(markers=markers, tools=tuple(tools), call_format=fmt))
    if markers is not None and starts_inside(out.render(weights), markers):
        out = ChatInput(out.messages, out.tools, out.variables, out.trusted, grammar,
                        OutputFormat(markers=markers, inside=True, tools=tuple(tools), call_format=fmt))
    return out
