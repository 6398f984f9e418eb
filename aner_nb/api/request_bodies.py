"""Request bodies of the POST routes (pydantic models, published in ``/openapi.json``).

The models are built per service because their bounds are the service's
limits (``output_limit(max_tokens=...)``, ``limits(max_rows=...)``), so the
published schema states exactly what is accepted. Fields are strict: ``"5"``
is not an integer and ``true`` is not a number, and the 422 answer names
the field.

- ``/chat`` (the seed route) takes the library's request options under
  their own names with the library's defaults, and refuses unknown fields
  (422), so a misspelt option fails instead of being ignored.
- The OpenAI routes declare every field they honour or ignore (see
  ``openai_fields``); anything else arrives as an extra field and is
  answered 400 by ``openai_fields.refuse_unsupported``. Their sampling
  fields are nullable (``null`` means the default), as in OpenAI's schema.

Value checks the library makes anyway (``top_k`` against the vocabulary,
``repeat_penalty``'s upper bound, a GBNF grammar, a JSON schema's features)
are left to it: its error names the field and becomes a 400.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model

from ..llm.profiles import MAX_SEED, MAX_STOP_STRINGS, RequestSettings
from .openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, IGNORED, FieldPolicy

__all__ = ["RequestModels", "request_models", "Message", "StreamOptions", "ResponseFormat", "JsonSchemaFormat"]

Stop = Optional[Union[str, list[str]]]
_LIBRARY_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RequestSettings)}


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Lenient):
    """One text part of an OpenAI message whose content is a list of parts."""

    type: Literal["text"]
    text: str


class Message(_Lenient):
    """An OpenAI chat message; ``developer`` is served as ``system``."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def plain(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


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

# Sampling options every POST route takes: (type, bounds, description); the library checks the rest.
_SAMPLING: dict[str, tuple[type, dict[str, float], str]] = {
    "top_k": (int, {"ge": 0}, "Keep the k most likely tokens; 0 is off; at most the vocabulary size."),
    "top_p": (float, {"ge": 0.0, "le": 1.0}, "Nucleus sampling; 1 is off."),
    "min_p": (float, {"ge": 0.0, "le": 1.0}, "Drop tokens below min_p times the top probability; 0 is off."),
    "repeat_penalty": (float, {"gt": 0.0}, "llama.cpp's repetition penalty; 1 is off."),
    "repeat_last_n": (int, {"ge": 0}, "Tokens the penalties look back over."),
    "presence_penalty": (float, {"ge": -2.0, "le": 2.0}, "Subtracted once from each token already generated."),
    "frequency_penalty": (float, {"ge": -2.0, "le": 2.0}, "Subtracted per occurrence of a generated token."),
}


def _sampling_fields(*, nullable: bool) -> dict[str, Any]:
    """The sampling fields: with the library's defaults (``/chat``), or nullable with null = default (OpenAI)."""
    out: dict[str, Any] = {}
    for name, (kind, bounds, text) in _SAMPLING.items():
        default = _LIBRARY_DEFAULTS[name]
        extra = {"allow_inf_nan": False} if kind is float else {}
        annotation = Optional[kind] if nullable else kind
        out[name] = (annotation, Field(None if nullable else default, description=f"{text} Default {default}.",
                                       **bounds, **extra))
    out["grammar"] = (Optional[str], Field(None, description="A GBNF grammar the output must match."))
    return out


def _ignored_fields(table: dict[str, FieldPolicy]) -> dict[str, Any]:
    """The fields a route accepts and ignores, of any type (they cannot change the output)."""
    return {p.name: (Optional[Any], Field(None, description=f"Accepted and ignored: {p.note}."))
            for p in table.values() if p.handling == IGNORED}


def _stop() -> Any:
    return Field(None, description=f"A stop string or up to {MAX_STOP_STRINGS}; generation ends before the first match.")


def _openai_config() -> ConfigDict:
    # Extra fields are parsed (and then refused by name with a 400); the schema says they are not accepted.
    return ConfigDict(strict=True, extra="allow", json_schema_extra={"additionalProperties": False})


class RequestModels:
    """The request bodies of one service, bounded by its limits."""

    def __init__(self, seed: type[BaseModel], chat: type[BaseModel], completion: type[BaseModel]) -> None:
        self.seed = seed
        self.chat = chat
        self.completion = completion


def request_models(*, max_tokens: int, max_rows: int) -> RequestModels:
    """Request models whose ``max_tokens`` is capped at ``max_tokens`` and ``messages`` at ``max_rows``."""
    return RequestModels(_seed_model(max_tokens), _chat_model(max_tokens, max_rows), _completion_model(max_tokens))


def _common_openai() -> dict[str, Any]:
    """Fields both OpenAI routes declare the same way."""
    return {
        "model": (Optional[str], Field(None, description="The served model's id (see /v1/models).")),
        "temperature": (Optional[float], Field(None, ge=0.0, le=2.0, allow_inf_nan=False,
                                               description="Default 1 (OpenAI's); 0 is greedy.")),
        "seed": (Optional[int], Field(None, ge=0, le=MAX_SEED,
                                      description="Default: a fresh random seed, returned as `seed`.")),
        "stop": (Stop, _stop()),
        "stream": (Optional[bool], Field(False)),
        "stream_options": (Optional[StreamOptions], Field(None)),
        **_sampling_fields(nullable=True),
    }


def _seed_model(cap: int) -> type[BaseModel]:
    return create_model(
        "ChatRequest",
        __base__=_Closed,
        __doc__="The seed route: one user prompt, formatted with the model's chat template. Every field but "
                "`prompt` is a library request option under its own name, with the library's default.",
        prompt=(str, Field(description="The user message.")),
        max_tokens=(int, Field(cap, ge=0, le=cap, description="Most tokens to generate (default: the cap).")),
        temperature=(float, Field(0.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0 is greedy.")),
        seed=(int, Field(0, ge=0, le=MAX_SEED)),
        stop=(Stop, _stop()),
        **_sampling_fields(nullable=False),
        json_schema=(Optional[dict[str, Any]], Field(None, description="A JSON schema the output must follow.")),
    )


def _chat_model(cap: int, rows: int) -> type[BaseModel]:
    return create_model(
        "ChatCompletionRequest",
        __config__=_openai_config(),
        __doc__="OpenAI `chat.completions.create`; docs/openai.md lists what each field does here.",
        messages=(list[Message], Field(min_length=1, max_length=rows)),
        max_tokens=(Optional[int], Field(None, ge=0, le=cap, description="Default: the service's cap.")),
        max_completion_tokens=(Optional[int], Field(None, ge=0, le=cap, description="Alias of max_tokens.")),
        response_format=(Optional[ResponseFormat], Field(None)),
        **_common_openai(),
        **_ignored_fields(CHAT_FIELDS),
    )


def _completion_model(cap: int) -> type[BaseModel]:
    return create_model(
        "CompletionRequest",
        __config__=_openai_config(),
        __doc__="OpenAI `completions.create` (legacy): raw text in, no chat template; docs/openai.md lists "
                "what each field does here.",
        prompt=(Union[str, list[str]], Field(description="The text to continue, as is (a list of one string).")),
        max_tokens=(Optional[int], Field(None, ge=0, le=cap, description=f"Default {min(16, cap)}.")),
        response_format=(Optional[ResponseFormat], Field(None, description="An extension: as on chat.")),
        **_common_openai(),
        **_ignored_fields(COMPLETION_FIELDS),
    )
