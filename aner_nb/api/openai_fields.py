"""What the OpenAI-compatible routes do with every request field: honour it, reject it, or ignore it.

One table per route (:data:`CHAT_FIELDS` for ``/v1/chat/completions``,
:data:`COMPLETION_FIELDS` for ``/v1/completions``) is the single declaration
behind:

- :func:`refuse_unsupported`, which answers a field the service cannot
  honour with 400 ``unsupported_parameter`` (OpenAI's error shape, ``param``
  naming the field) and a field OpenAI does not define with 400
  ``unknown_parameter``, as OpenAI itself refuses an unrecognised argument;
- the request models (``request_bodies``): every honoured, extension or
  ignored field is one of their fields, rejected ones are not;
- ``docs/openai.md``, whose tables list the same fields with the same
  handling (``tests/test_api_openai_fields.py`` compares them).

Only fields that cannot change the generated output are *ignored*
(``user``, ``metadata``, ``store``...). A rejected field is still served
when its value asks for nothing this service lacks (``n: 1``,
``logprobs: false``, ``echo: false``) or is ``null``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ApiError

__all__ = [
    "HONOURED", "EXTENSION", "IGNORED", "REJECTED", "FieldPolicy", "CHAT_FIELDS", "COMPLETION_FIELDS",
    "refuse_unsupported",
]

HONOURED = "honoured"  # OpenAI's field, served as OpenAI describes it
EXTENSION = "extension"  # not OpenAI's: a sampling option llama.cpp's server also accepts
IGNORED = "ignored"  # accepted; cannot change the output
REJECTED = "rejected"  # 400 unsupported_parameter unless its value is null or one of ``served``


@dataclass(frozen=True)
class FieldPolicy:
    """One request field of an OpenAI route: its handling and, for the docs, how or why."""

    name: str
    handling: str
    note: str
    served: tuple[Any, ...] = ()  # a rejected field's values that ask for nothing missing (n=1, echo=false)

    def refuses(self, value: Any) -> bool:
        """Whether ``value`` of this field asks for something the service cannot do."""
        if self.handling != REJECTED or value is None:
            return False
        # type-exact: ``true`` is not ``1`` and ``1.0`` is not ``1``
        return not any(type(value) is type(ok) and value == ok for ok in self.served)


def _table(*rows: FieldPolicy) -> dict[str, FieldPolicy]:
    return {row.name: row for row in rows}


# The rows both routes have.
_COMMON = (
    FieldPolicy("model", HONOURED, "a served model id (see `/v1/models`); with one served model any value"),
    FieldPolicy("temperature", HONOURED, "0..2; omitted means 1 (OpenAI's default); 0 is greedy (plain argmax)"),
    FieldPolicy("top_p", HONOURED, "0..1, default 1 (off): nucleus sampling on llama.cpp's sampler chain"),
    FieldPolicy("presence_penalty", HONOURED, "-2..2, default 0: subtracted once from every token already generated"),
    FieldPolicy("frequency_penalty", HONOURED, "-2..2, default 0: subtracted per occurrence of a generated token"),
    FieldPolicy("seed", HONOURED, "0..2**32-1; omitted: a fresh random seed. The seed used is returned as `seed`"),
    FieldPolicy("stop", HONOURED, "a string or up to 16; the text ends before the first match (not included)"),
    FieldPolicy("stream", HONOURED, "server-sent events, ending with `data: [DONE]`; `: keep-alive` comments "
                "while the request waits or prefills"),
    FieldPolicy("stream_options", HONOURED, "`include_usage: true` adds a last chunk with `choices: []` and "
                "`usage`; `include_obfuscation` is accepted and ignored (no padding is added)"),
    FieldPolicy("top_k", EXTENSION, "0..vocabulary size, default 0 (off): keep the k most likely tokens"),
    FieldPolicy("min_p", EXTENSION, "0..1, default 0 (off): drop tokens below min_p times the top probability"),
    FieldPolicy("repeat_penalty", EXTENSION, "> 0, default 1 (off): llama.cpp's repetition penalty"),
    FieldPolicy("repeat_last_n", EXTENSION, ">= 0, default 64: tokens the penalties look back over"),
    FieldPolicy("grammar", EXTENSION, "a GBNF grammar the output must match; not with `response_format` json"),
    FieldPolicy("n", REJECTED, "one choice per request; `1` is served", served=(1,)),
    FieldPolicy("logit_bias", REJECTED, "token biases are not applied; `{}` is served", served=({},)),
    FieldPolicy("user", IGNORED, "an end-user id for OpenAI's abuse monitoring"),
)

_RESPONSE_FORMAT = ("`{\"type\": \"text\"}`: unconstrained; `{\"type\": \"json_object\"}`: a JSON object; "
                    "`{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\", \"strict\"}}`: JSON valid "
                    "against `schema`, enforced by a grammar whatever `strict` says (`name` and `description` are "
                    "not shown to the model); an unsupported schema feature is a 400 naming it")

CHAT_FIELDS: dict[str, FieldPolicy] = _table(
    FieldPolicy("messages", HONOURED, "`system`, `developer` (as system), `user`, `assistant`; content a string "
                "or text parts; rendered with the model's chat template"),
    FieldPolicy("max_completion_tokens", HONOURED, "most tokens to generate; default: the service's output limit"),
    FieldPolicy("max_tokens", HONOURED, "alias of `max_completion_tokens` (this one wins when both are given)"),
    *_COMMON,
    FieldPolicy("response_format", HONOURED, _RESPONSE_FORMAT),
    FieldPolicy("logprobs", REJECTED, "log probabilities are not returned; `false` is served", served=(False,)),
    FieldPolicy("top_logprobs", REJECTED, "log probabilities are not returned; `0` is served", served=(0,)),
    FieldPolicy("modalities", REJECTED, "text only; `[\"text\"]` is served", served=(["text"],)),
    FieldPolicy("audio", REJECTED, "no audio output"),
    FieldPolicy("tools", REJECTED, "no tool calling"),
    FieldPolicy("tool_choice", REJECTED, "no tool calling; `\"none\"` is served", served=("none",)),
    FieldPolicy("parallel_tool_calls", REJECTED, "no tool calling"),
    FieldPolicy("functions", REJECTED, "no function calling (deprecated by OpenAI too)"),
    FieldPolicy("function_call", REJECTED, "no function calling; `\"none\"` is served", served=("none",)),
    FieldPolicy("prediction", REJECTED, "no predicted outputs"),
    FieldPolicy("reasoning_effort", REJECTED, "the served models have no reasoning mode"),
    FieldPolicy("verbosity", REJECTED, "no verbosity control"),
    FieldPolicy("web_search_options", REJECTED, "no web search"),
    FieldPolicy("moderation", REJECTED, "no moderation"),
    FieldPolicy("safety_identifier", IGNORED, "an end-user id for OpenAI's abuse monitoring"),
    FieldPolicy("metadata", IGNORED, "tags for OpenAI's stored completions"),
    FieldPolicy("store", IGNORED, "nothing is stored"),
    FieldPolicy("service_tier", IGNORED, "one tier; the answer does not echo it"),
    FieldPolicy("prompt_cache_key", IGNORED, "a cache routing hint; this service's prefix cache (if any) is its own"),
    FieldPolicy("prompt_cache_options", IGNORED, "a cache lifetime hint"),
    FieldPolicy("prompt_cache_retention", IGNORED, "a cache lifetime hint"),
)

COMPLETION_FIELDS: dict[str, FieldPolicy] = _table(
    FieldPolicy("prompt", HONOURED, "a string, or a list of exactly one string, evaluated as is (no chat "
                "template; the model's BOS rule applies); token-id prompts and several prompts are refused"),
    FieldPolicy("max_tokens", HONOURED, "most tokens to generate; default 16 (OpenAI's), at most the output limit"),
    *_COMMON,
    FieldPolicy("response_format", EXTENSION, "as on `/v1/chat/completions`"),
    FieldPolicy("echo", REJECTED, "the prompt is not echoed; `false` is served", served=(False,)),
    FieldPolicy("best_of", REJECTED, "one candidate per request; `1` is served", served=(1,)),
    FieldPolicy("logprobs", REJECTED, "log probabilities are not returned"),
    FieldPolicy("suffix", REJECTED, "no insertion (fill-in-the-middle)"),
)


def refuse_unsupported(given: Mapping[str, Any], table: Mapping[str, FieldPolicy], route: str) -> None:
    """Raise a 400 :class:`ApiError` for the first field of ``given`` that ``table`` rejects or does not know.

    ``given`` is what the client sent (the fields it set, with their values);
    ``route`` names the route in the message.
    """
    for name, value in given.items():
        policy = table.get(name)
        if policy is None:
            raise ApiError(400, f"unknown parameter {name!r}: {route} does not define it (see docs/openai.md)",
                           param=name, code="unknown_parameter")
        if policy.refuses(value):
            raise ApiError(400, f"{name} is not supported by this service ({policy.note})",
                           param=name, code="unsupported_parameter")
