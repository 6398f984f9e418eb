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
- ``docs/openai.md``, whose tables are generated from them
  (``python -m aner_nb.api.openai_fields --write docs/openai.md``;
  ``--check`` fails when the committed file is stale).

The rows of fields that carry a library request option (``temperature``,
``top_k``, ``max_completion_tokens``, ``response_format``...) come from the
option's declaration (:mod:`aner_nb.llm.options`, its ``OpenAIField`` entries);
the rows here are the rest: the prompt, ``model``, streaming, and every
field that is rejected or ignored. Only fields that cannot change the
generated output are *ignored* (``user``, ``metadata``, ``store``...). A
rejected field is still served when its value asks for nothing this service
lacks (``best_of: 1``, ``function_call: "none"``) or is ``null``.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..llm.options import CHAT_ROUTE, COMPLETIONS_ROUTE, EXTENSION, HONOURED, OPENAI_ROUTES, REGISTRY, Registry
from ..llm.embeddings import MAX_INPUTS
from .errors import ApiError

__all__ = [
    "HONOURED", "EXTENSION", "IGNORED", "REJECTED", "FieldPolicy", "CHAT_FIELDS", "COMPLETION_FIELDS",
    "route_fields", "refuse_unsupported", "IGNORED_FIELDS_HEADER", "ignored_fields_header", "field_table",
    "render_doc", "MAX_CHOICES",
    "EMBEDDINGS_ROUTE", "EMBEDDING_FIELDS", "embedding_field_table", "render_embeddings_doc",
]

IGNORED = "ignored"  # accepted; cannot change the output
REJECTED = "rejected"  # 400 unsupported_parameter unless its value is null or one of ``served``
_ORDER = (HONOURED, EXTENSION, REJECTED, IGNORED)


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


_MODEL = FieldPolicy("model", HONOURED, "a served model id (see `/v1/models`); with one served model any value")
MAX_CHOICES = 16  # the most choices (``n``) one request may ask for
_N = FieldPolicy("n", HONOURED, f"1..{MAX_CHOICES} choices; generated concurrently on a batching lease (each takes "
                 "a slot of its capacity), one after another otherwise; choice `i` samples with seed `seed + i` (mod "
                 "2**32), so seeded choices are reproducible one by one and greedy choices are identical; `usage` "
                 "counts the prompt once and every choice's completion tokens; streamed chunks carry their "
                 "choice's `index`")
_USER = FieldPolicy("user", IGNORED, "an end-user id for OpenAI's abuse monitoring")
_STREAM_OPTIONS = ("`include_usage: true` adds the usage chunk; `include_obfuscation` is accepted and ignored "
                   "(no padding is added)")

# The fields that carry no library option, per route (option fields are added from the registry).
_OTHER_FIELDS: dict[str, tuple[FieldPolicy, ...]] = {
    CHAT_ROUTE: (
        FieldPolicy("messages", HONOURED, "`system`, `developer` (as system), `user`, `assistant` (with "
                    "`tool_calls`, content then may be null), `tool` (with `tool_call_id`); content a string or text "
                    "parts; rendered with the model's chat template; message and tool-result text never becomes "
                    "control tokens"),
        _MODEL,
        FieldPolicy("stream", HONOURED, "server-sent events (see Streaming)"),
        FieldPolicy("stream_options", HONOURED, _STREAM_OPTIONS),
        _N,
        FieldPolicy("modalities", REJECTED, "text only; `[\"text\"]` is served", served=(["text"],)),
        FieldPolicy("audio", REJECTED, "no audio output"),
        FieldPolicy("functions", REJECTED, "no function calling (deprecated by OpenAI too)"),
        FieldPolicy("function_call", REJECTED, "no function calling; `\"none\"` is served", served=("none",)),
        FieldPolicy("prediction", REJECTED, "no predicted outputs"),
        FieldPolicy("reasoning_effort", REJECTED, "no effort levels; a reasoning model's thinking is switched by "
                    "its template's variables (`chat_template_kwargs`, e.g. `enable_thinking`)"),
        FieldPolicy("verbosity", REJECTED, "no verbosity control"),
        FieldPolicy("web_search_options", REJECTED, "no web search"),
        FieldPolicy("moderation", REJECTED, "no moderation"),
        _USER,
        FieldPolicy("safety_identifier", IGNORED, "an end-user id for OpenAI's abuse monitoring"),
        FieldPolicy("metadata", IGNORED, "tags for OpenAI's stored completions"),
        FieldPolicy("store", IGNORED, "nothing is stored"),
        FieldPolicy("service_tier", IGNORED, "one tier"),
        FieldPolicy("prompt_cache_key", IGNORED, "a cache routing hint; the service's prefix cache (if any) is its own"),
        FieldPolicy("prompt_cache_options", IGNORED, "a cache lifetime hint"),
        FieldPolicy("prompt_cache_retention", IGNORED, "a cache lifetime hint"),
    ),
    COMPLETIONS_ROUTE: (
        FieldPolicy("prompt", HONOURED, "a string, or a list of exactly one string; token-id prompts are 422, "
                    "several prompts 400 `unsupported_parameter`"),
        _MODEL,
        FieldPolicy("stream", HONOURED, "server-sent `text_completion` chunks (see Streaming)"),
        FieldPolicy("stream_options", HONOURED, _STREAM_OPTIONS),
        FieldPolicy("echo", HONOURED, "`true` puts the prompt before the answer's text; with `logprobs` also "
                    "the prompt tokens' logprobs (the first one `null`), so `max_tokens: 0` scores a text "
                    "(lm-eval's loglikelihood); prompt logprobs are not served by a batching lease (400 `param` `echo`)"),
        _N,
        FieldPolicy("best_of", REJECTED, "one candidate per request; `1` is served", served=(1,)),
        FieldPolicy("suffix", REJECTED, "no insertion (fill-in-the-middle)"),
        _USER,
    ),
}


def route_fields(route: str, registry: Registry = REGISTRY) -> dict[str, FieldPolicy]:
    """Every field of an OpenAI route, grouped honoured, extension, rejected, ignored (the docs' order)."""
    others = _OTHER_FIELDS[route]
    rows = [*others[:2]]  # the prompt and model lead
    rows += [FieldPolicy(f.name, f.handling, f.note) for option in registry for f in option.fields_on(route)]
    rows += others[2:]
    table: dict[str, FieldPolicy] = {}
    for row in sorted(rows, key=lambda r: _ORDER.index(r.handling)):
        if row.name in table:
            raise ValueError(f"{route}: field {row.name!r} is declared twice")
        table[row.name] = row
    return table


CHAT_FIELDS: dict[str, FieldPolicy] = route_fields(CHAT_ROUTE)
COMPLETION_FIELDS: dict[str, FieldPolicy] = route_fields(COMPLETIONS_ROUTE)

# /v1/embeddings carries no library request option, so its table is declared whole here (``api.embeddings``
# serves it; its request model has exactly these fields).
EMBEDDINGS_ROUTE = "/v1/embeddings"
EMBEDDING_FIELDS: dict[str, FieldPolicy] = {p.name: p for p in (
    FieldPolicy("input", HONOURED, "a string, a list of strings, a list of token ids or a list of such lists "
                f"(at most {MAX_INPUTS}); each input must fit the model's context (nothing is truncated)"),
    _MODEL,
    FieldPolicy("encoding_format", HONOURED, "`float` (default) or `base64` (little-endian float32, what the "
                "`openai` SDK asks for)"),
    FieldPolicy("dimensions", REJECTED, "vectors are not shortened; the model's own width (`n_embd`) is served"),
    _USER,
)}


IGNORED_FIELDS_HEADER = "X-Aner-Ignored-Fields"  # lenient fields: the unknown fields an answer ignored
MAX_LISTED_FIELDS = 20
_LISTABLE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def ignored_fields_header(names: Sequence[str]) -> str:
    """The header's value for the unknown fields a lenient service ignored: names a client wrote, so only
    plain ones (letters, digits, ``_.-``, at most 64) and at most :data:`MAX_LISTED_FIELDS` of them are
    listed; the rest are counted (``+3 more``). A raw name could break the response head (a CR, LF or NUL),
    be no latin-1 (a 500), or make the head hundreds of kilobytes."""
    listed = [n for n in names if _LISTABLE.fullmatch(n)][:MAX_LISTED_FIELDS]
    rest = len(names) - len(listed)
    return ",".join(listed + ([f"+{rest} more"] if rest else []))


def refuse_unsupported(given: Mapping[str, Any], table: Mapping[str, FieldPolicy], route: str,
                       *, lenient: bool = False) -> tuple[str, ...]:
    """Raise a 400 :class:`ApiError` for the first field of ``given`` that ``table`` rejects or does not know.

    ``given`` is what the client sent (the fields it set, with their values);
    ``route`` names the route in the message. With ``lenient`` an unknown
    field is not an error: the unknown names are returned (sorted) instead.
    """
    ignored = []
    for name, value in given.items():
        policy = table.get(name)
        if policy is None:
            if lenient:
                ignored.append(name)
                continue
            raise ApiError(400, f"unknown parameter {name!r}: {route} does not define it (see docs/openai.md)",
                           param=name, code="unknown_parameter")
        if policy.refuses(value):
            raise ApiError(400, f"{name} is not supported by this service ({policy.note})",
                           param=name, code="unsupported_parameter")
    return tuple(sorted(ignored))


# -- docs/openai.md -----------------------------------------------------------------------------------------
_BEGIN = "<!-- fields {route}: generated by python -m aner_nb.api.openai_fields --write docs/openai.md -->"
_END = "<!-- end fields -->"


def field_table(route: str, registry: Registry = REGISTRY) -> str:
    """The markdown table of a route's fields; a row the chat route has with the same note says "as on chat"."""
    chat = route_fields(CHAT_ROUTE, registry)
    lines = ["| field | handling | how |", "|---|---|---|"]
    for row in route_fields(route, registry).values():
        same = route != CHAT_ROUTE and row.name in chat and chat[row.name].note == row.note
        lines.append(f"| `{row.name}` | {row.handling} | {'as on chat' if same else row.note} |")
    return "\n".join(lines)


def render_doc(text: str, registry: Registry = REGISTRY, routes: Sequence[str] = OPENAI_ROUTES) -> str:
    """``text`` (docs/openai.md) with each route's marked table region replaced by its generated table."""
    for route in routes:
        begin = _BEGIN.format(route=route)
        pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(_END), re.S)
        if not pattern.search(text):
            raise ValueError(f"no generated-table region for {route} (a line {begin!r} ... {_END!r})")
        text = pattern.sub(lambda _: f"{begin}\n{field_table(route, registry)}\n{_END}", text, count=1)
    return text


def embedding_field_table() -> str:
    """The markdown table of ``/v1/embeddings``' fields."""
    lines = ["| field | handling | how |", "|---|---|---|"]
    lines += [f"| `{p.name}` | {p.handling} | {p.note} |" for p in EMBEDDING_FIELDS.values()]
    return "\n".join(lines)


def render_embeddings_doc(text: str) -> str:
    """``text`` (docs/openai.md) with the ``/v1/embeddings`` table region replaced by :func:`embedding_field_table`."""
    begin = _BEGIN.format(route=EMBEDDINGS_ROUTE)
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no generated-table region for {EMBEDDINGS_ROUTE} (a line {begin!r} ... {_END!r})")
    return pattern.sub(lambda _: f"{begin}\n{embedding_field_table()}\n{_END}", text, count=1)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aner_nb.api.openai_fields",
                                description="Regenerate (or check) the field tables of docs/openai.md.")
    p.add_argument("doc", nargs="?", default=str(Path(__file__).resolve().parents[2] / "docs" / "openai.md"))
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the tables in place")
    mode.add_argument("--check", action="store_true", help="exit 1 when the tables are stale")
    args = p.parse_args(argv)
    path = Path(args.doc)
    old = path.read_text(encoding="utf-8")
    new = render_embeddings_doc(render_doc(old))
    if args.check:
        if new != old:
            print(f"{path}: the field tables are stale; run python -m aner_nb.api.openai_fields --write {path}",
                  file=sys.stderr)
            return 1
        return 0
    if new != old:
        path.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
