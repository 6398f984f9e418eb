"""Request bodies turned into library calls: the prompt, the library's options, and the route's field names.

Each POST route parses its body (``request_bodies``) into a :class:`Call`:

- ``/chat`` passes every field but ``prompt`` to the library under its own
  name, with the library's defaults (greedy, seed 0);
- ``/v1/chat/completions`` and ``/v1/completions`` first refuse what they
  cannot honour (``openai_fields``), then follow OpenAI: ``temperature``
  defaults to 1, an omitted ``seed`` is drawn fresh (and returned, so the
  answer can be reproduced), ``max_completion_tokens`` aliases
  ``max_tokens``, ``response_format`` becomes the library's ``json_schema``,
  and ``/v1/completions`` sends its prompt as raw text (no chat template).

A library error names the library's option in ``param``; ``Call.renames``
spells it the route's way (``json_schema`` is ``response_format`` on the
OpenAI routes).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from pydantic import BaseModel

from ..llm.profiles import MAX_SEED
from .errors import ApiError
from .openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, refuse_unsupported

__all__ = ["Call", "seed_call", "chat_call", "completion_call", "response_format_options", "OPENAI_TEMPERATURE"]

OPENAI_TEMPERATURE = 1.0  # OpenAI's default when a request names none
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Library options an OpenAI body passes under their own names when set (null means the library's default).
_PASSED = ("top_p", "presence_penalty", "frequency_penalty", "stop", "top_k", "min_p", "repeat_penalty",
           "repeat_last_n", "grammar")
_OPENAI_RENAMES = {"json_schema": "response_format"}


@dataclass(frozen=True)
class Call:
    """One request in the library's terms, and the route's names for its fields (for error params)."""

    prompt: Any  # messages, a user prompt, or raw text (``raw``)
    options: dict[str, Any]  # the library's request options
    fields: frozenset[str]  # the route's request fields
    prompt_field: str  # the one holding the input: "prompt" or "messages"
    route: str  # the route's path (the metrics' route label)
    raw: bool = False  # raw completion: no chat template
    renames: Mapping[str, str] = field(default_factory=dict)  # library option -> route field

    @property
    def seed(self) -> int:
        return self.options.get("seed", 0)

    def start(self, model: Any) -> Any:
        """The library stream of this request on ``model`` (renders or tokenizes, and submits)."""
        if self.raw:
            return model.stream(self.prompt, raw=True, **self.options)
        return model.stream(self.prompt, **self.options)


def seed_call(body: BaseModel, route: str) -> Call:
    """The seed route's body as a library call: every field but ``prompt`` is a library option, as named."""
    b: Any = body
    return Call(b.prompt, b.model_dump(exclude={"prompt"}), frozenset(type(body).model_fields), "prompt", route)


def _given(body: BaseModel) -> dict[str, Any]:
    """The fields a client sent: the declared ones it set, and the undeclared ones."""
    return {**{name: getattr(body, name) for name in body.model_fields_set}, **(body.model_extra or {})}


def response_format_options(response_format: Optional[BaseModel]) -> dict[str, Any]:
    """OpenAI's ``response_format`` as library options: ``json_object`` and ``json_schema`` constrain the output."""
    kind = getattr(response_format, "type", "text")
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema":
        schema = response_format.json_schema.schema_  # type: ignore[union-attr]
        return {"json_schema": {} if schema is None else schema}
    return {}


def _openai_options(body: Any, max_tokens: int) -> dict[str, Any]:
    """The library options of an OpenAI body (both routes): OpenAI's defaults, and a fresh seed when none."""
    options = {name: getattr(body, name) for name in _PASSED if getattr(body, name) is not None}
    options["max_tokens"] = max_tokens
    options["temperature"] = OPENAI_TEMPERATURE if body.temperature is None else body.temperature
    options["seed"] = secrets.randbelow(MAX_SEED + 1) if body.seed is None else body.seed
    options.update(response_format_options(body.response_format))
    return options


def chat_call(body: BaseModel, max_tokens_cap: int) -> Call:
    """A ``/v1/chat/completions`` body as a library call (400 for a field it cannot honour)."""
    refuse_unsupported(_given(body), CHAT_FIELDS, "/v1/chat/completions")
    b: Any = body
    max_tokens = b.max_tokens if b.max_tokens is not None else b.max_completion_tokens
    options = _openai_options(b, max_tokens_cap if max_tokens is None else max_tokens)
    return Call([m.plain() for m in b.messages], options, frozenset(type(body).model_fields), "messages",
                "/v1/chat/completions", renames=_OPENAI_RENAMES)


def completion_call(body: BaseModel, max_tokens_cap: int) -> Call:
    """A ``/v1/completions`` body as a raw-text library call (400 for a field it cannot honour)."""
    refuse_unsupported(_given(body), COMPLETION_FIELDS, "/v1/completions")
    b: Any = body
    prompt = b.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt is a list of {len(prompt)} prompts; this service answers exactly one "
                           "prompt per request (a string, or a list of one string)",
                           param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
    max_tokens = min(COMPLETION_MAX_TOKENS, max_tokens_cap) if b.max_tokens is None else b.max_tokens
    return Call(prompt, _openai_options(b, max_tokens), frozenset(type(body).model_fields), "prompt",
                "/v1/completions", raw=True, renames=_OPENAI_RENAMES)
