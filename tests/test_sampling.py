"""Sampling options, structured output and raw completion in the library, on every lease kind.

The fixture models have random weights, so their text means nothing; what
the tests check is what each option promises about the *distribution* of
tokens, that a seed reproduces, that greedy stays the argmax, and that
constrained output always parses.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from aner_nb import llm
from aner_nb.llm import errors
from aner_nb.llm.sampling import sampler_chain, unsupported_schema_keywords

CTX = 1024
SEEDS = range(24)


@pytest.fixture(scope="module")
def model(llama_path):
    with llm.load(llama_path, context=CTX) as m:
        yield m


@pytest.fixture(scope="module")
def serving(model):
    with model.with_batching(4) as s:
        yield s


def first_tokens(lease, **options):
    """The first sampled token over many seeds: how spread the distribution is."""
    return {lease.complete("the cat", max_tokens=1, seed=seed, **options).tokens for seed in SEEDS}


def distinct(tokens):
    return len(set(tokens)) / max(len(tokens), 1)


# -- bounds -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"top_k": -1}, "top_k"),
        ({"top_k": 10**9}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"repeat_penalty": 0}, "repeat_penalty"),
        ({"repeat_penalty": float("inf")}, "repeat_penalty"),
        ({"repeat_last_n": -1}, "repeat_last_n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"grammar": ""}, "grammar"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"json_schema": "not a dict"}, "json_schema"),
        ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "grammar"),
        ({"json_schema": {"type": "object", "not": {"required": ["a"]}}}, "json_schema"),
    ],
)
def test_every_bound_is_checked_and_named(model, serving, options, param):
    for lease in (model, serving):
        with pytest.raises(errors.InvalidRequestError) as info:
            lease.generate("hello", max_tokens=2, **options)
        assert info.value.param == param and param in str(info.value)


def test_top_k_is_bounded_by_this_models_vocabulary(model):
    n_vocab = model._weights.native.n_vocab
    model.complete("a", max_tokens=1, temperature=1, top_k=n_vocab)
    with pytest.raises(errors.InvalidRequestError, match=f"top_k must be in 0..{n_vocab}"):
        model.complete("a", max_tokens=1, temperature=1, top_k=n_vocab + 1)


def test_an_unsupported_schema_keyword_is_named_with_its_path():
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    assert unsupported_schema_keywords(schema) == ["uniqueItems at /properties/tags"]
    bounded = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}, "e": {"format": "email"}}}
    assert unsupported_schema_keywords(bounded)[0] == "maximum at /properties/n"
    assert "format 'email' at /properties/e" in unsupported_schema_keywords(bounded)[1]
    assert unsupported_schema_keywords({"type": "object", "properties": {"a": {"enum": [1, 2]}}}) == []


# -- greedy stays the argmax; seeds reproduce ------------------------------------------------------


def test_default_options_need_no_sampler_and_top_k_1_equals_greedy(model, serving):
    assert sampler_chain(llm.RequestSettings(), None) is None  # plain argmax of the logits row
    greedy = model.complete("the cat sat on the", max_tokens=24)
    for lease in (model, serving):
        one = lease.complete("the cat sat on the", max_tokens=24, temperature=1.5, top_k=1, seed=3)
        assert one.tokens == greedy.tokens


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 1.0},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.02},
        {"temperature": 1.0, "repeat_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    ],
)
def test_the_same_seed_gives_the_same_tokens_on_every_kind(model, serving, options):
    a = model.complete("once upon a time", max_tokens=20, seed=42, **options)
    assert model.complete("once upon a time", max_tokens=20, seed=42, **options).tokens == a.tokens
    assert serving.complete("once upon a time", max_tokens=20, seed=42, **options).tokens == a.tokens
    others = {model.complete("once upon a time", max_tokens=20, seed=s, **options).tokens for s in (1, 2, 3)}
    assert others != {a.tokens}


# -- each option moves the distribution the way it says -----------------------------------------


def test_top_p_top_k_and_min_p_narrow_the_choice(model):
    wide = first_tokens(model, temperature=1.5)
    assert len(wide) >= 6
    assert len(first_tokens(model, temperature=1.5, top_p=0.05)) < len(wide)
    assert len(first_tokens(model, temperature=1.5, top_k=2)) <= 2
    assert len(first_tokens(model, temperature=1.5, min_p=0.9)) < len(wide)
    assert len(first_tokens(model, temperature=0.05)) < len(wide)  # a cold temperature nears greedy


def test_penalties_change_repetition_the_way_their_sign_says(model):
    prompt = "a b a b a b a b"
    plain = model.complete(prompt, max_tokens=48).tokens
    repeat = model.complete(prompt, max_tokens=48, repeat_penalty=5.0, repeat_last_n=64).tokens
    presence = model.complete(prompt, max_tokens=48, presence_penalty=2.0).tokens
    frequency = model.complete(prompt, max_tokens=48, frequency_penalty=2.0).tokens
    assert distinct(repeat) > distinct(plain)
    assert distinct(presence) > distinct(plain)
    assert distinct(frequency) > distinct(plain)
    attracted = model.complete(prompt, max_tokens=48, presence_penalty=-2.0, frequency_penalty=-2.0).tokens
    assert distinct(attracted) <= distinct(plain)


# -- structured output -----------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["yes", "no", "unsure"]},
        "score": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "detail": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
            "required": ["ok", "kind"],
            "additionalProperties": False,
        },
    },
    "required": ["verdict", "score", "tags", "detail"],
    "additionalProperties": False,
}


def test_a_grammar_constrains_greedy_and_sampled_output_on_every_kind(model, serving):
    grammar = 'root ::= ("yes" | "no") "."'
    for lease in (model, serving):
        for options in ({}, {"temperature": 1.0, "seed": 5}):
            r = lease.generate("answer", max_tokens=8, grammar=grammar, **options)
            assert r.text in ("yes.", "no.") and r.finish_reason == "stop"


def test_json_schema_output_parses_and_validates_greedy_and_seeded(model):
    for seed in range(6):
        r = model.generate("json please", max_tokens=120, json_schema=SCHEMA, temperature=1.0 if seed else 0, seed=seed)
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_concurrent_schema_requests_on_a_batching_lease_all_validate(serving):
    prompts = [f"json {i}" for i in range(4)]
    responses = serving.generate_many(prompts, max_tokens=120, json_schema=SCHEMA, temperature=1.0, seed=9)
    for r in responses:
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_a_speculative_lease_refuses_anything_but_plain_greedy(model):
    with model.with_optimizer(speculative_tokens=4) as spec:
        for options, param in (({"top_k": 5}, "top_k"), ({"grammar": 'root ::= "a"'}, "grammar"),
                               ({"repeat_penalty": 1.2}, "repeat_penalty")):
            with pytest.raises(errors.InvalidRequestError, match="not allowed on a speculative lease") as info:
                spec.generate("x", max_tokens=2, **options)
            assert info.value.param == param
        assert spec.generate("x", max_tokens=2, seed=7).finish_reason in ("stop", "length")


# -- raw completion ----------------------------------------------------------------------------------


def test_complete_evaluates_the_text_without_the_chat_template(model, serving):
    raw = model.prompt_tokens("the cat", raw=True)
    assert raw != model.prompt_tokens("the cat")
    assert raw == model._weights.native.tokenize("the cat", add_special=True, parse_special=True)
    r = model.complete("the cat", max_tokens=6)
    assert r.usage.prompt_tokens == len(raw)
    assert serving.complete("the cat", max_tokens=6).tokens == r.tokens
    with model.stream("the cat", raw=True, max_tokens=6) as s:
        assert "".join(s) == r.text
    with pytest.raises(errors.InvalidRequestError) as info:
        model.complete(["not", "text"])  # type: ignore[arg-type]
    assert info.value.param == "prompt"
    assert model.supports("complete") and serving.supports("complete")
    with model.session() as chat:
        assert not chat.supports("complete")
        with pytest.raises(errors.UnsupportedFeatureError, match="raw completion"):
            chat.complete("the cat")
