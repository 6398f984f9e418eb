"""The OpenAI routes' field tables: docs/openai.md, the request models and the refusal check agree.

No model and no server: these build request models and read the docs, in milliseconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aner_nb.api.errors import ApiError, request_param
from aner_nb.api.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, REJECTED, refuse_unsupported
from aner_nb.api.request_bodies import request_models

DOC = Path(__file__).resolve().parents[1] / "docs" / "openai.md"
ROW = re.compile(r"^\| `([a-z_]+)` \| (honoured|extension|rejected|ignored) \|", re.M)


def _documented(section: str) -> dict[str, str]:
    """Field -> handling, from the table under the docs heading ``section``."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"## `POST {section}`")
    end = text.find("\n## ", start + 1)
    return dict(ROW.findall(text[start:end if end != -1 else None]))


@pytest.mark.parametrize("section, table", [("/v1/chat/completions", CHAT_FIELDS),
                                            ("/v1/completions", COMPLETION_FIELDS)])
def test_the_docs_table_lists_every_field_with_its_handling(section, table):
    assert _documented(section) == {name: policy.handling for name, policy in table.items()}


def test_the_request_models_declare_exactly_the_fields_that_are_not_rejected():
    models = request_models(max_tokens=64, max_rows=4)
    for model, table in ((models.chat, CHAT_FIELDS), (models.completion, COMPLETION_FIELDS)):
        served = {name for name, policy in table.items() if policy.handling != REJECTED}
        assert set(model.model_fields) == served, model.__name__


def test_openai_sdk_fields_are_all_classified():
    """Every argument of the installed openai SDK's create() is in the table (a new OpenAI field needs a row)."""
    completion_params = pytest.importorskip("openai.types.completion_create_params")
    chat_params = pytest.importorskip("openai.types.chat.completion_create_params")
    for params, table in ((chat_params.CompletionCreateParamsBase, CHAT_FIELDS),
                          (completion_params.CompletionCreateParamsBase, COMPLETION_FIELDS)):
        assert set(params.__annotations__) <= set(table), sorted(set(params.__annotations__) - set(table))


@pytest.mark.parametrize("given, param, code", [
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "unsupported_parameter"),
    ({"function_call": True}, "function_call", "unsupported_parameter"),  # true is not "none"
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
    ({"typical_p": 0.5}, "typical_p", "unknown_parameter"),
])
def test_refusals_name_the_field(given, param, code):
    with pytest.raises(ApiError) as refused:
        refuse_unsupported(given, CHAT_FIELDS, "/v1/chat/completions")
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, param, code)
    assert refused.value.body()["error"]["type"] == "invalid_request_error"


def test_values_that_ask_for_nothing_missing_are_served():
    refuse_unsupported({"n": 2, "logprobs": True, "top_logprobs": 3, "modalities": ["text"], "tools": None,
                        "tool_choice": "none", "logit_bias": {}, "user": "u", "store": True}, CHAT_FIELDS, "chat")
    refuse_unsupported({"echo": True, "best_of": 1, "suffix": None, "n": 3, "logprobs": 2}, COMPLETION_FIELDS,
                       "completions")


def test_library_params_are_spelt_the_routes_way():
    fields = {"messages", "response_format", "grammar"}
    renames = {"json_schema": "response_format"}
    assert request_param("json_schema", fields, "messages", renames) == "response_format"
    assert request_param("grammar", fields, "messages", renames) == "grammar"
    assert request_param("json_schema", {"prompt", "json_schema"}, "prompt") == "json_schema"  # /chat keeps it
