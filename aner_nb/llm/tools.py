"""Tool calling, the pure parts: tool and tool-choice validation, the generic tools block, the call grammar.

A request's ``tools`` are OpenAI function tools (``{"type": "function",
"function": {"name", "description", "parameters"}}``); they are checked and
bounded here (count, name, description, the parameters schema through
:func:`~aner_nb.llm.constraints.check_json_schema`) and kept as frozen
:class:`Tool` values, so request settings stay immutable. A model's answer
that calls tools becomes :class:`ToolCall` values whose ``arguments`` are a
JSON string, as OpenAI sends them.

How tools reach the model: a chat template that references ``tools`` gets
them as Hugging Face's ``apply_chat_template`` passes them (a list of the
OpenAI dicts); any other template gets the **generic block**
(:func:`generic_tools_block`), a system text listing the tools as JSON and
asking for Hermes-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
answers; tool results and earlier calls are then written as plain text
turns (:func:`generic_messages`). With ``tool_choice="required"`` or a
named tool the output is constrained by :func:`call_grammar`, a GBNF
grammar in the family's call format around the tools' argument schemas.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

from .constraints import check_json_schema
from .errors import InvalidRequestError
from .valid_text import check_text

__all__ = [
    "MAX_TOOLS", "MAX_DESCRIPTION_CHARS", "MAX_PARALLEL_CALLS", "MAX_TEMPLATE_KWARGS", "TOOL_NAME", "TOOL_CHOICES",
    "Tool", "ToolCall", "ForcedTool", "check_tools", "check_tool_choice", "check_template_kwargs",
    "new_call_id", "generic_tools_block", "generic_messages", "call_schema", "call_grammar", "CALL_FORMATS",
]

MAX_TOOLS = 128
MAX_DESCRIPTION_CHARS = 8192
MAX_PARALLEL_CALLS = 8  # most calls one constrained answer may make (a grammar must be finite to close)
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_VALUE_CHARS = 4096
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
_KWARG_NAME = re.compile(r".{1,64}", re.S)  # any name: only identifiers are reachable from template code
# What a template reads besides the messages: chat_template_kwargs may not replace these.
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token", "strftime_now",
    "raise_exception", "range", "dict", "namespace", "lipsum", "cycler", "joiner",
})
# Call formats (how a family writes a call): Hermes/Qwen tags, Llama 3.x bare JSON, Mistral's prefix.
CALL_FORMATS = ("hermes", "llama3", "mistral")


@dataclass(frozen=True)
class Tool:
    """One function tool: its name, description and parameters schema (kept as canonical JSON text)."""

    name: str
    description: str
    parameters_json: str

    @property
    def parameters(self) -> dict[str, Any]:
        return json.loads(self.parameters_json)

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI tool dict (what a template's ``tools`` holds)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is a JSON object as a string (OpenAI's shape)."""

    id: str
    name: str
    arguments: str

    def parsed_arguments(self) -> Any:
        return json.loads(self.arguments)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ForcedTool:
    """``tool_choice={"type": "function", "function": {"name": NAME}}``: the answer must call that tool."""

    name: str


ToolChoice = Union[str, ForcedTool]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _refuse(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _tool(i: int, item: Any, param: str) -> Tool:
    where = f"{param}[{i}]"
    if isinstance(item, Tool):
        return item
    if not isinstance(item, Mapping):
        raise _refuse(f"{where} must be a {{'type': 'function', 'function': {{...}}}} mapping, got "
                      f"{type(item).__name__}", where)
    if item.get("type", "function") != "function":
        raise _refuse(f"{where}.type must be 'function', got {item.get('type')!r}", f"{where}.type")
    function = item.get("function")
    if not isinstance(function, Mapping):
        raise _refuse(f"{where}.function must be a mapping with 'name' (and 'description', 'parameters')",
                      f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise _refuse(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}",
                      f"{where}.function.name")
    description = function.get("description") or ""
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
        raise _refuse(f"{where}.function.description must be a string of at most {MAX_DESCRIPTION_CHARS} "
                      "characters", f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise _refuse(f"{where}.function.parameters must be a JSON schema object, got {type(parameters).__name__}",
                      f"{where}.function.parameters")
    check_json_schema(parameters, param=f"{where}.function.parameters")
    try:
        text = json.dumps(parameters, sort_keys=False, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _refuse(f"{where}.function.parameters is not JSON: {exc}", f"{where}.function.parameters") from None
    return Tool(str.__str__(name), str(description), text)


def check_tools(param: str, value: Any) -> tuple[Tool, ...]:
    """A request's ``tools`` as checked :class:`Tool` values (None or empty: no tools)."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise _refuse(f"{param} must be a list of function tools, got {type(value).__name__}", param)
    if len(value) > MAX_TOOLS:
        raise _refuse(f"{param} accepts at most {MAX_TOOLS} tools, got {len(value)}", param)
    check_text(value, param)  # names, descriptions and schemas are rendered and tokenized
    tools = tuple(_tool(i, item, param) for i, item in enumerate(value))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise _refuse(f"{param}[{i}].function.name {tool.name!r} is given twice; tool names must be unique",
                          f"{param}[{i}].function.name")
        seen.add(tool.name)
    return tools


def check_tool_choice(param: str, value: Any) -> ToolChoice:
    """``"none"``, ``"auto"`` (the default), ``"required"`` or a named function (a :class:`ForcedTool`)."""
    if value is None:
        return "auto"
    if isinstance(value, ForcedTool):
        return value
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise _refuse(f"{param} must be one of {', '.join(TOOL_CHOICES)} or "
                          "{'type': 'function', 'function': {'name': ...}}, got " + repr(value), param)
        return str.__str__(value)
    if isinstance(value, Mapping):
        function = value.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if value.get("type", "function") == "function" and isinstance(name, str) and TOOL_NAME.fullmatch(name):
            return ForcedTool(str.__str__(name))
    raise _refuse(f"{param} must be one of {', '.join(TOOL_CHOICES)} or "
                  "{'type': 'function', 'function': {'name': ...}}, got " + repr(value)[:80], param)


def check_tool_rules(tools: Sequence[Tool], choice: ToolChoice) -> None:
    """``required`` needs tools; a named choice must name one of them."""
    if choice == "required" and not tools:
        raise _refuse("tool_choice='required' needs tools; pass tools=[...]", "tool_choice")
    if isinstance(choice, ForcedTool) and choice.name not in {t.name for t in tools}:
        raise _refuse(f"tool_choice names {choice.name!r}, which is not one of the tools "
                      f"({', '.join(t.name for t in tools) or 'none given'})", "tool_choice")


def _scalar(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str) and len(value) <= MAX_TEMPLATE_VALUE_CHARS


def check_template_kwargs(param: str, value: Any) -> tuple[tuple[str, Any], ...]:
    """``chat_template_kwargs`` as sorted ``(name, value)`` pairs: names, JSON scalars, at most 16."""
    if value is None:
        return ()
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise _refuse(f"{param} must be a mapping of template variables to JSON scalars, got "
                      f"{type(value).__name__}", param)
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise _refuse(f"{param} accepts at most {MAX_TEMPLATE_KWARGS} variables, got {len(value)}", param)
    out = []
    for key, item in value.items():
        if not isinstance(key, str) or not _KWARG_NAME.fullmatch(key):
            raise _refuse(f"{param} keys must be names of 1..64 characters, got {key!r}", param)
        if key in RESERVED_TEMPLATE_NAMES:
            raise _refuse(f"{param}.{key} would replace what the template is given; choose another name",
                          f"{param}.{key}")
        if not _scalar(item):
            raise _refuse(f"{param}.{key} must be a JSON scalar (null, a bool, a number, a string of at most "
                          f"{MAX_TEMPLATE_VALUE_CHARS} characters), got {type(item).__name__}", f"{param}.{key}")
        out.append((str.__str__(key), item))
    check_text(dict(out), param)
    return tuple(sorted(out))


# -- rendering without template support ----------------------------------------------------------
GENERIC_BLOCK_HEADER = (
    "You can call functions. The available functions, as JSON schemas:\n"
)
GENERIC_BLOCK_FOOTER = (
    "\nTo call a function, answer with one line per call:\n"
    "<tool_call>{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}</tool_call>\n"
    "Otherwise answer normally."
)


def generic_tools_block(tools: Sequence[Tool]) -> str:
    """The system text that describes ``tools`` to a model whose template does not handle them."""
    lines = [json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in tools]
    return GENERIC_BLOCK_HEADER + "\n".join(lines) + GENERIC_BLOCK_FOOTER


def _call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function", {})
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return "<tool_call>" + json.dumps({"name": function.get("name"), "arguments": arguments},
                                      ensure_ascii=False) + "</tool_call>"


def generic_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Messages for a template without tool support: the tools block in the (first) system message, earlier
    calls as assistant text, tool results as user turns wrapped in ``<tool_response>``.

    The result has exactly one message per input message (plus a leading system message when there was
    none and ``tools`` is not empty): index ``i`` of the input is index ``i + shift`` here.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        else:
            out.append({"role": role, "content": content})
    if tools:
        block = generic_tools_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# -- constrained calls ---------------------------------------------------------------------------
def call_schema(tools: Sequence[Tool], fmt: str) -> dict[str, Any]:
    """The JSON schema of one call object in ``fmt`` (``llama3`` names the arguments ``parameters``)."""
    key = "parameters" if fmt == "llama3" else "arguments"
    options = [
        {"type": "object", "properties": {"name": {"const": t.name}, key: t.parameters},
         "required": ["name", key], "additionalProperties": False}
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


_ROOT_RULE = re.compile(r"^root(\s*::=)", re.M)


def call_grammar(call_rules: str, fmt: str, *, parallel: bool) -> str:
    """A GBNF grammar of a whole answer that calls tools, from the converter's grammar of one call object.

    The converter's ``root`` becomes ``tool-call``; the answer is one call (up to
    :data:`MAX_PARALLEL_CALLS` when ``parallel``) in the family's format, and nothing else.
    """
    if fmt not in CALL_FORMATS:
        raise ValueError(f"unknown call format {fmt!r}")
    rules = _ROOT_RULE.sub(r"tool-call\1", call_rules, count=1)
    more = f"{{0,{MAX_PARALLEL_CALLS - 1}}}"
    if fmt == "hermes":
        one = '"<tool_call>\\n" tool-call "\\n</tool_call>"'
        root = f'root ::= {one}' + (f' ("\\n" {one}){more}' if parallel else "")
    elif fmt == "llama3":
        root = "root ::= tool-call" + (f' (";" tool-call){more}' if parallel else "")
    else:
        root = 'root ::= "[TOOL_CALLS][" tool-call' + (f' ("," tool-call){more}' if parallel else "") + ' "]"'
    return root + "\n" + rules
