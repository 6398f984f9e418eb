"""Each request option is declared once (aner_nb.llm.options); every surface derives from the declaration.

A throwaway option declared in a test registry, and nowhere else, shows up in
the library's validation, the cell magics' flags and help, the HTTP request
models, the OpenAPI document and the generated docs/openai.md table. No model
is needed but for the last test.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import pytest
from pydantic import ValidationError

from aner_nb import llm
from aner_nb.api import openai_fields
from aner_nb.api.calls import openai_options, renames
from aner_nb.api.request_bodies import request_models
from aner_nb.api.service import ServiceConfig, build_app
from aner_nb.llm import errors, requests
from aner_nb.llm.options import (CHAT_ROUTE, COMPLETIONS_ROUTE, EXTENSION, REGISTRY, Flag, OpenAIField, Option,
                                 Registry, RequestProperties)
from aner_nb.magics.cells import request_options, request_settings, request_usage
from aner_nb.magics.parser import Grammar, overview

DOC = Path(__file__).resolve().parents[1] / "docs" / "openai.md"

BEAMS = Option(
    "beam_width", int, 1, "beams searched side by side", low=1, high=8, flag=Flag("W"),
    openai=(OpenAIField("beam_width", EXTENSION, "1..8, default 1: beams searched side by side"),),
)


@pytest.fixture(scope="module")
def registry() -> Registry:
    """The product's options plus the throwaway one, declared only here."""
    return Registry([*REGISTRY, BEAMS], rules=REGISTRY.rules, base=RequestProperties)


def test_the_throwaway_option_is_in_the_library_validation(registry):
    settings = requests.request_settings({"beam_width": 3, "max_tokens": 5}, registry=registry)
    assert (settings.beam_width, settings.max_tokens, settings.temperature) == (3, 5, 0.0)
    assert registry.settings().beam_width == 1  # its declared default
    for bad in (9, 0, "2", True, 1.5):
        with pytest.raises(errors.InvalidRequestError, match="beam_width") as refused:
            requests.request_settings({"beam_width": bad}, registry=registry)
        assert refused.value.param == "beam_width"
    with pytest.raises(errors.InvalidRequestError, match="beam_width") as unknown:  # listed among the options
        requests.request_settings({"beam_widht": 2}, registry=registry)
    assert unknown.value.param == "beam_widht"
    assert "beam_width" not in REGISTRY and "beam_width" not in requests.REQUEST_OPTIONS  # the product is unchanged
    with pytest.raises(errors.InvalidRequestError) as product:
        requests.request_settings({"beam_width": 2})
    assert product.value.param == "beam_width"


def test_the_throwaway_option_is_a_magic_flag_with_help(registry):
    grammar = Grammar("generate", "%%generate", f"%%generate NAME {request_usage(registry)}", "Answer the cell.",
                      "NAME.generate(prompt, ...)", (partial(request_options, registry=registry),))
    args = grammar.parse(["--beam-width", "4", "--temperature", "0.5"])
    settings = request_settings(args, {}, "%%generate", 32, registry=registry)
    assert (settings.beam_width, settings.temperature, settings.max_tokens) == (4, 0.5, 32)
    assert request_settings(grammar.parse([]), {}, "%%generate", 32, registry=registry).beam_width == 1
    text = grammar.format_help()
    assert "--beam-width W" in text and "beams searched side by side (1..8; default 1)" in text
    assert "[--beam-width W]" in overview([grammar])  # the %llm help overview lists the usage line
    with pytest.raises(errors.InvalidRequestError) as refused:
        request_settings(grammar.parse(["--beam-width", "20"]), {}, "%%generate", 32, registry=registry)
    assert refused.value.param == "beam_width"


def test_the_throwaway_option_is_a_request_field_and_in_the_openapi_document(registry):
    models = request_models(max_tokens=64, max_rows=4, registry=registry)
    assert models.seed(prompt="x").beam_width == 1
    with pytest.raises(ValidationError, match="beam_width"):
        models.seed(prompt="x", beam_width=9)
    for model in (models.chat, models.completion):
        assert "beam_width" in model.model_fields
    body = models.chat(messages=[{"role": "user", "content": "x"}], beam_width=2)
    assert openai_options(body, CHAT_ROUTE, 64, registry)["beam_width"] == 2
    omitted = models.completion(prompt="x")
    assert "beam_width" not in openai_options(omitted, COMPLETIONS_ROUTE, 64, registry)  # the library's default
    schema = build_app(ServiceConfig(title="t", mounts=(), registry=registry)).openapi()
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        field = schema["components"]["schemas"][name]["properties"]["beam_width"]
        assert field["description"] == "1..8, default 1: beams searched side by side."
        assert {"minimum": 1, "maximum": 8, "type": "integer"} in field["anyOf"]
    product = build_app(ServiceConfig(title="t", mounts=())).openapi()
    assert "beam_width" not in product["components"]["schemas"]["ChatCompletionRequest"]["properties"]


def test_the_throwaway_option_is_in_the_generated_field_table(registry):
    row = "| `beam_width` | extension | 1..8, default 1: beams searched side by side |"
    assert row in openai_fields.field_table(CHAT_ROUTE, registry)
    assert "| `beam_width` | extension | as on chat |" in openai_fields.field_table(COMPLETIONS_ROUTE, registry)
    assert openai_fields.route_fields(CHAT_ROUTE, registry)["beam_width"].handling == EXTENSION
    committed = DOC.read_text(encoding="utf-8")
    assert row in openai_fields.render_doc(committed, registry) and row not in committed


def test_the_committed_docs_table_is_the_generated_one(capsys):
    committed = DOC.read_text(encoding="utf-8")
    assert openai_fields.render_doc(committed) == committed, (
        "docs/openai.md is stale: run python -m aner_nb.api.openai_fields --write docs/openai.md")
    assert openai_fields.main(["--check", str(DOC)]) == 0
    stale = committed.replace("| `top_k` | extension |", "| `top_k` | honoured |", 1)
    with pytest.raises(ValueError, match="no generated-table region"):
        openai_fields.render_doc(committed.replace("<!-- end fields -->", "", 1))
    assert openai_fields.render_doc(stale) == committed


def test_the_derived_artefacts_follow_the_declaration_order():
    assert tuple(f.name for f in dataclasses.fields(llm.RequestSettings)) == REGISTRY.names == requests.REQUEST_OPTIONS
    assert set(requests.RequestOptions.__annotations__) == set(REGISTRY.names)
    assert requests.SAMPLING_OPTIONS == tuple(n for n in REGISTRY.names
                                              if n not in ("max_tokens", "seed", "stop", "allow_special_tokens", "max_tokens_fit",
                                                           "logprobs", "top_logprobs", "prompt_logprobs",
                                                           "tools", "parallel_tool_calls", "chat_template_kwargs"))
    assert renames() == {"json_schema": "response_format"}
    defaults = llm.RequestSettings()
    assert {n: getattr(defaults, n) for n in REGISTRY.names} == REGISTRY.defaults()


def test_settings_or_keywords_not_both():
    settings = llm.RequestSettings(max_tokens=3)
    assert requests.request_settings({}, settings) is settings
    with pytest.raises(errors.InvalidRequestError, match="not both") as both:
        requests.request_settings({"seed": 2}, settings)
    assert both.value.param == "seed"
    with pytest.raises(errors.InvalidRequestError) as wrong:
        requests.request_settings({}, {"max_tokens": 3})  # type: ignore[arg-type]
    assert wrong.value.param == "settings"


def test_a_lease_takes_ready_settings_as_keywords(llama_path):
    with llm.load(llama_path, context=256) as model:
        by_keywords = model.generate("the cat sat on", max_tokens=4, stop=["zz"])
        by_settings = model.generate("the cat sat on", settings=llm.RequestSettings(max_tokens=4, stop="zz"))
        assert by_settings.tokens == by_keywords.tokens
        assert "".join(model.stream("the cat sat on", settings=llm.RequestSettings(max_tokens=4))) == by_keywords.text
        with pytest.raises(errors.InvalidRequestError) as both:
            model.generate("x", settings=llm.RequestSettings(), max_tokens=2)
        assert both.value.param == "max_tokens"
