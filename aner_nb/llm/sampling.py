"""Sampling policy: which llama.cpp sampler chain a request needs, and which constraints it can have.

Pure decisions over a request's settings; the chain itself is built at the
engine edge (:class:`aner_nb.llm._engine.Sampler`). A request whose settings
change nothing about the logits and that samples greedily needs no sampler
at all: the decode loop takes the argmax of the raw logits row (llama.cpp's
greedy tie-break), which is what speculative verification and batching rely
on for output identity.

Structured output: a ``json_schema`` becomes a GBNF grammar through
llama-cpp-python's port of llama.cpp's converter. The converter silently
ignores JSON-schema keywords it cannot express, which would hand back output
that does not validate; :func:`unsupported_schema_keywords` refuses those
keywords first, by path, so a request gets a clear error instead.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Mapping, Sequence

from ._engine import GrammarError, NativeModel, Sampler, SamplerChain, check_grammar, json_schema_grammar
from .constraints import check_grammar_text
from .errors import InvalidRequestError
from .profiles import RequestSettings
from .tools import Tool, call_grammar, call_schema

__all__ = [
    "UNSUPPORTED_SCHEMA_KEYWORDS",
    "sampler_chain",
    "new_sampler",
    "unsupported_schema_keywords",
    "request_grammar",
    "tool_grammar",
]

# JSON-schema keywords the grammar converter cannot enforce (it would drop them without a word).
UNSUPPORTED_SCHEMA_KEYWORDS = (
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "patternProperties",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems", "contains", "minContains", "maxContains",
    "uniqueItems", "multipleOf", "minProperties", "maxProperties", "$dynamicRef", "$recursiveRef",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
)
# String formats the converter turns into grammar rules; any other ``format`` would be ignored.
SUPPORTED_FORMATS = ("date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5")
# Keywords whose value is itself a schema, or a list or map of schemas, to walk into.
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def sampler_chain(request: RequestSettings, grammar: str | None) -> SamplerChain | None:
    """The chain a request samples with, or None when the plain argmax of the logits is exact."""
    if request.plain_argmax:  # greedy, no penalty, no grammar or schema, no logit bias
        return None
    penalized = request.penalized
    return SamplerChain(
        temperature=request.temperature,
        seed=request.seed,
        top_k=request.top_k,
        top_p=request.top_p,
        min_p=request.min_p,
        grammar=grammar,
        penalty_last_n=request.repeat_last_n if penalized else 0,
        penalty_repeat=request.repeat_penalty,
        penalty_freq=request.frequency_penalty,
        penalty_present=request.presence_penalty,
        logit_bias=request.logit_bias,
    )


def new_sampler(model: NativeModel, request: RequestSettings, grammar: str | None, prompt: Sequence[int]) -> Sampler | None:
    """The engine sampler for one request (None: plain argmax); the prompt seeds the penalties' history."""
    spec = sampler_chain(request, grammar)
    return None if spec is None else Sampler(model, spec, prompt)


def _walk(schema: Any, path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    if not isinstance(schema, Mapping):
        return
    yield path, schema
    for key in _SUBSCHEMA:
        yield from _walk(schema.get(key), f"{path}/{key}")
    for key in _SUBSCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _walk(sub, f"{path}/{key}/{i}")
    for key in _SUBSCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, Mapping):
            for name, sub in value.items():
                yield from _walk(sub, f"{path}/{key}/{name}")


def unsupported_schema_keywords(schema: Mapping[str, Any]) -> list[str]:
    """``"<keyword> at <JSON pointer>"`` for every keyword the grammar could not enforce."""
    found = []
    for path, node in _walk(schema, ""):
        found += [f"{k} at {path or '/'}" for k in UNSUPPORTED_SCHEMA_KEYWORDS if k in node]
        if isinstance(node.get("items"), list):
            found.append(f"items as a list at {path or '/'} (use prefixItems)")
        if "format" in node and node["format"] not in SUPPORTED_FORMATS:
            found.append(f"format {node['format']!r} at {path or '/'} (supported: {', '.join(SUPPORTED_FORMATS)})")
    return found


def request_grammar(model: NativeModel, request: RequestSettings) -> str | None:
    """The GBNF a request's output must match (from ``grammar`` or ``json_schema``), checked by llama.cpp."""
    if request.json_schema is not None:
        bad = unsupported_schema_keywords(request.json_schema)
        if bad:
            raise InvalidRequestError(
                f"json_schema uses what constrained decoding cannot enforce: {', '.join(bad)}", param="json_schema"
            )
        try:
            grammar = json_schema_grammar(json.dumps(request.json_schema))
        except (GrammarError, TypeError, ValueError, RecursionError) as exc:  # TypeError/ValueError: not JSON
            raise InvalidRequestError(f"json_schema is not usable: {exc}", param="json_schema") from None
        param = "json_schema"
        check_grammar_text(grammar, param=param)  # the converter's output is bounded like any grammar
    elif request.grammar is not None:
        grammar, param = request.grammar, "grammar"
    else:
        return None
    try:
        check_grammar(model, grammar)
    except GrammarError as exc:
        raise InvalidRequestError(f"{param}: {exc}", param=param) from None
    return grammar


def tool_grammar(model: NativeModel, tools: "Sequence[Tool]", fmt: str, *, parallel: bool) -> str:
    """The GBNF of an answer that must call one of ``tools`` (``tool_choice`` required or named) in the
    family's format ``fmt``, its arguments following the tool's parameters schema."""
    for i, tool in enumerate(tools):
        bad = unsupported_schema_keywords(tool.parameters)
        if bad:
            raise InvalidRequestError(
                f"tools[{i}].function.parameters uses what constrained decoding cannot enforce ({', '.join(bad)}); "
                "use tool_choice='auto' for this tool", param=f"tools[{i}].function.parameters"
            )
    try:
        rules = json_schema_grammar(json.dumps(call_schema(tools, fmt)))
    except (GrammarError, TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"tools: the parameters schemas are not usable: {exc}", param="tools") from None
    grammar = call_grammar(rules, fmt, parallel=parallel)
    check_grammar_text(grammar, param="tools")
    try:
        check_grammar(model, grammar)
    except GrammarError as exc:
        raise InvalidRequestError(f"tools: {exc}", param="tools") from None
    return grammar
