"""Request bodies of the POST routes (pydantic models, published in ``/openapi.json``).

The models are built per service because their bounds are the service's
limits (``output_limit(max_tokens=...)``, ``limits(max_rows=...)``), so the
published schema states exactly what is accepted. Fields are strict: ``"5"``
is not an integer and ``true`` is not a number, and the 422 answer names
the field.

- ``/chat`` (the seed route) takes the library's request options under
  their own names with the library's defaults, and refuses unknown fields
  (422), so a misspelt option fails instead of being ignored.
- Every field that carries a library option takes its type, bounds, default
  and description from the option's declaration (:mod:`aner_nb.llm.options`),
  so ``/openapi.json`` states the declared bounds; ``request_models`` takes
  the registry to build from.
- The OpenAI routes declare every field they honour or ignore (see
  ``openai_fields``); anything else arrives as an extra field and is
  answered 400 by ``openai_fields.refuse_unsupported``. Their sampling
  fields are nullable (``null`` means the default), as in OpenAI's schema.

Value checks the library makes anyway (``top_k`` against the vocabulary,
``repeat_penalty``'s upper bound, a GBNF grammar, a JSON schema's features)
are left to it: its error names the field and becomes a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model

from ..llm.options import CHAT_ROUTE, COMPLETIONS_ROUTE, MAX_TOP_LOGPROBS, REGISTRY, Option, OpenAIField, Registry
from .openai_fields import IGNORED, MAX_CHOICES, FieldPolicy, route_fields

__all__ = ["RequestModels", "request_models", "option_fields", "SEED_ROUTE", "Message", "StreamOptions",
           "ResponseFormat", "JsonSchemaFormat"]

SEED_ROUTE = "seed"  # the /chat route (mounted at any path): options under their own names


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Lenient):
    """One text part of an OpenAI message whose content is a list of parts."""

    type: Literal["text"]
    text: str


class CalledFunction(_Lenient):
    name: str = Field(max_length=64)
    arguments: str = Field(description="The arguments the model gave, a JSON object as a string.")


class MessageToolCall(_Lenient):
    """A call an earlier assistant message made (sent back with its result)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Lenient):
    """An OpenAI chat message; ``developer`` is served as ``system``. An assistant message may carry
    ``tool_calls`` (its content then may be null); a ``tool`` message answers one by ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]]  # required; null only with tool_calls (the library checks)
    tool_calls: Optional[list[MessageToolCall]] = Field(None, max_length=64)
    tool_call_id: Optional[str] = Field(None, max_length=256)
    name: Optional[str] = Field(None, max_length=64)

    def plain(self) -> dict[str, Any]:
        """The library's message dict (the library checks tool calls and ids, naming the field)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                out["name"] = self.name
        return out


class StreamOptions(_Lenient):
    include_usage: bool = Field(False, description="Send a last chunk with no choices and the usage.")
    include_obfuscation: Optional[bool] = Field(None, description="Accepted and ignored: no padding is added.")


class TextFormat(_Closed):
    type: Literal["text"]


class JsonObjectFormat(_Closed):
    type: Literal["json_object"]


class JsonSchemaSpec(_Closed):
    name: str = Field(max_length=64, description="The format's name (not shown to the model).")
    description: Optional[str] = Field(None, description="Accepted; not shown to the model.")
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="The JSON schema the output follows.")
    strict: Optional[bool] = Field(None, description="Accepted; the schema is always enforced by a grammar.")


class JsonSchemaFormat(_Closed):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]

# The pydantic types of the OpenAI fields that the HTTP layer maps to an option (``calls``).
MAPPED_TYPES: dict[str, Any] = {
    "response_format": Optional[ResponseFormat],
    # /v1/completions' legacy logprobs: how many alternatives (0: the chosen tokens' logprobs only)
    "logprobs": Optional[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]],
}


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _bounds(option: Option, cap: int) -> dict[str, Any]:
    """The declared bounds as pydantic constraints (the output limit caps ``service_cap`` options)."""
    if option.type not in (int, float):
        return {}
    out: dict[str, Any] = {"gt" if option.open_low else "ge": option.type(option.low)}
    if option.service_cap:
        out["le"] = cap
    elif option.schema_high:
        out["le"] = option.type(option.high)
    if option.type is float:
        out["allow_inf_nan"] = False
    return out


def _seed_field(option: Option, cap: int) -> tuple[Any, Any]:
    if option.service_cap:
        default, said = cap, " Default: the service's output limit."
    else:
        default = option.wire_default
        said = "" if option.nullable else f" Default {option.default}."
    return option.wire_type, Field(default, description=_sentence(option.help) + said, **_bounds(option, cap))


def _openai_field(option: Option, f: OpenAIField, cap: int) -> tuple[Any, Any]:
    if f.mapped:
        return MAPPED_TYPES[f.name], Field(None, description=_sentence(f.note))
    annotation = option.wire_type if option.nullable else Optional[option.wire_type]
    return annotation, Field(None, description=_sentence(f.note), **_bounds(option, cap))


def option_fields(route: str, *, cap: int, registry: Registry = REGISTRY) -> dict[str, Any]:
    """The fields carrying library options on ``route`` (:data:`SEED_ROUTE` or an OpenAI route), from the declarations.

    ``/chat``: each option under its own name, with the library's default; the OpenAI routes: each
    declared field, nullable (null means its default, see ``calls``).
    """
    out: dict[str, Any] = {}
    for option in registry:
        if route == SEED_ROUTE:
            if option.seed_route:
                out[option.name] = _seed_field(option, cap)
            continue
        for f in option.fields_on(route):
            out.setdefault(f.name, _openai_field(option, f, cap))
    return out


def _ignored_fields(table: dict[str, FieldPolicy]) -> dict[str, Any]:
    """The fields a route accepts and ignores, of any type (they cannot change the output)."""
    return {p.name: (Optional[Any], Field(None, description=f"Accepted and ignored: {p.note}."))
            for p in table.values() if p.handling == IGNORED}


def _openai_config() -> ConfigDict:
    # Extra fields are parsed (and then refused by name with a 400); the schema says they are not accepted.
    return ConfigDict(strict=True, extra="allow", json_schema_extra={"additionalProperties": False})


class RequestModels:
    """The request bodies of one service, bounded by its limits."""

    def __init__(self, seed: type[BaseModel], chat: type[BaseModel], completion: type[BaseModel]) -> None:
        self.seed = seed
        self.chat = chat
        self.completion = completion


def request_models(*, max_tokens: int, max_rows: int, registry: Registry = REGISTRY) -> RequestModels:
    """Request models whose ``max_tokens`` is capped at ``max_tokens`` and ``messages`` at ``max_rows``."""
    return RequestModels(_seed_model(max_tokens, registry), _chat_model(max_tokens, max_rows, registry),
                         _completion_model(max_tokens, registry))


def _common_openai() -> dict[str, Any]:
    """Fields both OpenAI routes declare the same way (and carry no library option)."""
    return {
        "model": (Optional[str], Field(None, description="The served model's id (see /v1/models).")),
        "stream": (Optional[bool], Field(False)),
        "stream_options": (Optional[StreamOptions], Field(None)),
        "n": (Optional[int], Field(None, ge=1, le=MAX_CHOICES, description=f"How many choices (1..{MAX_CHOICES}); "
                                   "choice i samples with seed + i.")),
    }


def _seed_model(cap: int, registry: Registry) -> type[BaseModel]:
    return create_model(
        "ChatRequest",
        __base__=_Closed,
        __doc__="The seed route: one user prompt, formatted with the model's chat template. Every field but "
                "`prompt` is a library request option under its own name, with the library's default.",
        prompt=(str, Field(description="The user message.")),
        **option_fields(SEED_ROUTE, cap=cap, registry=registry),
    )


def _chat_model(cap: int, rows: int, registry: Registry) -> type[BaseModel]:
    return create_model(
        "ChatCompletionRequest",
        __config__=_openai_config(),
        __doc__="OpenAI `chat.completions.create`; docs/openai.md lists what each field does here.",
        messages=(list[Message], Field(min_length=1, max_length=rows)),
        **_common_openai(),
        **option_fields(CHAT_ROUTE, cap=cap, registry=registry),
        **_ignored_fields(route_fields(CHAT_ROUTE, registry)),
    )


def _completion_model(cap: int, registry: Registry) -> type[BaseModel]:
    return create_model(
        "CompletionRequest",
        __config__=_openai_config(),
        __doc__="OpenAI `completions.create` (legacy): raw text in, no chat template; docs/openai.md lists "
                "what each field does here.",
        prompt=(Union[str, list[str]], Field(description="The text to continue, as is (a list of one string).")),
        echo=(Optional[bool], Field(None, description="Put the prompt before the answer (with logprobs: its "
                                    "tokens' logprobs too).")),
        **_common_openai(),
        **option_fields(COMPLETIONS_ROUTE, cap=cap, registry=registry),
        **_ignored_fields(route_fields(COMPLETIONS_ROUTE, registry)),
    )
