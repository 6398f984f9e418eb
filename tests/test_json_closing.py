"""The closer of a cut JSON answer: every prefix a schema grammar allows, closed, parses and validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aner_nb.llm.json_closing import MAX_CLOSING_CHARS, JsonCloser, minimal_json

CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "country": {"type": "string", "minLength": 2},
        "population": {"type": "integer", "minimum": 1},
        "climate": {"type": "array", "items": {"type": "string", "enum": ["hot", "cold", "temperate", "dry"]}},
        "coastal": {"type": "boolean"},
        "founded": {"type": "string", "format": "date"},
    },
    "required": ["name", "country", "population", "climate"],
}

NESTED = {
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                        "required": ["x", "y"]}},
    "type": "object",
    "properties": {
        "label": {"enum": ["a", "bb", "ccc", 7, None]},
        "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 2},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "tags": {"type": ["array", "null"], "items": {"type": "string"}},
        "kind": {"const": "shape"},
    },
    "required": ["label", "points", "kind"],
}


def grammar_order(schema: dict, doc: dict) -> list[str]:
    """The document's keys in the order llama.cpp's schema grammar emits them: required, then optional."""
    props = list(schema["properties"])
    required = [k for k in props if k in schema.get("required", [])]
    return [k for k in required if k in doc] + [k for k in props if k not in required and k in doc]


def serialise(schema: dict, doc, space: str = "") -> str:
    if isinstance(doc, dict) and isinstance(schema, dict) and "properties" in schema:
        items = [json.dumps(k, ensure_ascii=False) + ":" + space + serialise(schema["properties"][k], doc[k], space)
                 for k in grammar_order(schema, doc)]
        return "{" + space + ("," + space).join(items) + space + "}"
    if isinstance(doc, list):
        item_schema = schema.get("items", {}) if isinstance(schema, dict) else {}
        if "$ref" in item_schema:
            item_schema = NESTED["$defs"]["point"]
        return "[" + ("," + space).join(serialise(item_schema, v, space) for v in doc) + "]"
    return json.dumps(doc, ensure_ascii=False)


def closes_every_prefix(schema: dict, text: str) -> int:
    """Close each prefix of ``text``; return how many prefixes got a closing (each one checked)."""
    closed = 0
    validator = jsonschema.Draft202012Validator(schema)
    closer = JsonCloser(schema)  # fed one character at a time, as generated pieces arrive
    for cut in range(len(text) + 1):
        if cut:
            closer.feed(text[cut - 1])
        assert closer.text == text[:cut]
        ending = closer.closing()
        if ending is None:
            continue
        whole = text[:cut] + ending
        try:
            value = json.loads(whole)
        except ValueError as exc:
            raise AssertionError(f"{text[:cut]!r} + {ending!r} does not parse: {exc}") from None
        validator.validate(value)
        closed += 1
    return closed


def test_a_finished_answer_needs_no_closing_and_an_empty_one_the_minimal_value():
    doc = {"name": "Paris", "country": "FR", "population": 2100000, "climate": ["temperate"]}
    closer = JsonCloser(CITY)
    closer.feed(serialise(CITY, doc))
    assert closer.closing() == ""
    empty = JsonCloser(CITY).closing()
    jsonschema.validate(json.loads(empty), CITY)
    assert empty == minimal_json(CITY) == '{"name":"","country":"aa","population":1,"climate":[]}'


@pytest.mark.parametrize("space", ["", " "])
def test_every_prefix_of_a_city_closes_into_a_valid_city(space):
    doc = {"name": 'Saint "Louis"\\ \u00e9\u4e16', "country": "US", "population": -0 + 300000,
           "climate": ["hot", "dry", "hot"], "coastal": False, "founded": "1764-02-14"}
    text = serialise(CITY, doc, space)
    closed = closes_every_prefix(CITY, text)
    founded_value = len(json.dumps(doc["founded"]))
    assert closed >= len(text) + 1 - founded_value  # only a begun date string has no derivable end


def test_every_prefix_of_nested_refs_enums_and_unions_closes_validly():
    doc = {"label": "ccc", "points": [{"x": -1.5e3, "y": 2}, {"x": 0.25, "y": -7}, {"x": 1, "y": 1}],
           "kind": "shape", "note": "a\\nb", "tags": ["x", "y"]}
    text = serialise(NESTED, doc)
    assert closes_every_prefix(NESTED, text) == len(text) + 1


@pytest.mark.parametrize("schema", [
    {"type": "string", "format": "date-time"}, {"type": "string", "format": "uuid"},
    {"type": "integer", "minimum": 5, "maximum": 9}, {"type": "number", "exclusiveMinimum": 0},
    {"type": "integer", "maximum": -3}, {"type": "array", "items": {"type": "boolean"}, "minItems": 3},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/b"}}, "required": ["a"],
     "$defs": {"b": {"type": "array", "items": {"const": 1}, "minItems": 1}}},
    {"anyOf": [{"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}, {"type": "null"}]},
    {"type": ["integer", "string"]}, {"enum": ["long value", "s"]},
])
def test_minimal_values_validate(schema):
    text = minimal_json(schema)
    assert text is not None
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_a_pattern_string_already_begun_has_no_closing_and_one_not_begun_is_refused_up_front():
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
              "required": ["code"]}
    assert minimal_json(schema) is None  # no derivable value: the answer is cut as before
    closer = JsonCloser(schema)
    closer.feed('{"code":"AB')
    assert closer.closing() is None


def test_text_no_grammar_would_allow_is_never_closed():
    closer = JsonCloser(CITY)
    closer.feed('{"name":"x"} trailing')
    assert closer.closing() is None


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@settings(max_examples=60, deadline=None)
@given(
    name=_text, country=st.text(min_size=2, max_size=6), population=st.integers(1, 10**12),
    climate=st.lists(st.sampled_from(["hot", "cold", "temperate", "dry"]), max_size=5),
    coastal=st.none() | st.booleans(), space=st.sampled_from(["", " ", "\n  "]),
)
def test_any_city_cut_anywhere_closes_into_a_valid_city(name, country, population, climate, coastal, space):
    doc = {"name": name, "country": country, "population": population, "climate": climate}
    if coastal is not None:
        doc["coastal"] = coastal
    text = serialise(CITY, doc, space)
    assert closes_every_prefix(CITY, text) == len(text) + 1


# -- in generation: the answer cut by max_tokens still parses ------------------------------------------
from aner_nb import llm  # noqa: E402
from aner_nb.demo_model import GEMMA_CHAT_TEMPLATE, gemma_model_path  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one engine thread for this module

TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
                                         "n": {"type": "integer"}}, "required": ["tags", "n"]}


@pytest.fixture(scope="module")
def tiny(llama_path):
    with llm.load(llama_path, context=1024, progress=False) as m:
        yield m


def check_answer(response: llm.Response, schema: dict, max_tokens: int) -> None:
    value = json.loads(response.text)  # parses: the point of the closing
    jsonschema.validate(value, schema)
    assert response.usage.completion_tokens <= max_tokens
    if response.closed_early:
        assert response.finish_reason == "length"
    if response.finish_reason == "stop":
        assert not response.closed_early


@pytest.mark.parametrize("extra", [0, 1, 3, 8, 20])
def test_a_random_model_cut_at_any_limit_answers_valid_json(tiny, extra):
    """The tiny fixture's random weights wander through the grammar; every cut answer still validates,
    from the smallest limit that holds the schema's minimal value (its tokens on this vocabulary) up."""
    max_tokens = len(tiny.tokenize(minimal_json(TAGS))) + extra
    closed = 0
    for seed in range(4):
        r = tiny.generate("List tags.", json_schema=TAGS, max_tokens=max_tokens, temperature=1.0, seed=seed)
        check_answer(r, TAGS, max_tokens)
        closed += r.closed_early
    assert closed >= 1  # at these limits a random walk through an unbounded array is always cut


def test_the_closing_also_ends_batched_sequences_validly(tiny):
    limit = len(tiny.tokenize(minimal_json(TAGS))) + 4
    with tiny.with_batching(3) as batched:
        streams = [batched.stream("List tags.", json_schema=TAGS, max_tokens=limit, temperature=1.0, seed=s)
                   for s in range(3)]
        for s in streams:
            text = "".join(s)
            assert text == s.response.text
            check_answer(s.response, TAGS, limit)


def test_an_answer_that_fits_is_left_alone(tiny):
    """Greedy with room to spare: the same answer as without a closing (the grammar alone)."""
    r = tiny.generate("List tags.", json_schema={"type": "boolean"}, max_tokens=8)
    assert r.text.strip() in ("true", "false") and r.finish_reason == "stop" and not r.closed_early


def _cube(n: int) -> dict:
    """Three nested arrays of minItems n each: the minimal value holds n**3 items."""
    return {"type": "array", "minItems": n, "items": {"type": "array", "minItems": n, "items": {
        "type": "array", "minItems": n}}}


def test_a_closing_past_the_cap_is_none_not_built():
    """Each minItems is bounded, their product is not: no closing is derived past MAX_CLOSING_CHARS (one of
    10^9 items took the server to 24 GiB, per token); a small product still closes validly."""
    assert minimal_json(_cube(1000)) is None and minimal_json(_cube(40)) is None  # 64,000 items: over the cap
    closer = JsonCloser(_cube(1000))
    assert closer.closing() is None
    closer.feed("[[[0,")
    assert closer.closing() is None
    small = minimal_json(_cube(3))
    jsonschema.validate(json.loads(small), _cube(3))
    cut = JsonCloser(_cube(3))
    cut.feed("[[[0,0,0],")
    jsonschema.validate(json.loads("[[[0,0,0]," + cut.closing()), _cube(3))
    assert len(minimal_json(_cube(10))) <= MAX_CLOSING_CHARS


def test_a_schema_with_no_closing_in_reach_still_answers(tiny):
    r = tiny.generate("List.", json_schema=_cube(1000), max_tokens=8, temperature=1.0, seed=1)
    assert r.usage.completion_tokens <= 8 and not r.closed_early


GEMMA_CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "country": {"type": "string"},
        "climate": {"type": "array", "items": {"type": "string", "enum": ["hot", "cold", "temperate", "dry", "wet"]}},
    },
    "required": ["name", "country", "climate"],
}


@pytest.mark.parametrize("max_tokens", [60, 100, 160])
def test_on_gemma_every_city_answer_parses_and_validates(max_tokens):
    """The issue's case: an enum array without maxItems repeated until max_tokens cut the JSON (0 of 3 parsed)."""
    with llm.load(gemma_model_path(), context=1024, chat_template=GEMMA_CHAT_TEMPLATE, progress=False) as gemma:
        for seed, city in zip(range(3), ["Paris", "Tokyo", "Cairo"]):
            r = gemma.chat([{"role": "user", "content": f"Describe {city} as JSON with every climate word."}],
                           json_schema=GEMMA_CITY, max_tokens=max_tokens, temperature=0.8, seed=seed)
            check_answer(r, GEMMA_CITY, max_tokens)
