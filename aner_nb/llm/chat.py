"""Chat templates: resolution, message validation and sandboxed rendering.

Templates are untrusted code (an embedded GGUF template comes from an
arbitrary file), so they compile and render in jinja2's
``ImmutableSandboxedEnvironment`` with no loader (no ``include``/``import``),
no randomness and no filesystem or environment access. The template globals
follow Hugging Face's ``apply_chat_template`` so embedded templates written for
it render the same way here (including jinja2's default ``Undefined``: an
undefined name prints as empty text and fails on any further use).
"""

from __future__ import annotations

import json
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .deadline import DeadlineExceeded, within
from .errors import ChatTemplateError, ConfigurationError, InvalidRequestError

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
ROLES: tuple[str, ...] = ("system", "user", "assistant")

# ChatML (Qwen, many fine-tunes): "<|im_start|>{role}\n{content}<|im_end|>\n"
# per message, then "<|im_start|>assistant\n" to prompt the answer.
_CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def _system_first_alternating(family: str) -> str:
    """Jinja opening of the formats with no system turn (Gemma, Mistral).

    A leading system message becomes ``first_user_prefix`` (its content and
    "\n\n", for the first user turn); ``loop_messages`` are the rest, which
    must alternate user/assistant, starting with user. A system message
    anywhere else, or one with no user turn after it, is an error.
    """
    return r"""
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
    {%- if not loop_messages -%}
        {{ raise_exception("FAMILY needs a user message after the system message") }}
    {%- endif -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message['role'] == 'system' -%}
        {{ raise_exception("FAMILY accepts a system message only as the first message") }}
    {%- endif -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}""".replace("FAMILY", family)


# Gemma (2 and 3), text only, as Google's official template: BOS, turns
# "<start_of_turn>{user|model}\n{content|trim}<end_of_turn>\n", a leading
# system message prepended to the first user turn followed by "\n\n", strict
# user/model alternation. Stricter than the official one in two error cases it
# would otherwise render silently: a system message that is not first, or one
# with no user turn after it. An empty ``bos_token`` falls back to "<bos>",
# Gemma's BOS text, because the format requires it.
_GEMMA = r"""{{ bos_token if bos_token else '<bos>' }}""" + _system_first_alternating("Gemma") + r"""
    {%- if message['role'] == 'assistant' -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}"""

# Llama 3 / 3.x Instruct, as Meta's template without tools: BOS, then
# "<|start_header_id|>{role}<|end_header_id|>\n\n{content|trim}<|eot_id|>" per
# message. An empty ``bos_token`` falls back to "<|begin_of_text|>".
_LLAMA3 = (
    "{{- bos_token if bos_token else '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + (message['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif -%}"
)

# Mistral Instruct [INST] format, as the official template of Mistral-7B-Instruct-v0.2 and
# Mixtral-8x7B-Instruct-v0.1: BOS, "[INST] {user} [/INST]", "{assistant}</s>", strict
# alternation. The official template rejects a system message; here a leading one is prepended
# to the first user turn followed by "\n\n", as Mistral's v1 format places it. Empty
# ``bos_token``/``eos_token`` fall back to "<s>"/"</s>".
_MISTRAL = r"""{{ bos_token if bos_token else '<s>' }}""" + _system_first_alternating("Mistral") + r"""
    {%- if message['role'] == 'user' -%}
        {{ '[INST] ' + (first_user_prefix if loop.first else '') + message['content'] + ' [/INST]' }}
    {%- else -%}
        {{ message['content'] + (eos_token if eos_token else '</s>') }}
    {%- endif -%}
{%- endfor -%}"""

# Phi-3, as Microsoft's template (Phi-3-mini, 2024-07 update): "<|{role}|>\n{content}<|end|>\n"
# per message, then "<|assistant|>\n" to prompt the answer; without a generation prompt it ends
# with the EOS text. No BOS. (Phi-3.5's template also drops an empty system message.)
_PHI3 = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- else -%}{{ eos_token }}{%- endif -%}"
)

#: Built-in templates by name (read-only).
BUILTIN_TEMPLATES: Mapping[str, str] = types.MappingProxyType(
    {"chatml": _CHATML, "gemma": _GEMMA, "llama3": _LLAMA3, "mistral": _MISTRAL, "phi3": _PHI3}
)

#: The built-in to pass as ``chat_template=`` for a file of each admitted architecture that has
#: none embedded. A Mistral file (architecture llama too) takes "mistral"; Qwen3's own template is
#: ChatML with thinking tags.
FAMILY_TEMPLATES: Mapping[str, str] = types.MappingProxyType(
    {"llama": "llama3", "qwen2": "chatml", "qwen3": "chatml", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}
)

# Largest str/list a template may build with ``*`` and largest ``**`` result (bits).
_MAX_REPEAT_LEN = 1 << 20
_MAX_POWER_BITS = 1 << 16
# Bounds of one render: a prompt is at most 65,536 tokens, far below 16 MiB of text, and a real
# template renders in milliseconds; anything beyond is a hostile or broken template.
RENDER_SECONDS = 2.0
MAX_RENDER_CHARS = 16 << 20


def _bounded_output(chunks: Any) -> str:
    """Join a template's output chunks, refusing more than MAX_RENDER_CHARS."""
    out, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_RENDER_CHARS:
            raise SecurityError(f"the rendered prompt exceeds {MAX_RENDER_CHARS} characters")
        out.append(chunk)
    return "".join(out)


def _builtin_names() -> str:
    return ", ".join(BUILTIN_TEMPLATES)


class _TemplateRaised(TemplateError):
    """A template called ``raise_exception(message)``."""


def _raise_exception(message: Any = "") -> None:
    raise _TemplateRaised(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without HTML escaping, as Hugging Face's ``tojson`` (prompts are not HTML)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(Extension):
    """Accept HF's ``{% generation %}...{% endgeneration %}`` and render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that fails loudly on unsafe access and bounds ``*`` / ``**``."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: Any) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if len(seq) * n > _MAX_REPEAT_LEN:
                        raise SecurityError(f"repetition longer than {_MAX_REPEAT_LEN} is not allowed")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and abs(left).bit_length() * right > _MAX_POWER_BITS:
                raise SecurityError("power result too large")
        return super().call_binop(context, operator, left, right)


def _make_environment() -> _Sandbox:
    env = _Sandbox(
        loader=None,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        extensions=["jinja2.ext.loopcontrols", _GenerationTag],
    )
    # Deterministic rendering: drop the only random helpers jinja2 ships.
    env.globals.pop("lipsum", None)
    env.filters.pop("random", None)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


# Shared: the environment holds no per-template state and rendering is thread safe.
_ENV = _make_environment()


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
            compiled = _ENV.from_string(self.source)
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

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """Validate ``messages`` and render the prompt text.

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
            "tools": None,
            "documents": None,
        }
        try:
            return within(RENDER_SECONDS, lambda: _bounded_output(self._compiled.generate(context)))
        except DeadlineExceeded:
            raise ChatTemplateError(
                f"chat template ({self.origin}) took longer than {RENDER_SECONDS:g} s to render and was stopped",
                param="messages",
            ) from None
        except _TemplateRaised as exc:
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
    ``content`` are ignored (not passed to the template).
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
        if "content" not in message:
            raise InvalidRequestError(
                f"messages[{i}].content is missing; it must be a str", param=f"messages[{i}].content"
            )
        content = message["content"]
        if not isinstance(content, str):
            raise InvalidRequestError(
                f"messages[{i}].content must be a str, got {type(content).__name__}", param=f"messages[{i}].content"
            )
        out.append({"role": role, "content": str.__str__(content)})
    return tuple(out)


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
