"""Bounded grammars and schemas end to end (issue 24): the library and the HTTP routes refuse them typed.

A grammar nesting 100,000 parentheses, a 1,000,000-character grammar and a
10,000-deep JSON schema each used to reach llama.cpp's recursive parser (or a
recursive Python walk): SIGSEGV of the kernel or the server, or an untyped
RecursionError. Now ``model.generate`` raises ``InvalidRequestError`` naming
the field and every route answers 400 with the OpenAI error's ``param``;
the model and the server keep answering afterwards. Realistic schemas still
convert to grammars that pass the bounds and llama.cpp's parser.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from aner_nb.llm import constraints as c
from aner_nb.llm._engine import NativeModel, check_grammar, json_schema_grammar
from aner_nb.llm.errors import InvalidRequestError
from test_api import CHAT, base, batching, healthy, serving, service  # noqa: F401 - base/batching are fixtures

NESTED = "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000  # 200 KB
HUGE = 'root ::= "' + "x" * (1_000_000 - 11) + '"'  # 1,000,000 characters
DEEP = 10_000
REALISTIC = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4,8}$"},
        "title": {"type": "string", "minLength": 1, "maxLength": 1000},
        "tags": {"type": "array", "items": {"enum": [f"tag{i}" for i in range(200)]}, "maxItems": 20},
        "when": {"type": "string", "format": "date-time"},
        "score": {"type": "number"},
        "owner": {"$ref": "#/$defs/person"},
        "fields": {"type": "object", "properties": {f"f{i}": {"type": ["string", "null"]} for i in range(150)}},
        "tree": {"$ref": "#/$defs/node"},
    },
    "required": ["id", "title"],
    "$defs": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 200},
                                                    "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+[.][a-z]{2,6}$"}}},
        "node": {"type": "object", "properties": {"label": {"type": "string"},
                                                  "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}},
    },
}


def deep_schema(levels: int) -> dict:
    root: dict = {"type": "array"}
    node = root
    for _ in range(levels):
        node["items"] = {"type": "array"}
        node = node["items"]
    return root


def deep_schema_json(levels: int) -> str:
    return '{"type":"array","items":' * levels + "{}" + "}" * levels


@pytest.mark.parametrize("options, param, words", [
    ({"grammar": NESTED}, "grammar", "nesting depth"),
    ({"grammar": HUGE}, "grammar", "1,000,000 bytes"),
    ({"json_schema": deep_schema(DEEP)}, "json_schema", "nesting depth"),
    ({"grammar": 'root ::= "a"{5,3}'}, "grammar", "m <= n"),
    ({"json_schema": {"type": "string", "maxLength": 100_000}}, "json_schema", "maxLength"),
    ({"json_schema": {"type": "string", "pattern": "^a]$"}}, "json_schema", "closes nothing"),
    ({"json_schema": {"type": "object", "properties": {"a": 3}}}, "json_schema", "cannot be turned"),  # fuzz finding
    # A NUL no token can spell: sampled at temperature 1, llama.cpp drew end-of-generation and aborted the process.
    ({"grammar": 'root ::= "\\x00"', "temperature": 1.0}, "grammar", "NUL"),
    ({"json_schema": {"const": "\u0000"}, "temperature": 1.0}, "json_schema", "NUL"),
])
def test_generate_refuses_unbounded_constraints_and_keeps_working(base, options, param, words):  # noqa: F811
    with pytest.raises(InvalidRequestError) as info:
        base.generate("hi", max_tokens=2, **options)
    assert info.value.param == param and words in str(info.value)
    assert base.generate("Yes or no?", max_tokens=4, grammar='root ::= "yes" | "no"').text in ("yes", "no")


DEAD_END = r"""
import sys
import numpy as np
from aner_nb.llm._engine import NativeModel, Sampler, SamplerChain
from aner_nb.llm.errors import InvalidRequestError
model = NativeModel(sys.argv[1])
for temperature in (1.0, 0.0):
    sampler = Sampler(model, SamplerChain(temperature=temperature, seed=1, grammar='root ::= "yes" | "no"'))
    row = np.zeros(model.n_vocab, dtype=np.float32)
    row[:] = -np.inf  # every token the grammar allows is ruled out (as a -inf bias would): nothing may follow
    try:
        token = sampler.sample_row(row)
        print("SAMPLED", temperature, token, flush=True)
    except InvalidRequestError as exc:
        print("REFUSED", temperature, exc.param, flush=True)
    sampler.free()
model.free()
"""


def test_a_grammar_that_allows_no_token_ends_the_request_typed_not_the_process(llama_path, tmp_path):
    """Recording a token the grammar ruled out can abort llama.cpp (end-of-generation while the grammar is
    unfinished): the choice is checked first. In a child process, so a regression fails this test only."""
    script = tmp_path / "dead_end.py"
    script.write_text(DEAD_END)
    done = subprocess.run([sys.executable, str(script), str(llama_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["REFUSED 1.0 grammar", "REFUSED 0.0 grammar"], done.stdout


def test_realistic_schemas_pass_the_bounds_and_llama_cpp(base, llama_path):  # noqa: F811
    c.check_json_schema(REALISTIC)
    grammar = json_schema_grammar(json.dumps(REALISTIC))
    figures = c.check_grammar_text(grammar, param="json_schema")
    assert figures.depth == 999  # minLength 1, maxLength 1000: one nested group per optional character
    native = NativeModel(str(llama_path))
    try:
        check_grammar(native, grammar)  # llama.cpp parses it
    finally:
        native.free()
    out = base.generate("Record:", max_tokens=60, json_schema={"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 1000}}})
    assert out.text.startswith("{")


ROUTES = [("/v1/chat/completions", {"messages": [CHAT]}, "response_format"),
          ("/v1/completions", {"prompt": "Hello"}, "response_format"),
          ("/chat", {"prompt": "Hello"}, "json_schema")]


def _post(url, path, body_text):
    return httpx.post(f"{url}{path}", content=body_text.encode(), headers={"content-type": "application/json"},
                      timeout=60)


def _with_schema(path, body, schema_json, field):
    head = json.dumps({**body, "max_tokens": 2})[:-1]
    if field == "json_schema":
        return head + ', "json_schema": ' + schema_json + "}"
    return head + ', "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ' + schema_json + "}}}"


def test_http_routes_answer_400_naming_the_field_and_keep_serving(batching):  # noqa: F811
    with serving(service(batching, max_rows=4)) as server:
        for path, body, schema_field in ROUTES:
            for grammar, words in ((NESTED, "nesting depth"), (HUGE, "1,000,000 bytes")):
                text = json.dumps({**body, "max_tokens": 2, "grammar": grammar})
                assert len(text) < 1_048_576  # under the default body limit: the grammar check answers
                r = _post(server.url, path, text)
                assert r.status_code == 400, (path, r.text[:300])
                error = r.json()["error"]
                assert error["param"] == "grammar" and words in error["message"], error
            for levels in (DEEP, 200):  # past Python's JSON parser's limit, and parsed but over the bound
                r = _post(server.url, path, _with_schema(path, body, deep_schema_json(levels), schema_field))
                assert r.status_code == 400, (path, levels, r.text[:300])
                assert r.json()["error"]["param"] == schema_field, r.text[:300]
                assert "nest" in r.json()["error"]["message"]
            nul = _with_schema(path, {**body, "temperature": 1.0}, '{"const": "\\u0000"}', schema_field)
            r = _post(server.url, path, nul)  # sampled, this request used to abort the server (SIGABRT)
            assert r.status_code == 400 and r.json()["error"]["param"] == schema_field, r.text[:300]
            ok = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 3}, timeout=30)
            assert ok.status_code == 200, ok.text
        assert healthy(server)
