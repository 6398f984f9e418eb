"""Request options, each declared once: what it is, its bounds, and which surfaces expose it.

A request option (``max_tokens``, ``temperature``, ``top_k``...) is one
:class:`Option` in :data:`REGISTRY`: its name, its type and default, its
bounds or check, one help text, and how the surfaces take it: the
``%%generate`` / ``%%chat`` flag (:class:`Flag`), the seed HTTP route
(``/chat``, under the option's own name) and the OpenAI routes' fields
(:class:`OpenAIField`, with the note ``docs/openai.md`` shows). Everything
else is derived from the registry, never written again by hand:

- the library's keyword validation and :class:`RequestSettings`, the frozen
  settings object the rest of ``llm/`` reads (``Registry.settings``; an
  unknown keyword is refused by name, a bad value raises
  :class:`~aner_nb.llm.errors.InvalidRequestError` with ``param``);
- ``requests.RequestOptions`` / ``REQUEST_OPTIONS`` / ``SAMPLING_OPTIONS``;
- the cell magics' flags, usage line and help (``magics/cells.py``);
- the HTTP request models and so the OpenAPI document
  (``api/request_bodies.py``), the OpenAI routes' field tables and
  ``docs/openai.md`` (``api/openai_fields.py``), the library options an HTTP
  body becomes (``api/calls.py``), and the output-limit bounds of
  ``api.app().output_limit()`` and ``aner-nb serve --max-tokens``.

OpenAI's ``n`` (several choices) is not a request option: the library answers
one choice per call, and the HTTP layer runs ``n`` calls with seeds ``seed + i``
(``api/choices.py``). Logprobs (``logprobs``, ``top_logprobs``,
``prompt_logprobs``) change no token, so they are not sampling options;
``logit_bias`` is (a greedy request with a bias leaves the plain-argmax path).

Every derived artefact is built by a function taking a registry, so a test
can declare a throwaway option in its own :class:`Registry` and find it
everywhere (``tests/test_options.py``). The ground floor of ``llm/``: this
module imports only ``errors``, ``constraints`` and ``tools`` (the checks of
the tool options, themselves pure).
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field, make_dataclass
from functools import cached_property
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Optional, Sequence, TypedDict, Union

from typing_extensions import NotRequired, TypedDict as WireDict  # pydantic reads these (HTTP bodies)

from .constraints import check_grammar_text, check_json_schema
from .tools import MAX_TEMPLATE_KWARGS, MAX_TOOLS, check_template_kwargs, check_tool_choice, check_tool_rules, check_tools
from .errors import ConfigurationError, InvalidRequestError, LLMError
from .valid_text import check_text

__all__ = [
    "MAX_CONTEXT", "MAX_TOKENS", "MAX_SEED", "MAX_STOP_STRINGS", "MAX_VOCAB", "MAX_REPEAT_PENALTY",
    "MAX_TOP_LOGPROBS", "MAX_LOGIT_BIAS", "MAX_BIAS",
    "CHAT_ROUTE", "COMPLETIONS_ROUTE", "OPENAI_ROUTES", "HONOURED", "EXTENSION",
    "LIBRARY", "RANDOM", "OUTPUT_LIMIT",
    "int_in", "number_in", "Flag", "OpenAIField", "Option", "Registry", "REGISTRY", "RequestSettings",
]

MAX_CONTEXT = 65536
MAX_TOKENS = 65536
MAX_SEED = 2**32 - 1
MAX_STOP_STRINGS = 16
MAX_VOCAB = 1 << 24  # top_k's static bound; the model's own vocabulary size is checked when a request is prepared
MAX_REPEAT_PENALTY = 10.0
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_LOGIT_BIAS = 1024  # entries of one logit_bias map
MAX_BIAS = 100.0  # |bias| bound, OpenAI's: -100 effectively bans a token, 100 forces it

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
OPENAI_ROUTES = (CHAT_ROUTE, COMPLETIONS_ROUTE)
HONOURED = "honoured"  # OpenAI's field, served as OpenAI describes it
EXTENSION = "extension"  # not OpenAI's: a sampling option llama.cpp's server also accepts


class _Default:
    """What an omitted (or null) OpenAI field means, when it is not a plain value."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


LIBRARY = _Default("the library's default")  # the option is not passed: the library's default applies
RANDOM = _Default("a fresh random value")  # a fresh value in the option's bounds (a seed), returned to the client
# The service's cap (``output_limit(max_tokens=...)``), lowered to what fits the context when the prompt leaves
# less room (``max_tokens_fit``): a client that leaves max_tokens out gets an answer, not a context error.
OUTPUT_LIMIT = _Default("the service's output limit, at most what fits the context")


# -- checks ----------------------------------------------------------------------------------
def int_in(name: str, value: Any, low: int, high: int, error: type[LLMError] = ConfigurationError) -> int:
    """``value`` if it is an int (not a bool) in ``low..high``, else ``error`` naming the field and range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an integer in {low}..{high}, got {value!r}", param=name)
    if not low <= value <= high:
        raise error(f"{name} must be in {low}..{high}, got {value}", param=name)
    return value


def number_in(name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> float:
    """``value`` as a float if it is a finite number in its range (``(low, high]`` when ``open_low``)."""
    span = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
    finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not finite or value < low or value > high or (open_low and value == low):
        raise InvalidRequestError(f"{name} must be a finite number in {span}, got {value!r}", param=name)
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be True or False, got {value!r}", param=name)
    return value


def _stop_strings(name: str, stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise InvalidRequestError(
            f"{name} must be None, a string or a list of strings, got {type(stop).__name__}", param=name
        )
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"{name} accepts at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param=name)
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise InvalidRequestError(f"{name}[{i}] must be a non-empty string, got {s!r}", param=f"{name}[{i}]")
    check_text(stop, name)
    return tuple(stop)


def _grammar(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise InvalidRequestError(f"{name} must be a non-empty GBNF string or None, got {value!r}", param=name)
    return value


def _schema(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, Mapping):
        raise InvalidRequestError(
            f"{name} must be a JSON schema object (a dict) or None, got {type(value).__name__}", param=name
        )
    return value


def _logit_bias(name: str, value: Any) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` as sorted ``(id, bias)`` pairs; ids may be digit strings (OpenAI's JSON keys).

    Ids are checked against the model's vocabulary when the request is prepared.
    """
    if value is None:
        return ()
    if isinstance(value, tuple):  # already normalised (a settings object rebuilt by dataclasses.replace)
        value = dict(value)
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            f"{name} must be a mapping of token id to bias, or None, got {type(value).__name__}", param=name
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"{name} accepts at most {MAX_LOGIT_BIAS} tokens, got {len(value)}", param=name)
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str) and key.strip().isdigit() and len(key.strip()) <= 12:  # no vocabulary is longer
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequestError(f"{name} keys must be token ids (integers >= 0), got {reprlib.repr(key)}",
                                      param=name)
        if token in pairs:
            raise InvalidRequestError(f"{name} names token {token} twice", param=name)
        pairs[token] = number_in(f"{name}[{key}]", bias, -MAX_BIAS, MAX_BIAS)
    return tuple(sorted(pairs.items()))


# -- the declaration -------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """How ``%%generate`` / ``%%chat`` take an option: ``--name-with-dashes METAVAR``.

    ``takes``: ``value`` (the text parsed as the option's type), ``repeat``
    (given once per item), ``variable`` (names a notebook variable holding a
    ``holds``), ``variable_or_json`` (such a variable, or inline JSON).
    ``help`` replaces the option's help in ``-h``.
    """

    metavar: str
    takes: str = "value"
    help: str = ""
    holds: Any = None  # the type a ``variable`` flag's variable must hold
    holding: str = ""  # its name in the usage error ("GBNF text")


@dataclass(frozen=True)
class OpenAIField:
    """One OpenAI-route field that carries an option.

    ``note`` is docs/openai.md's "how" (and the field's OpenAPI description);
    ``default`` is what an omitted or null field means (:data:`LIBRARY`,
    :data:`RANDOM`, :data:`OUTPUT_LIMIT` or a value); ``mapped`` fields are
    not the option's value as is: the HTTP layer converts them
    (``response_format`` becomes ``json_schema``) and declares their shape.
    Several fields of one option on a route are listed in priority order
    (the first one given wins).
    """

    name: str
    handling: str  # HONOURED or EXTENSION
    note: str
    routes: tuple[str, ...] = OPENAI_ROUTES
    default: Any = LIBRARY
    mapped: bool = False


@dataclass(frozen=True)
class Option:
    """One request option, declared once.

    ``type`` is the settings field's type, ``accepts`` the keyword's (what a
    caller may pass, normalised by ``check``), ``wire`` the type an HTTP body
    carries. Numbers are bounded by ``low``/``high`` (``open_low``: low is
    excluded); other types by ``check(name, value) -> value``. ``limits`` run
    after the registry's rules (the costly bounds of a grammar or a schema).
    ``sampling``: the option changes which token is chosen (a speculative
    lease accepts none). ``schema_high``: the HTTP schema states the upper
    bound (False where the library's own check, with the model's vocabulary,
    answers). ``service_cap``: the HTTP service's output limit caps it.
    """

    name: str
    type: Any
    default: Any
    help: str
    low: Optional[float] = None
    high: Optional[float] = None
    open_low: bool = False
    check: Optional[Callable[[str, Any], Any]] = None
    limits: Optional[Callable[[str, Any], Any]] = None
    accepts: Any = None
    wire: Any = None
    nullable: bool = False  # None is accepted (and means the default)
    sampling: bool = False
    flag: Optional[Flag] = None
    seed_route: bool = True  # the seed route (/chat) takes it under its own name
    openai: tuple[OpenAIField, ...] = ()
    schema_high: bool = True
    service_cap: bool = False

    def __post_init__(self) -> None:
        numeric = self.type in (int, float)
        if numeric != (self.low is not None and self.high is not None):
            raise ValueError(f"option {self.name}: int and float options need low and high, others neither")
        if not numeric and self.type is not bool and self.check is None:
            raise ValueError(f"option {self.name}: a {self.type!r} option needs a check")

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def keyword_type(self) -> Any:
        return self.type if self.accepts is None else self.accepts

    @property
    def wire_type(self) -> Any:
        return self.type if self.wire is None else self.wire

    @property
    def wire_default(self) -> Any:
        """The default an HTTP body shows: None for a nullable option (None means the default)."""
        return None if self.nullable else self.default

    @property
    def span(self) -> str:
        """The bounds as text: ``0..65536``, ``[0, 2]``, ``(0, 10]``; empty for other types."""
        if self.type is int:
            return f"{int(self.low)}..{int(self.high)}"  # type: ignore[arg-type]
        if self.type is float:
            return f"{'(' if self.open_low else '['}{self.low:g}, {self.high:g}]"
        return ""

    def validate(self, value: Any) -> Any:
        """The checked (normalised) value; InvalidRequestError with ``param`` otherwise."""
        if self.type is int:
            return int_in(self.name, value, int(self.low), int(self.high), InvalidRequestError)  # type: ignore[arg-type]
        if self.type is float:
            return number_in(self.name, value, self.low, self.high, open_low=self.open_low)  # type: ignore[arg-type]
        if self.check is not None:
            return self.check(self.name, value)
        return _bool(self.name, value)

    def fields_on(self, route: str) -> tuple[OpenAIField, ...]:
        """The OpenAI fields carrying this option on ``route``, in priority order."""
        return tuple(f for f in self.openai if route in f.routes)


Rule = Callable[[Mapping[str, Any]], None]


class Registry:
    """An ordered collection of request options and the rules between them; everything else derives from it."""

    def __init__(self, options: Iterable[Option], *, rules: Sequence[Rule] = (), base: type = object,
                 name: str = "RequestSettings", module: str = "aner_nb.llm.options", doc: str = "") -> None:
        self._options = {o.name: o for o in options}
        self.rules = tuple(rules)
        self._base, self._name, self._module, self._doc = base, name, module, doc

    def __iter__(self) -> Iterator[Option]:
        return iter(self._options.values())

    def __len__(self) -> int:
        return len(self._options)

    def __contains__(self, name: object) -> bool:
        return name in self._options

    def __getitem__(self, name: str) -> Option:
        return self._options[name]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._options)

    @property
    def sampling(self) -> tuple[str, ...]:
        """Options that change which token is chosen."""
        return tuple(o.name for o in self if o.sampling)

    def defaults(self) -> dict[str, Any]:
        return {o.name: o.default for o in self}

    def check(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Every option's checked value (``values`` has them all), then the rules, then the limits."""
        checked = {o.name: o.validate(values[o.name]) for o in self}
        for rule in self.rules:
            rule(checked)
        for o in self:
            if o.limits is not None and checked[o.name] is not None:
                o.limits(o.name, checked[o.name])
        return checked

    def refuse_unknown(self, options: Mapping[str, Any]) -> None:
        unknown = [name for name in options if name not in self._options]
        if unknown:
            name = sorted(unknown)[0]
            raise InvalidRequestError(
                f"unknown request option {name!r}; the options are {', '.join(self.names)}", param=name
            )

    @cached_property
    def settings(self) -> type:
        """The frozen settings class: one field per option (its type and default), checked on construction."""
        registry = self

        def __post_init__(self: Any) -> None:
            for name, value in registry.check({name: getattr(self, name) for name in registry.names}).items():
                object.__setattr__(self, name, value)  # frozen: normalised values (a stop tuple, floats)

        namespace = {"__post_init__": __post_init__, "__doc__": self._doc or None, "__module__": self._module}
        return make_dataclass(
            self._name, [(o.name, o.type, field(default=o.default)) for o in self], bases=(self._base,),
            namespace=namespace, frozen=True,
        )

    def settings_from(self, options: Mapping[str, Any]) -> Any:
        """The checked settings of one request's keyword options; an unknown option is refused by name."""
        self.refuse_unknown(options)
        return self.settings(**options)

    @cached_property
    def typed_dict(self) -> Any:
        """A ``TypedDict`` of the keyword options (every key optional), for ``**options`` annotations."""
        return TypedDict("RequestOptions", {o.name: o.keyword_type for o in self}, total=False)  # type: ignore[operator]


# -- the wire shapes of the tool options (what an HTTP body's schema states) ----------------------
class _FunctionSpec(WireDict):
    name: str
    description: NotRequired[str]
    parameters: NotRequired[dict[str, Any]]
    strict: NotRequired[bool]


class _ToolSpec(WireDict):
    type: Literal["function"]
    function: _FunctionSpec


class _FunctionName(WireDict):
    name: str


class _NamedToolChoice(WireDict):
    type: Literal["function"]
    function: _FunctionName


# -- the request options -----------------------------------------------------------------------
class RequestProperties:
    """What the engine asks of a request's settings, beyond its fields."""

    temperature: float
    repeat_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float
    grammar: "str | None"
    json_schema: Any
    logit_bias: "tuple[tuple[int, float], ...]"
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a repetition, presence or frequency penalty changes the logits."""
        return (
            (self.repeat_penalty != 1.0 and self.repeat_last_n > 0)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def constrained(self) -> bool:
        """A grammar, a schema, or a tool_choice that forces calls (its grammar is built from the tools)."""
        forced = bool(getattr(self, "tools", ())) and getattr(self, "tool_choice", "auto") not in ("auto", "none")
        return self.grammar is not None or self.json_schema is not None or forced

    @property
    def plain_argmax(self) -> bool:
        """Greedy with nothing that changes the logits: the argmax of the raw row, no sampler at all."""
        return self.greedy and not self.penalized and not self.constrained and not self.logit_bias


def _one_constraint(values: Mapping[str, Any]) -> None:
    if values["grammar"] is not None and values["json_schema"] is not None:
        raise InvalidRequestError("grammar and json_schema cannot be combined; pass one of them", param="grammar")


def _top_needs_logprobs(values: Mapping[str, Any]) -> None:
    if values["top_logprobs"] and not (values["logprobs"] or values["prompt_logprobs"]):
        raise InvalidRequestError("top_logprobs needs logprobs=True (as OpenAI requires)", param="top_logprobs")


def _tool_choice_needs_tools(values: Mapping[str, Any]) -> None:
    check_tool_rules(values["tools"], values["tool_choice"])
    if values["tools"] and values["tool_choice"] not in ("auto", "none") and (
            values["grammar"] is not None or values["json_schema"] is not None):
        raise InvalidRequestError("tool_choice 'required' or a named tool constrains the answer itself; it cannot be "
                                  "combined with grammar or json_schema", param="tool_choice")


def _grammar_limits(name: str, text: str) -> None:
    check_grammar_text(text, param=name)  # bounded before llama.cpp's recursive parser sees it


def _schema_limits(name: str, schema: Any) -> None:
    check_json_schema(schema, param=name)


_STOP_NOTE = f"a string or up to {MAX_STOP_STRINGS}; the text ends before the first match (not included)"
_GRAMMAR_NOTE = ("a GBNF grammar the output must match; not together with a JSON `response_format`; bounded (size, "
                 "nesting, rules, repetitions: README's rules table), over a bound it is a 400 with `param` `grammar` "
                 "(a schema's: `response_format`, also when its JSON nests too deep to parse)")

REGISTRY = Registry(
    [
        Option("max_tokens", int, 256, "most tokens to generate; 0 only checks the request", low=0, high=MAX_TOKENS,
               flag=Flag("N"), service_cap=True, openai=(
                   OpenAIField("max_tokens", HONOURED, "alias of `max_completion_tokens` (this one wins when both "
                               "are given)", routes=(CHAT_ROUTE,), default=OUTPUT_LIMIT),
                   OpenAIField("max_completion_tokens", HONOURED, "most tokens to generate; default: the service's "
                               "output limit", routes=(CHAT_ROUTE,), default=OUTPUT_LIMIT),
                   OpenAIField("max_tokens", HONOURED, "most tokens to generate; default 16 (OpenAI's), at most the "
                               "output limit", routes=(COMPLETIONS_ROUTE,), default=16),
               )),
        Option("temperature", float, 0.0, "sampling temperature; 0 is greedy (the plain argmax of the logits)",
               low=0.0, high=2.0, sampling=True, flag=Flag("T"), openai=(
                   OpenAIField("temperature", HONOURED, "0..2; omitted means 1 (OpenAI's default); 0 is greedy",
                               default=1.0),
               )),
        Option("seed", int, 0, "the sampler's seed: the same request with the same seed gives the same answer",
               low=0, high=MAX_SEED, flag=Flag("S"), openai=(
                   OpenAIField("seed", HONOURED, "0..2**32-1; omitted: a fresh random seed; the seed used is "
                               "returned as `seed`", default=RANDOM),
               )),
        Option("stop", tuple[str, ...], (), "a stop string or up to 16; generation ends before the first match",
               check=_stop_strings, accepts=Union[str, Sequence[str], None], wire=Optional[Union[str, list[str]]],
               nullable=True, flag=Flag("STR", takes="repeat", help="stop string (repeatable)"), openai=(
                   OpenAIField("stop", HONOURED, _STOP_NOTE),
               )),
        Option("top_k", int, 0, "keep the k most likely tokens; 0 is off; at most the vocabulary size",
               low=0, high=MAX_VOCAB, schema_high=False, sampling=True, flag=Flag("K"), openai=(
                   OpenAIField("top_k", EXTENSION, "0..vocabulary size, default 0 (off): keep the k most likely tokens"),
               )),
        Option("top_p", float, 1.0, "nucleus sampling; 1 is off", low=0.0, high=1.0, sampling=True, flag=Flag("P"),
               openai=(
                   OpenAIField("top_p", HONOURED, "0..1, default 1 (off): nucleus sampling on llama.cpp's sampler "
                               "chain"),
               )),
        Option("min_p", float, 0.0, "drop tokens below min_p times the top probability; 0 is off",
               low=0.0, high=1.0, sampling=True, flag=Flag("P"), openai=(
                   OpenAIField("min_p", EXTENSION, "0..1, default 0 (off): drop tokens below min_p times the top "
                               "probability"),
               )),
        Option("repeat_penalty", float, 1.0, "the repetition penalty of llama.cpp; 1 is off", low=0.0,
               high=MAX_REPEAT_PENALTY, open_low=True, schema_high=False, sampling=True, flag=Flag("X"), openai=(
                   OpenAIField("repeat_penalty", EXTENSION, "> 0, default 1 (off): llama.cpp's repetition penalty"),
               )),
        Option("repeat_last_n", int, 64, "tokens the penalties look back over", low=0, high=MAX_CONTEXT,
               schema_high=False, sampling=True, flag=Flag("N"), openai=(
                   OpenAIField("repeat_last_n", EXTENSION, ">= 0, default 64: tokens the penalties look back over"),
               )),
        Option("presence_penalty", float, 0.0, "subtracted once from each token already generated; 0 is off",
               low=-2.0, high=2.0, sampling=True, flag=Flag("X"), openai=(
                   OpenAIField("presence_penalty", HONOURED, "-2..2, default 0: subtracted once from every token "
                               "already generated"),
               )),
        Option("frequency_penalty", float, 0.0, "subtracted per occurrence of a generated token; 0 is off",
               low=-2.0, high=2.0, sampling=True, flag=Flag("X"), openai=(
                   OpenAIField("frequency_penalty", HONOURED, "-2..2, default 0: subtracted per occurrence of a "
                               "generated token"),
               )),
        Option("grammar", Optional[str], None, "a GBNF grammar the output must match", check=_grammar,
               limits=_grammar_limits, nullable=True, sampling=True,
               flag=Flag("VAR", takes="variable", holds=str, holding="GBNF text",
                         help="a variable holding a GBNF grammar the answer must match"),
               openai=(OpenAIField("grammar", EXTENSION, _GRAMMAR_NOTE),)),
        Option("json_schema", Any, None, "a JSON schema (a dict) the output must follow", check=_schema,
               limits=_schema_limits, accepts=Optional[Mapping[str, Any]], wire=Optional[dict[str, Any]],
               nullable=True, sampling=True,
               flag=Flag("VAR|JSON", takes="variable_or_json", holds=dict,
                         help="a JSON schema (inline JSON, or a variable holding a dict) the answer must validate "
                         "against"),
               openai=(
                   OpenAIField("response_format", HONOURED, "see Structured output", routes=(CHAT_ROUTE,),
                               mapped=True),
                   OpenAIField("response_format", EXTENSION, "as on chat (llama.cpp's server takes it here too)",
                               routes=(COMPLETIONS_ROUTE,), mapped=True),
               )),
        Option("logit_bias", tuple[tuple[int, float], ...], (), "{token id: bias} added to the logits before "
               f"sampling (at most {MAX_LOGIT_BIAS} ids, biases -100..100; -100 effectively bans a token); a greedy "
               "request with a bias samples the biased row's argmax", check=_logit_bias,
               accepts=Optional[Mapping[Union[int, str], float]], wire=Optional[dict[str, float]], nullable=True,
               sampling=True, openai=(
                   OpenAIField("logit_bias", HONOURED, f"`{{\"token id\": bias}}`, at most {MAX_LOGIT_BIAS} ids of "
                               "the model's vocabulary, biases -100..100 added to the logits before sampling (-100 "
                               "bans a token); a 400 with `param` `logit_bias` otherwise"),
               )),
        Option("logprobs", bool, False, "record each generated token's log probability (the log-softmax of the raw "
               "logits, before any sampling stage) in Response.logprobs", seed_route=False, openai=(
                   OpenAIField("logprobs", HONOURED, "`true` returns `choices[i].logprobs.content`: each token's "
                               "logprob, from the model's raw logits before `logit_bias` and every sampling stage, "
                               "streamed with each chunk too", routes=(CHAT_ROUTE,)),
                   OpenAIField("logprobs", HONOURED, f"0..{MAX_TOP_LOGPROBS}: the legacy `logprobs` object "
                               "(`tokens`, `token_logprobs`, `top_logprobs` with this many alternatives, "
                               "`text_offset`), streamed with each chunk too", routes=(COMPLETIONS_ROUTE,),
                               mapped=True),
               )),
        Option("top_logprobs", int, 0, "with logprobs: the most likely alternatives recorded at each position",
               low=0, high=MAX_TOP_LOGPROBS, seed_route=False, openai=(
                   OpenAIField("top_logprobs", HONOURED, f"0..{MAX_TOP_LOGPROBS} alternatives per token "
                               "(needs `logprobs: true`)", routes=(CHAT_ROUTE,)),
               )),
        Option("prompt_logprobs", bool, False, "record the logprob of every prompt token after the first "
               "(Response.prompt_logprobs; the prompt is evaluated with logits on every position, no prefix reuse); "
               "with max_tokens=0 the prompt is scored and nothing generated", seed_route=False),
        Option("allow_special_tokens", bool, False, "message content may hold control tokens such as the "
               "template's turn markers (trusted callers only)", seed_route=False),
        Option("max_tokens_fit", bool, False, "when prompt plus max_tokens does not fit the context, generate "
               "at most what fits (finish reason 'length') instead of refusing; what OpenAI-compatible servers do "
               "for a request that leaves max_tokens out (the HTTP service sets it then)", seed_route=False),
        # Tools are part of a chat request's input (like its messages) but declared here once, so every surface
        # takes them the same way; tool_choice and parallel_tool_calls say what the answer may do with them.
        Option("tools", tuple, (), f"function tools the model may call (OpenAI's shape, at most {MAX_TOOLS}); "
               "rendered by the chat template when it handles tools, else by a generic system block; calls come "
               "back in Response.tool_calls", check=check_tools, accepts=Optional[Sequence[Mapping[str, Any]]],
               wire=Optional[list[_ToolSpec]], nullable=True, seed_route=False, openai=(
                   OpenAIField("tools", HONOURED, f"function tools (at most {MAX_TOOLS}; names "
                               "`^[a-zA-Z0-9_-]{1,64}$`, parameters a bounded JSON schema), rendered by the model's "
                               "chat template when it handles `tools`, else by a generic system block; calls are "
                               "returned in `message.tool_calls` (streamed as `delta.tool_calls`) with "
                               "`finish_reason` `tool_calls`", routes=(CHAT_ROUTE,)),
               )),
        Option("tool_choice", Any, "auto", "'auto' (the model decides; calls are parsed from its family's format), "
               "'none' (no tools shown, no calls), 'required' or {'type': 'function', 'function': {'name': ...}} "
               "(the answer is constrained by a grammar to calls whose arguments follow the tools' schemas)",
               check=check_tool_choice, accepts=Union[str, Mapping[str, Any], None],
               wire=Optional[Union[Literal["none", "auto", "required"], _NamedToolChoice]], nullable=True, sampling=True,
               seed_route=False, openai=(
                   OpenAIField("tool_choice", HONOURED, "`auto` (default), `none` (tools not shown), `required` or "
                               "a named function: with the last two the answer is constrained by a grammar to calls "
                               "whose arguments validate against the tool's schema", routes=(CHAT_ROUTE,)),
               )),
        Option("parallel_tool_calls", bool, True, "a constrained answer (tool_choice 'required' or named) may make "
               "several calls (up to 8); False: exactly one", seed_route=False, openai=(
                   OpenAIField("parallel_tool_calls", HONOURED, "default true: a constrained answer may make up to 8 "
                               "calls; `false`: exactly one", routes=(CHAT_ROUTE,)),
               )),
        Option("chat_template_kwargs", tuple, (), f"extra chat-template variables (at most {MAX_TEMPLATE_KWARGS}, "
               "JSON scalars), e.g. {'enable_thinking': False}", check=check_template_kwargs,
               accepts=Optional[Mapping[str, Any]], wire=Optional[dict[str, Union[str, int, float, bool, None]]],
               nullable=True, flag=Flag("VAR|JSON", takes="variable_or_json", holds=dict,
                         help="extra chat-template variables (inline JSON, or a variable holding a dict), e.g. "
                         "'{\"enable_thinking\": false}'"),
               openai=(
                   OpenAIField("chat_template_kwargs", EXTENSION, f"at most {MAX_TEMPLATE_KWARGS} variables (JSON "
                               "scalars) passed to the chat template, e.g. `{\"enable_thinking\": false}` "
                               "(llama.cpp's server and vLLM take it too); reasoning between the model's thinking "
                               "markers is returned as `message.reasoning_content` (streamed as "
                               "`delta.reasoning_content`)", routes=(CHAT_ROUTE,)),
               )),
    ],
    rules=[_one_constraint, _top_needs_logprobs, _tool_choice_needs_tools],
    base=RequestProperties,
    doc="""Per-request sampling settings, validated on construction (fields: :data:`REGISTRY`).

    Defaults change nothing: ``temperature=0`` is plain greedy (the argmax of
    the logits), ``top_k=0``, ``top_p=1``, ``min_p=0`` and neutral penalties
    leave the distribution as the model gives it. ``grammar`` (GBNF) or
    ``json_schema`` constrain the output; at most one of them.
    """,
)

RequestSettings = REGISTRY.settings
