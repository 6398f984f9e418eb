"""OpenAI fidelity and sampling on the routes, checked with plain httpx against a real loopback server.

What each route does with a field is compared with the library answering
the same request directly (the fixture is deterministic under greedy and
under a fixed seed), so a field that is silently dropped shows up as a
different text.
"""

from __future__ import annotations

import json

import httpx
import pytest

from test_api import CHAT, base, batching, serving, service, sse_events  # noqa: F401 - base/batching are fixtures

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}


@pytest.fixture(scope="module")
def url(batching):  # noqa: F811 - the imported fixture
    with serving(service(batching, max_tokens=128, max_rows=4)) as server:
        yield server.url


def post(url, path, body):
    return httpx.post(f"{url}{path}", json=body, timeout=30)


def streamed(url, path, body):
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=30) as s:
        assert s.status_code == 200, s.read()
        return sse_events(s.iter_lines())


# -- usage chunk, seeds, defaults --------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": [CHAT]}),
                                        ("/v1/completions", {"prompt": "The harbour"})])
def test_the_usage_chunk_comes_only_when_asked_for(url, path, body):
    body = {**body, "max_tokens": 5, "seed": 4}
    plain = streamed(url, path, body)
    assert plain[-1] == "[DONE]" and all(e["choices"] and "usage" not in e for e in plain[:-1])
    for options in ({"include_usage": False}, {}):
        events = streamed(url, path, {**body, "stream_options": options})
        assert len(events) == len(plain) and all(e == "[DONE]" or e["choices"] for e in events)
    with_usage = streamed(url, path, {**body, "stream_options": {"include_usage": True}})
    last = with_usage[-2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5 and with_usage[-1] == "[DONE]"
    assert len(with_usage) == len(plain) + 1


def test_openai_defaults_temperature_1_and_a_fresh_seed_returned(url, base):  # noqa: F811
    a = post(url, "/v1/chat/completions", {"messages": [CHAT], "max_tokens": 10}).json()
    b = post(url, "/v1/chat/completions", {"messages": [CHAT], "max_tokens": 10}).json()
    assert a["seed"] != b["seed"] and 0 <= a["seed"] < 2**32
    same = post(url, "/v1/chat/completions", {"messages": [CHAT], "max_tokens": 10, "seed": a["seed"],
                                              "temperature": 1.0}).json()
    assert same["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    library = base.chat([CHAT], max_tokens=10, temperature=1.0, seed=a["seed"])
    assert library.text == a["choices"][0]["message"]["content"]
    chat = post(url, "/chat", {"prompt": CHAT["content"], "max_tokens": 10}).json()  # /chat stays greedy, seed 0
    assert chat["text"] == base.generate(CHAT["content"], max_tokens=10).text


def test_raw_completion_uses_no_chat_template(url, base):  # noqa: F811
    r = post(url, "/v1/completions", {"prompt": "The harbour", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == base.complete("The harbour", max_tokens=12).text
    assert body["choices"][0]["logprobs"] is None
    assert body["usage"]["prompt_tokens"] == len(base.prompt_tokens("The harbour", raw=True))
    default = post(url, "/v1/completions", {"prompt": "The harbour", "temperature": 0}).json()
    assert default["usage"]["completion_tokens"] == 16 or default["choices"][0]["finish_reason"] == "stop"
    events = streamed(url, "/v1/completions", {"prompt": "The harbour", "max_tokens": 12, "temperature": 0})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == body["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": ["a", "b"]}, "prompt", "unsupported_parameter"),
    ({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "echo", "unsupported_parameter"),
    ({"prompt": "x", "best_of": 3}, "best_of", "unsupported_parameter"),
    ({"prompt": "x", "typical_p": 0.3}, "typical_p", "unknown_parameter"),
])
def test_completion_refusals(url, body, param, code):
    r = post(url, "/v1/completions", body)
    assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)


def test_unknown_fields_are_refused_and_ignored_ones_change_nothing(url):
    r = post(url, "/v1/chat/completions", {"messages": [CHAT], "mirostat": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    assert r.json()["error"]["param"] == "mirostat"
    plain = post(url, "/v1/chat/completions", {"messages": [CHAT], "max_tokens": 6, "temperature": 0}).json()
    ignored = {"user": "u", "metadata": {"a": "b"}, "store": True, "service_tier": "flex", "safety_identifier": "s",
               "prompt_cache_key": "k", "stream_options": {"include_obfuscation": True, "include_usage": False}}
    dressed = post(url, "/v1/chat/completions", {"messages": [CHAT], "max_tokens": 6, "temperature": 0, **ignored})
    assert dressed.status_code == 200 and dressed.json()["choices"] == plain["choices"]


# -- sampling fields and structured output -------------------------------------------------------------
def test_sampling_fields_reach_the_library(url, base):  # noqa: F811
    options = {"temperature": 0.9, "seed": 21, "top_k": 12, "top_p": 0.8, "min_p": 0.05, "repeat_penalty": 1.3,
               "repeat_last_n": 16, "presence_penalty": 0.5, "frequency_penalty": 0.4}
    expected = base.generate(CHAT["content"], max_tokens=16, **options).text
    assert post(url, "/chat", {"prompt": CHAT["content"], "max_tokens": 16, **options}).json()["text"] == expected
    openai = post(url, "/v1/chat/completions", {"messages": [CHAT], "max_tokens": 16, **options}).json()
    assert openai["choices"][0]["message"]["content"] == expected
    unsampled = base.generate(CHAT["content"], max_tokens=16, temperature=0.9, seed=21).text
    assert expected != unsampled  # the options changed something
    top1 = post(url, "/v1/chat/completions", {"messages": [CHAT], "max_tokens": 16, "temperature": 1.5,
                                              "top_k": 1, "seed": 3}).json()
    assert top1["choices"][0]["message"]["content"] == base.generate(CHAT["content"], max_tokens=16).text


@pytest.mark.parametrize("path, body, status, param", [
    ("/chat", {"prompt": "x", "top_p": 1.5}, 422, "top_p"),
    ("/chat", {"prompt": "x", "repeat_penalty": 0}, 422, "repeat_penalty"),
    ("/chat", {"prompt": "x", "top_k": 10**7}, 400, "top_k"),  # above the vocabulary: the library says so
    ("/chat", {"prompt": "x", "grammar": "root ::= ("}, 400, "grammar"),
    ("/chat", {"prompt": "x", "json_schema": {"type": "number", "multipleOf": 2}}, 400, "json_schema"),
    ("/v1/chat/completions", {"messages": [CHAT], "presence_penalty": -3}, 422, "presence_penalty"),
    ("/v1/chat/completions", {"messages": [CHAT], "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "string", "format": "email"}}}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [CHAT], "response_format": {"type": "json_object"},
                              "grammar": 'root ::= "a"'}, 400, "grammar"),
    ("/v1/chat/completions", {"messages": [CHAT], "response_format": {"type": "xml"}}, 422, "response_format"),
])
def test_bad_sampling_values_name_the_field(url, path, body, status, param):
    r = post(url, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"].split(".")[0] == param


def test_structured_output_on_every_route(url):
    chat = post(url, "/v1/chat/completions", {"messages": [CHAT], "max_tokens": 100, "seed": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}}).json()
    assert json.loads(chat["choices"][0]["message"]["content"])["color"] in ("red", "green")
    raw = post(url, "/v1/completions", {"prompt": "Answer:", "max_tokens": 100, "response_format": {
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}}).json()
    assert set(json.loads(raw["choices"][0]["text"])) == {"ok", "color"}
    seed = post(url, "/chat", {"prompt": "x", "max_tokens": 100, "temperature": 1.0, "json_schema": SCHEMA}).json()
    assert isinstance(json.loads(seed["text"])["ok"], bool)
    gbnf = post(url, "/v1/completions", {"prompt": "Yes or no?", "max_tokens": 8, "grammar": 'root ::= "yes" | "no"'})
    assert gbnf.json()["choices"][0]["text"] in ("yes", "no")
    events = streamed(url, "/v1/chat/completions", {"messages": [CHAT], "max_tokens": 100, "temperature": 0,
                                                    "response_format": {"type": "json_schema",
                                                                        "json_schema": {"name": "v", "schema": SCHEMA}}})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert set(json.loads(text)) == {"ok", "color"}


# -- unknown fields: strict by default, lenient on request --------------------------------------------------
def test_lenient_fields_ignore_unknown_ones_and_name_them_in_a_header(batching, base):  # noqa: F811
    body = {"messages": [CHAT], "max_tokens": 6, "temperature": 0, "typical_p": 0.3, "mirostat": 2}
    with serving(service(batching, max_tokens=16).fields(lenient=True)) as server:
        r = post(server.url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        assert r.headers["x-aner-ignored-fields"] == "mirostat,typical_p"
        assert r.json()["choices"][0]["message"]["content"] == base.chat([CHAT], max_tokens=6).text
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                          json={"prompt": "The harbour", "max_tokens": 3, "stream": True, "top_a": 1}) as s:
            assert s.status_code == 200 and s.headers["x-aner-ignored-fields"] == "top_a"
            s.read()
        plain = post(server.url, "/v1/chat/completions", {"messages": [CHAT], "max_tokens": 2})
        assert plain.status_code == 200 and "x-aner-ignored-fields" not in plain.headers
        refused = post(server.url, "/v1/chat/completions", {**body, "n": 10**6})  # known fields are still checked
        assert refused.status_code in (400, 422) and "n" in refused.text
        # names a client wrote: a CR/LF or NUL broke the response head, a non-latin-1 name was a 500, 60,000 names
        # made a 480 KB head; plain names are listed (20 at most), the rest counted
        odd = {**body, "bad\r\nX-Injected: 1": 1, "nul\u0000": 1, "\u4e2d": 1, **{f"f{i}": 1 for i in range(60_000)}}
        r = post(server.url, "/v1/chat/completions", odd)
        assert r.status_code == 200, r.text[:300]
        listed = r.headers["x-aner-ignored-fields"].split(",")
        assert len(listed) == 21 and listed[-1] == f"+{60_000 + 2 + 3 - 20} more" and "x-injected" not in r.headers
        embedded = post(server.url, "/v1/embeddings", {"input": "hi", "\u4e2d": 1, "ok_field": 2})
        assert embedded.status_code < 500, embedded.text[:200]  # a batching lease does not embed: a 400, not a 500
    with serving(service(batching, max_tokens=16)) as server:
        strict = post(server.url, "/v1/chat/completions", body)
    assert strict.status_code == 400 and strict.json()["error"]["param"] in ("mirostat", "typical_p")


def test_a_schema_answer_closed_at_the_limit_says_so(url, base):  # noqa: F811
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green"]}}},
              "required": ["tags"]}
    format_ = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    limit = len(base.tokenize('{"tags":[]}')) + 6
    seen = set()
    for seed in range(6):
        choice = post(url, "/v1/chat/completions", {"messages": [CHAT], "max_tokens": limit, "seed": seed,
                                                    "response_format": format_}).json()["choices"][0]
        assert isinstance(json.loads(choice["message"]["content"])["tags"], list)
        seen.add(choice.get("closed_early", False))
        assert not choice.get("closed_early") or choice["finish_reason"] == "length"
    assert True in seen  # at this limit the random fixture's arrays are cut, and closed
