"""The OpenAI routes through clients nobody here wrote: the ``openai`` SDK and LangChain's ``ChatOpenAI``.

One real server on loopback for the module, serving the tiny llama fixture
on a batching lease. The fixture's text is gibberish; what is checked is
the protocol: shapes, streaming loops, usage, seeds, refusals, and that
schema-constrained output parses and validates (the grammar's job, so it
holds for any weights). Schemas are small (booleans, enums, short arrays)
and ``max_tokens`` generous, so the JSON always closes.
"""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from aner_nb.api.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, REJECTED
from test_api import CHAT, base, batching, serving, service  # noqa: F401 - base/batching are fixtures

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MAX_TOKENS = 200
VERDICT = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "inner": {"type": "object", "properties": {"done": {"type": "boolean"}}, "required": ["done"],
                  "additionalProperties": False},
    },
    "required": ["ok", "color", "tags", "inner"],
    "additionalProperties": False,
}


class Inner(BaseModel):
    done: bool


class Verdict(BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]
    tags: list[Literal["a", "b"]] = Field(max_length=2)
    inner: Inner


# A value each rejected field refuses (not null, not a served value); every rejected field needs one.
REFUSED = {
    "n": 2, "logprobs": True, "top_logprobs": 2, "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto", "parallel_tool_calls": True,
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": "auto",
    "logit_bias": {"50": 10}, "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
    "verbosity": "low", "web_search_options": {}, "moderation": {"model": "m"},
    "echo": True, "best_of": 2, "suffix": "end",
}


@pytest.fixture(scope="module")
def server(batching):  # noqa: F811 - the imported fixture
    with serving(service(batching, max_tokens=MAX_TOKENS)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _seed(answer) -> int:
    return answer.model_extra["seed"]


# -- the openai SDK ----------------------------------------------------------------------------------
def test_chat_answer_and_both_streaming_loops(client):
    ask = dict(model="any", messages=[CHAT], max_tokens=9, seed=11)
    whole = client.chat.completions.create(**ask)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert _seed(whole) == 11 and 0 < whole.usage.completion_tokens <= 9

    pieces = []
    for chunk in client.chat.completions.create(**ask, stream=True):  # the common loop: choices[0] always there
        pieces.append(chunk.choices[0].delta.content or "")
        assert chunk.usage is None
    assert "".join(pieces) == whole.choices[0].message.content  # same seed, same tokens

    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.choices for c in chunks[:-1])


def test_an_omitted_seed_is_fresh_and_returned_so_the_answer_can_be_reproduced(client):
    ask = dict(model="any", messages=[CHAT], max_tokens=12)  # temperature omitted: 1, as on OpenAI
    first, second = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    assert _seed(first) != _seed(second)
    again = client.chat.completions.create(**ask, seed=_seed(first))
    assert again.choices[0].message.content == first.choices[0].message.content
    assert _seed(again) == _seed(first)


def test_raw_completion_whole_and_streamed(client, base):  # noqa: F811
    whole = client.completions.create(model="any", prompt="The harbour at dawn", seed=5)
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 16  # OpenAI's default max_tokens
    assert whole.choices[0].finish_reason in ("stop", "length") and _seed(whole) == 5
    streamed = client.completions.create(model="any", prompt="The harbour at dawn", seed=5, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    greedy = client.completions.create(model="any", prompt=["The harbour at dawn"], max_tokens=10, temperature=0)
    assert greedy.choices[0].text == base.complete("The harbour at dawn", max_tokens=10).text  # no chat template
    usage = list(client.completions.create(model="any", prompt="x", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 3


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_response_format_json_schema_parses_and_validates(client, seed):
    answer = client.chat.completions.create(
        model="any", messages=[CHAT], max_tokens=MAX_TOKENS, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}},
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), VERDICT)


def test_the_sdk_parse_helper_with_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse  # older SDKs
    answer = parse(model="any", messages=[CHAT], max_tokens=MAX_TOKENS, temperature=0, response_format=Verdict)
    assert isinstance(answer.choices[0].message.parsed, Verdict)


def test_an_unenforceable_schema_is_a_400_naming_response_format(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="any", messages=[CHAT], max_tokens=20, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 3}}})
    assert refused.value.body["param"] == "response_format" and "minimum" in refused.value.body["message"]


def _rejected(table):
    return [name for name, policy in table.items() if policy.handling == REJECTED]


def test_every_rejected_field_has_a_refused_value_here():
    assert set(_rejected(CHAT_FIELDS)) | set(_rejected(COMPLETION_FIELDS)) <= set(REFUSED)


@pytest.mark.parametrize("field", _rejected(CHAT_FIELDS))
def test_each_rejected_chat_field_answers_400_in_openais_shape(client, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="any", messages=[CHAT], max_tokens=2, extra_body={field: REFUSED[field]})
    error = refused.value.body
    assert (error["param"], error["code"], error["type"]) == (field, "unsupported_parameter", "invalid_request_error")
    assert refused.value.status_code == 400 and error["message"]


@pytest.mark.parametrize("field", _rejected(COMPLETION_FIELDS))
def test_each_rejected_completion_field_answers_400_in_openais_shape(client, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="any", prompt="x", max_tokens=2, extra_body={field: REFUSED[field]})
    error = refused.value.body
    assert (error["param"], error["code"], error["type"]) == (field, "unsupported_parameter", "invalid_request_error")


def test_served_values_of_rejected_fields_and_ignored_fields_are_accepted(client):
    plain = client.chat.completions.create(model="any", messages=[CHAT], max_tokens=6, temperature=0)
    dressed = client.chat.completions.create(model="any", messages=[CHAT], max_tokens=6, temperature=0, n=1,
                                             logprobs=False, user="u-1", metadata={"k": "v"}, store=False,
                                             service_tier="auto", tool_choice="none")
    assert dressed.choices[0].message.content == plain.choices[0].message.content


# -- LangChain's ChatOpenAI ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="tiny",
                                       max_tokens=MAX_TOKENS, temperature=0, max_retries=0, timeout=30)


def test_langchain_invoke_and_stream(chat_model):
    answer = chat_model.invoke("Tell me about the harbour.")
    assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(chunk.content for chunk in chat_model.stream("Tell me about the harbour."))
    assert streamed == answer.content  # greedy: the same tokens


def test_langchain_structured_output_with_a_pydantic_model(chat_model):
    structured = chat_model.with_structured_output(Verdict, method="json_schema")
    assert isinstance(structured.invoke("Judge the harbour."), Verdict)
    sampling = chat_model.model_copy(update={"seed": 9, "temperature": 1.0})
    seeded = sampling.with_structured_output(Verdict, method="json_schema")
    assert isinstance(seeded.invoke("Judge the harbour."), Verdict)
