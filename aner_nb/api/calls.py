"""Request bodies turned into library calls: the prompt, the library's options, and the route's field names.

Each POST route parses its body (``request_bodies``) into a :class:`Call`:

- ``/chat`` passes every field but ``prompt`` to the library under its own
  name, with the library's defaults (greedy, seed 0);
- ``/v1/chat/completions`` and ``/v1/completions`` first refuse what they
  cannot honour (``openai_fields``), then follow OpenAI: ``temperature``
  defaults to 1, an omitted ``seed`` is drawn fresh (and returned, so the
  answer can be reproduced), ``max_completion_tokens`` aliases
  ``max_tokens``, ``response_format`` becomes the library's ``json_schema``,
  and ``/v1/completions`` sends its prompt as raw text (no chat template);
  its legacy ``logprobs: N`` becomes ``logprobs=True, top_logprobs=N`` and,
  with ``echo``, ``prompt_logprobs=True``. ``n`` and ``echo`` are the
  call's own (``Call.choice`` is choice ``i``'s call, seed ``seed + i``).

Which field carries which option, and what an omitted field means, come
from the options' declarations (:mod:`aner_nb.llm.options`); the options a
call gathers become one checked ``RequestSettings`` when it starts. A library
error names the library's option in ``param``; ``Call.renames`` spells it
the route's way (``json_schema`` is ``response_format`` on the OpenAI
routes, from the declaration's mapped fields).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

from pydantic import BaseModel

from ..llm.options import (CHAT_ROUTE, COMPLETIONS_ROUTE, LIBRARY, MAX_SEED, OUTPUT_LIMIT, RANDOM, REGISTRY, Option,
                           Registry)
from ..llm.requests import request_settings
from .errors import ApiError
from .openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, refuse_unsupported

__all__ = ["Call", "seed_call", "chat_call", "completion_call", "response_format_options", "openai_options",
           "renames", "OPENAI_TEMPERATURE"]

OPENAI_TEMPERATURE = REGISTRY["temperature"].fields_on(CHAT_ROUTE)[0].default  # OpenAI's default (1.0)
COMPLETION_MAX_TOKENS = REGISTRY["max_tokens"].fields_on(COMPLETIONS_ROUTE)[0].default  # OpenAI's default (16)


def renames(registry: Registry = REGISTRY) -> dict[str, str]:
    """Library option -> the OpenAI field it is mapped from (``json_schema`` -> ``response_format``)."""
    return {o.name: f.name for o in registry for f in o.openai if f.mapped and f.name != o.name}


_OPENAI_RENAMES = renames()


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
    n: int = 1  # choices (OpenAI's ``n``); choice i runs with seed + i
    echo: bool = False  # /v1/completions: the prompt goes before the answer's text
    ignored: tuple[str, ...] = ()  # unknown fields a lenient service ignored (named in a response header)

    @property
    def seed(self) -> int:
        return self.options.get("seed", 0)

    def choice(self, index: int) -> "Call":
        """The call of choice ``index``: the same request with seed ``seed + index`` (mod 2**32), one choice."""
        if index == 0 and self.n == 1:
            return self
        options = {**self.options, "seed": (self.seed + index) % (MAX_SEED + 1)}
        return replace(self, options=options, n=1)

    def start(self, model: Any) -> Any:
        """The library stream of this request on ``model``: its options checked once, as RequestSettings."""
        settings = request_settings(self.options)
        if self.raw:
            return model.stream(self.prompt, raw=True, settings=settings)
        return model.stream(self.prompt, settings=settings)


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


def _omitted(option: Option, default: Any, cap: int) -> Any:
    """The value of an omitted (or null) OpenAI field whose declared default is not the library's."""
    if default is RANDOM:
        return int(option.low) + secrets.randbelow(int(option.high) - int(option.low) + 1)  # type: ignore[arg-type]
    if default is OUTPUT_LIMIT:
        return cap
    return min(default, cap) if option.service_cap else default


def openai_options(body: Any, route: str, cap: int, registry: Registry = REGISTRY) -> dict[str, Any]:
    """The library options of an OpenAI body on ``route``, from the declared fields and their defaults.

    The first declared field given wins (``max_tokens`` over ``max_completion_tokens``); an omitted one
    means its declared default (OpenAI's temperature 1, a fresh seed, the output limit); mapped fields
    (``response_format``) are converted by :func:`response_format_options`.
    """
    options: dict[str, Any] = {}
    for option in registry:
        fields = [f for f in option.fields_on(route) if not f.mapped]
        if not fields:
            continue
        value = next((v for v in (getattr(body, f.name) for f in fields) if v is not None), None)
        if value is None and fields[0].default is not LIBRARY:
            value = _omitted(option, fields[0].default, cap)
            if fields[0].default is OUTPUT_LIMIT:  # omitted: the output limit, or what fits the context
                options["max_tokens_fit"] = True
        if value is not None:
            options[option.name] = value
    options.update(response_format_options(body.response_format))
    if route == COMPLETIONS_ROUTE:
        options.update(legacy_logprobs_options(body))
    return options


def legacy_logprobs_options(body: Any) -> dict[str, Any]:
    """``/v1/completions``' ``logprobs: N`` (N alternatives) and ``echo``: the library's logprobs options."""
    n = getattr(body, "logprobs", None)
    if n is None:
        return {}
    out: dict[str, Any] = {"logprobs": True, "top_logprobs": n}
    if getattr(body, "echo", None):
        out["prompt_logprobs"] = True  # echo with logprobs: the prompt's tokens are scored too
    return out


def chat_call(body: BaseModel, max_tokens_cap: int, lenient: bool = False) -> Call:
    """A ``/v1/chat/completions`` body as a library call (400 for a field it cannot honour)."""
    ignored = refuse_unsupported(_given(body), CHAT_FIELDS, "/v1/chat/completions", lenient=lenient)
    b: Any = body
    options = openai_options(b, CHAT_ROUTE, max_tokens_cap)
    return Call([m.plain() for m in b.messages], options, frozenset(type(body).model_fields), "messages",
                "/v1/chat/completions", renames=_OPENAI_RENAMES, n=b.n or 1, ignored=ignored)


def completion_call(body: BaseModel, max_tokens_cap: int, lenient: bool = False) -> Call:
    """A ``/v1/completions`` body as a raw-text library call (400 for a field it cannot honour)."""
    ignored = refuse_unsupported(_given(body), COMPLETION_FIELDS, "/v1/completions", lenient=lenient)
    b: Any = body
    prompt = b.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt is a list of {len(prompt)} prompts; this service answers exactly one "
                           "prompt per request (a string, or a list of one string)",
                           param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
    if b.stream and b.echo and b.logprobs is not None:
        raise ApiError(400, "echo with logprobs (prompt scoring) is answered whole; send it with stream: false",
                       param="echo", code="unsupported_parameter")
    return Call(prompt, openai_options(b, COMPLETIONS_ROUTE, max_tokens_cap), frozenset(type(body).model_fields), "prompt",
                "/v1/completions", raw=True, renames={**_OPENAI_RENAMES, "prompt_logprobs": "echo"}, n=b.n or 1,
                echo=bool(b.echo), ignored=ignored)
