"""Chat templates: resolution, message validation and sandboxed rendering.

Templates are untrusted code (an embedded GGUF template comes from an
arbitrary file), so they compile and render in jinja2's
``ImmutableSandboxedEnvironment`` with no loader (no ``include``/``import``),
no randomness and no filesystem or environment access. The template globals
follow Hugging Face's ``apply_chat_template`` so embedded templates written for
it render the same way here (including jinja2's default ``Undefined``: an
undefined name prints as empty text and fails on any further use).

The built-in templates are in ``templates.py``, the bounded sandbox in
``sandbox.py`` and the prompt-integrity layout in ``prompt_layout.py``;
this module keeps :class:`ChatTemplate`, resolution and message validation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from datetime import datetime
from typing import Any

from jinja2 import TemplateSyntaxError, meta
from jinja2.exceptions import SecurityError

from .deadline import DeadlineExceeded, within
from .errors import ChatTemplateError, ConfigurationError, InvalidRequestError
from .prompt_layout import locate_contents, template_layout  # noqa: F401 - re-exported (requests imports them here)
from .sandbox import MAX_RENDER_CHARS  # noqa: F401 - re-exported: the render bounds, with RENDER_SECONDS
from .sandbox import ENVIRONMENT, RENDER_SECONDS, TemplateRaised, bounded_output
from .templates import BUILTIN_TEMPLATES, FAMILY_TEMPLATES
from .templates import builtin_names as _builtin_names
from .tools import TOOL_NAME
from .valid_text import check_text

__all__ = [
    "BUILTIN_TEMPLATES",
    "FAMILY_TEMPLATES",
    "ROLES",
    "ChatTemplate",
    "resolve_template",
    "validate_messages",
    "format_prompt",
]

#: Roles a message may have.
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
MAX_MESSAGE_TOOL_CALLS = 64  # calls one assistant message may carry back
MAX_TOOL_CALL_ID = 256


@dataclass(frozen=True, repr=False)
class ChatTemplate:
    """A compiled, sandboxed chat template.

    ``origin`` is ``"embedded"``, ``"builtin:<name>"`` or ``"explicit"``. The
    source compiles at construction, so a broken template fails when it is
    resolved, not at the first request. ``now`` is the time ``strftime_now``
    reports (the construction time when omitted), which keeps rendering
    deterministic for the template's lifetime.
    """

    source: str
    origin: str
    bos_token: str = ""
    eos_token: str = ""
    now: datetime | None = field(default=None, compare=False)
    _compiled: Any = field(init=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("source", "origin", "bos_token", "eos_token"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ChatTemplateError(f"chat template {name} must be a str, got {type(value).__name__}")
        if self.now is None:
            object.__setattr__(self, "now", datetime.now())
        elif not isinstance(self.now, datetime):
            raise ChatTemplateError(f"chat template now must be a datetime, got {type(self.now).__name__}")
        try:
            compiled = ENVIRONMENT.from_string(self.source)
        except TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template ({self.origin}) has a syntax error at line {exc.lineno}: {exc.message}"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - any compile failure is a template problem
            raise ChatTemplateError(
                f"chat template ({self.origin}) does not compile: {type(exc).__name__}: {exc}"
            ) from exc
        object.__setattr__(self, "_compiled", compiled)

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, source=<{len(self.source)} chars>)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ChatTemplate, (self.source, self.origin, self.bos_token, self.eos_token, self.now))

    def _strftime_now(self, fmt: str) -> str:
        if not isinstance(fmt, str):
            raise TypeError(f"strftime_now format must be a str, got {type(fmt).__name__}")
        assert self.now is not None
        return self.now.strftime(fmt)

    @cached_property
    def handles_tools(self) -> bool:
        """Whether the template reads ``tools`` (then it renders them itself; else the generic block does)."""
        return "tools" in meta.find_undeclared_variables(ENVIRONMENT.parse(self.source))

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        tools: "Sequence[Mapping[str, Any]] | None" = None, variables: "Sequence[tuple[str, Any]]" = (),
    ) -> str:
        """Validate ``messages`` and render the prompt text.

        ``tools`` (OpenAI tool dicts) are the template's ``tools``; ``variables`` are extra template
        variables (a request's ``chat_template_kwargs``, already checked).

        Raises ``InvalidRequestError`` for malformed messages and
        ``ChatTemplateError`` for anything the template does wrong or rejects
        (``raise_exception``, sandbox violations, undefined access).
        """
        if not isinstance(add_generation_prompt, bool):
            raise InvalidRequestError(
                f"add_generation_prompt must be a bool, got {type(add_generation_prompt).__name__}"
            )
        checked = validate_messages(messages)
        context = {
            "messages": [dict(m) for m in checked],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "strftime_now": self._strftime_now,
            "tools": [dict(t) for t in tools] if tools else None,
            "documents": None,
        }
        context.update({name: value for name, value in variables if name not in context})
        try:
            return within(RENDER_SECONDS, lambda: bounded_output(self._compiled.generate(context)))
        except DeadlineExceeded:
            raise ChatTemplateError(
                f"chat template ({self.origin}) took longer than {RENDER_SECONDS:g} s to render and was stopped",
                param="messages",
            ) from None
        except TemplateRaised as exc:
            raise ChatTemplateError(
                f"chat template ({self.origin}) rejected the messages: {exc.message}", param="messages"
            ) from exc
        except SecurityError as exc:
            raise ChatTemplateError(
                f"chat template ({self.origin}) attempted an operation the sandbox forbids: {exc}", param="messages"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - template code may raise anything
            raise ChatTemplateError(
                f"chat template ({self.origin}) failed to render: {type(exc).__name__}: {exc}", param="messages"
            ) from exc


def resolve_template(
    explicit: str | None,
    embedded: str | None,
    *,
    bos_token: str = "",
    eos_token: str = "",
    model_name: str = "model",
    architecture: str | None = None,
) -> ChatTemplate:
    """Pick and compile the template: ``explicit`` (built-in name or Jinja) wins over ``embedded``.

    An empty or whitespace-only embedded template counts as missing; the
    error then names the built-in of ``architecture`` (:data:`FAMILY_TEMPLATES`)
    when there is one. Built-in names match case-insensitively.
    """
    if explicit is not None:
        if not isinstance(explicit, str):
            raise ChatTemplateError(
                f"chat_template must be a built-in name ({_builtin_names()}) or a Jinja string, "
                f"got {type(explicit).__name__}"
            )
        name = explicit.strip().lower()
        if name in BUILTIN_TEMPLATES:
            return ChatTemplate(BUILTIN_TEMPLATES[name], f"builtin:{name}", bos_token, eos_token)
        if "{%" in explicit or "{{" in explicit:
            return ChatTemplate(explicit, "explicit", bos_token, eos_token)
        shown = explicit if len(explicit) <= 60 else explicit[:57] + "..."
        raise ChatTemplateError(
            f"unknown chat template {shown!r}; use one of {_builtin_names()} "
            "or a Jinja string (containing '{%' or '{{')"
        )
    if embedded is not None and not isinstance(embedded, str):
        raise ChatTemplateError(f"embedded chat template must be a str, got {type(embedded).__name__}")
    if embedded is None or not embedded.strip():
        family = FAMILY_TEMPLATES.get(architecture or "")
        hint = f" ({architecture} models use {family!r})" if family else ""
        raise ChatTemplateError(
            f"{model_name} has no embedded chat template; pass chat_template= one of "
            f"{_builtin_names()}{hint} or a Jinja string"
        )
    return ChatTemplate(embedded, "embedded", bos_token, eos_token)


def validate_messages(
    messages: Sequence[Mapping[str, Any]], *, max_messages: int | None = None
) -> tuple[dict[str, str], ...]:
    """Check a conversation and return normalized copies ``{"role", "content"}``.

    Accepts a list or tuple of mappings; keys other than ``role`` and
    ``content`` are ignored (not passed to the template), except an assistant
    message's ``tool_calls`` (its content may then be None or absent) and a
    ``tool`` message's ``tool_call_id`` and ``name``.
    """
    if max_messages is not None and (
        isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1
    ):
        raise ConfigurationError(f"max_messages must be a positive int or None, got {max_messages!r}")
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestError(
            f"messages must be a list of {{'role', 'content'}} mappings, got {type(messages).__name__}",
            param="messages",
        )
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    if max_messages is not None and len(messages) > max_messages:
        raise InvalidRequestError(
            f"messages has {len(messages)} entries; at most {max_messages} are allowed", param="messages"
        )
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"messages[{i}] must be a mapping with 'role' and 'content', got {type(message).__name__}",
                param=f"messages[{i}]",
            )
        if "role" not in message:
            raise InvalidRequestError(
                f"messages[{i}].role is missing; it must be one of {', '.join(ROLES)}", param=f"messages[{i}].role"
            )
        role = message["role"]
        if isinstance(role, str):
            role = str.__str__(role)  # a plain str: subclasses cannot fake equality
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", param=f"messages[{i}].role"
            )
        if "content" not in message and not (role == "assistant" and message.get("tool_calls")):
            raise InvalidRequestError(
                f"messages[{i}].content is missing; it must be a str", param=f"messages[{i}].content"
            )
        content = message.get("content")
        calls = message.get("tool_calls") if role == "assistant" else None
        if content is None and calls:
            content = ""  # an assistant message that only calls tools (OpenAI sends null content)
        if not isinstance(content, str):
            raise InvalidRequestError(
                f"messages[{i}].content must be a str, got {type(content).__name__}", param=f"messages[{i}].content"
            )
        checked: dict[str, Any] = {"role": role, "content": str.__str__(content)}
        if calls:
            checked["tool_calls"] = _tool_calls(calls, f"messages[{i}].tool_calls")
        if role == "tool":
            checked.update(_tool_result(message, f"messages[{i}]"))
        check_text(checked, f"messages[{i}]")  # rendered and tokenized: every string must encode as UTF-8
        out.append(checked)
    return tuple(out)


def _tool_result(message: Mapping[str, Any], where: str) -> dict[str, str]:
    """A tool message's ``tool_call_id`` and ``name`` when given, checked (OpenAI sends the id; templates
    rarely read it, so a result without one is accepted, as llama.cpp's server does)."""
    call_id = message.get("tool_call_id")
    if call_id is None:
        call_id = ""
    elif not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_TOOL_CALL_ID:
        raise InvalidRequestError(
            f"{where}.tool_call_id must be the id (a string of 1..{MAX_TOOL_CALL_ID} characters) of the call this "
            f"result answers, got {call_id!r}", param=f"{where}.tool_call_id"
        )
    out = {"tool_call_id": str.__str__(call_id)}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidRequestError(f"{where}.name must be a tool name, got {name!r}", param=f"{where}.name")
        out["name"] = str.__str__(name)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as template-ready dicts (arguments as a JSON object, as
    Hugging Face templates expect)."""
    if not isinstance(calls, (list, tuple)) or len(calls) > MAX_MESSAGE_TOOL_CALLS:
        raise InvalidRequestError(f"{where} must be a list of at most {MAX_MESSAGE_TOOL_CALLS} calls", param=where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise InvalidRequestError(f"{at} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                                      param=at)
        name, arguments, call_id = function.get("name"), function.get("arguments", "{}"), call.get("id", "")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidRequestError(f"{at}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}",
                                      param=f"{at}.function.name")
        if not isinstance(call_id, str) or len(call_id) > MAX_TOOL_CALL_ID:
            raise InvalidRequestError(f"{at}.id must be a string of at most {MAX_TOOL_CALL_ID} characters",
                                      param=f"{at}.id")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser recurses
                arguments = None
        if not isinstance(arguments, Mapping):
            raise InvalidRequestError(f"{at}.function.arguments must be a JSON object (as a string or a dict)",
                                      param=f"{at}.function.arguments")
        out.append({"id": str.__str__(call_id), "type": "function",
                    "function": {"name": str.__str__(name), "arguments": json.loads(json.dumps(arguments))}})
    return out


def format_prompt(template: ChatTemplate, prompt: str, system: str | None = None) -> str:
    """Render one user message (after an optional system message) with the generation prompt."""
    if not isinstance(template, ChatTemplate):
        raise TypeError(f"template must be a ChatTemplate, got {type(template).__name__}")
    if not isinstance(prompt, str):
        raise InvalidRequestError(f"prompt must be a str, got {type(prompt).__name__}", param="prompt")
    if system is not None and not isinstance(system, str):
        raise InvalidRequestError(f"system must be a str or None, got {type(system).__name__}")
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": prompt})
    return template.render(messages, add_generation_prompt=True)

