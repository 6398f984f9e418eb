"""The HTTP service on a real loopback server with the tiny fixture model.

Every server is started on 127.0.0.1 with a free port and stopped by the
test that started it. Long generations (``LONG`` tokens: about a second of
work for the fixture) are only ever started to be cut short: by a timeout,
a disconnect, or the test closing its stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from aner_nb import api, llm
from aner_nb.llm.errors import ConfigurationError
from fixtures.leases import one_thread_lease

CONTEXT = 2048
LONG = 1900  # fits a 2048-cell sequence with the fixture's short prompts; takes far longer than any timeout here
TOKEN = "test-token-123456"


# -- fixtures and helpers -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(llama_path):
    """One engine thread: llama.cpp's threads spin-wait, which on a busy 2-core machine makes batched steps crawl."""
    with one_thread_lease(llama_path, CONTEXT) as model:
        yield model


@pytest.fixture(scope="module")
def batching(base):
    model = base.with_batching(4)
    yield model
    model.close()


@pytest.fixture
def single(base):
    """A batching lease with one sequence: a second request waits in its queue."""
    model = base.with_batching(1)
    yield model
    model.close()


@contextlib.contextmanager
def serving(builder):
    server = builder.bind(host="127.0.0.1", port=0).start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.running


def service(model, *, max_tokens=64, **limits):
    builder = api.app("test").llm(path="/chat", model=model).output_limit(max_tokens=max_tokens)
    return builder.limits(**limits) if limits else builder


def wait_until(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def healthy(server, in_flight=0):
    """/health answers ok and no request is left in flight."""
    r = httpx.get(f"{server.url}/health", timeout=5)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ok"
    return all(m["in_flight"] == in_flight for m in body["models"])


def sse_events(lines):
    """Decoded ``data:`` payloads of an SSE body (``[DONE]`` kept as a string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(text, name, **labels):
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", re.M)
    for found_labels, value in pattern.findall(text):
        if all(part in found_labels.split(",") for part in want.split(",") if part):
            return float(value)
    raise AssertionError(f"metric {name} {labels} not found")


CHAT = {"role": "user", "content": "Tell me about the harbour."}


# -- routes ----------------------------------------------------------------------------------------
def test_chat_route_answers_like_the_library(batching, base):
    with serving(service(batching)) as server:
        r = httpx.post(f"{server.url}/chat", json={"prompt": "hello there", "max_tokens": 12, "seed": 3}, timeout=10)
        assert r.status_code == 200, r.text
        body = r.json()
        solo = base.generate("hello there", max_tokens=12, seed=3)
        assert body["text"] == solo.text and body["output_hash"] == solo.output_hash  # greedy, token for token
        assert body["finish_reason"] == "length" and body["model"] == batching.name
        assert body["usage"] == {"prompt_tokens": solo.usage.prompt_tokens, "cached_input_tokens": 0,
                                 "completion_tokens": 12, "total_tokens": solo.usage.prompt_tokens + 12}
        assert body["timings"]["batch_max_sequences"] == 4 and body["timings"]["generated_tokens"] == 12
        assert set(body["timings"]) == set(llm.Timings().as_dict())
        assert httpx.post(f"{server.url}/chat", json={"prompt": "x"}, timeout=10).json()["usage"][
            "completion_tokens"] == 64  # no max_tokens: the output limit
        assert healthy(server)


def test_openai_route_with_httpx_streaming_and_not(batching):
    with serving(service(batching)) as server:
        request = {"model": "anything", "messages": [CHAT], "max_tokens": 9, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=10)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["model"] == batching.name
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 9 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert body["system_fingerprint"] == f"fp_{batching.fingerprint[:12]}"

        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=10,
                          json={**request, "stream": True, "stream_options": {"include_usage": True}}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            events = sse_events(s.iter_lines())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == choice["message"]["content"]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        usage = chunks[-1]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9
        assert usage["timings"]["generated_tokens"] == 9
        assert len({c["id"] for c in chunks}) == 1

        no_usage = {**request, "stream": True, "stream_options": {"include_usage": False}}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=no_usage, timeout=10) as s:
            events = sse_events(s.iter_lines())
        assert all(e == "[DONE]" or e["choices"] for e in events)

        models = httpx.get(f"{server.url}/v1/models", timeout=5).json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [batching.name]
        assert httpx.get(f"{server.url}/v1/models/{batching.name}", timeout=5).json()["id"] == batching.name
        missing = httpx.get(f"{server.url}/v1/models/nope", timeout=5)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        assert healthy(server)


def test_openai_sdk_streaming_and_not_with_a_bearer_token(batching):
    openai = pytest.importorskip("openai")
    with serving(service(batching).auth(bearer_token=TOKEN)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0, timeout=10)
        assert [m.id for m in client.models.list()] == [batching.name]
        completion = client.chat.completions.create(model=batching.name, messages=[CHAT], max_tokens=7, seed=1)
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage.completion_tokens == 7 and completion.usage.prompt_tokens > 0
        stream = client.chat.completions.create(model=batching.name, messages=[CHAT], max_tokens=7, seed=1,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == completion.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 7 and chunks[-1].choices == []

        with pytest.raises(openai.UnprocessableEntityError) as bad:
            client.chat.completions.create(model=batching.name, messages=[CHAT], max_tokens=10_000)
        assert bad.value.body["param"] == "max_tokens"
        with pytest.raises(openai.BadRequestError) as overflow:
            client.chat.completions.create(model=batching.name, messages=[{"role": "user", "content": "word " * 600}],
                                           max_tokens=60)
        assert overflow.value.body["code"] == "context_length_exceeded"
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-the-token", max_retries=0, timeout=10)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=batching.name, messages=[CHAT], max_tokens=2)
        assert healthy(server)


# -- concurrency, overload, timeout, disconnect ------------------------------------------------------------
def test_concurrent_clients_share_one_scheduler(batching):
    before = batching.stats()
    results: list[httpx.Response] = []
    barrier = threading.Barrier(4)

    def client(i: int) -> None:
        barrier.wait(timeout=10)
        results.append(httpx.post(f"{server.url}/chat", json={"prompt": f"client {i} asks", "max_tokens": 24},
                                  timeout=60))

    with serving(service(batching, max_tokens=400)) as server:
        held = _hold(server, max_tokens=400)  # a long streaming client, decoding while the others arrive
        try:
            threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
        finally:
            held[1].close()
            held[0].close()
        assert [r.status_code for r in results] == [200] * 4
        peaks = [r.json()["timings"]["batch_peak_sequences"] for r in results]
        assert min(peaks) > 1 and max(peaks) <= 4, peaks  # they decoded in the same llama_decode steps
        assert batching.stats().admitted - before.admitted == 5
        wait_until(lambda: healthy(server), what="the held stream to be cancelled")


def _hold(server, max_tokens=LONG):
    """Open a long streaming request and return (client, response) once admitted (its headers arrived)."""
    client = httpx.Client(timeout=10)
    request = client.build_request("POST", f"{server.url}/v1/chat/completions",
                                   json={"messages": [CHAT], "max_tokens": max_tokens, "stream": True, "temperature": 0})
    response = client.send(request, stream=True)
    assert response.status_code == 200, response.read()
    return client, response


def test_overload_answers_503_with_retry_after(single):
    with serving(service(single, max_tokens=LONG, max_concurrent=2, retry_after_s=3)) as server:
        held = [_hold(server), _hold(server)]  # one decoding, one waiting in the scheduler's queue
        try:
            r = httpx.post(f"{server.url}/chat", json={"prompt": "one more", "max_tokens": 2}, timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "3"
            assert r.json()["error"]["code"] == "busy" and r.json()["error"]["type"] == "overloaded_error"
            r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [CHAT], "stream": True}, timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "3"  # busy before any SSE starts
            text = httpx.get(f"{server.url}/metrics", timeout=5).text
            assert metric(text, "aner_busy_rejections_total") == 2
            assert metric(text, "aner_http_in_flight") == 2
            assert metric(text, "aner_queue_length") == 1 and metric(text, "aner_active_sequences") == 1
        finally:
            for client, response in held:
                response.close()
                client.close()
        wait_until(lambda: healthy(server), what="the held requests to be cancelled")
        wait_until(lambda: single.stats().active == 0 and single.stats().waiting == 0, what="an idle scheduler")
        assert httpx.post(f"{server.url}/chat", json={"prompt": "now", "max_tokens": 2}, timeout=10).status_code == 200


def test_ordinary_lease_answers_a_concurrent_request_busy(base):
    with serving(service(base, max_tokens=LONG)) as server:
        client, response = _hold(server)
        try:
            r = httpx.post(f"{server.url}/chat", json={"prompt": "me too", "max_tokens": 2}, timeout=10)
            assert r.status_code == 503 and "retry-after" in r.headers
        finally:
            response.close()
            client.close()
        wait_until(lambda: healthy(server), what="the held request to be cancelled")
        assert httpx.post(f"{server.url}/chat", json={"prompt": "now", "max_tokens": 2}, timeout=10).status_code == 200

    # with room for two requests, the lease itself refuses the second (BusyError -> 503)
    with serving(service(base, max_tokens=LONG, max_concurrent=2)) as server:
        client, response = _hold(server)
        try:
            r = httpx.post(f"{server.url}/chat", json={"prompt": "me too", "max_tokens": 2}, timeout=10)
            assert r.status_code == 503 and "already running" in r.json()["error"]["message"]
        finally:
            response.close()
            client.close()
        wait_until(lambda: healthy(server), what="the held request to be cancelled")


def test_timeout_cancels_the_generation_and_frees_its_slot(single):
    before = single.stats()
    with serving(service(single, max_tokens=LONG, timeout_ms=150)) as server:
        r = httpx.post(f"{server.url}/chat", json={"prompt": "go on", "max_tokens": LONG}, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
        stats = single.stats()  # the answer comes after the sequence was freed
        assert stats.active == 0 and stats.waiting == 0 and stats.cancelled == before.cancelled + 1
        # cut short by the timeout, not run to its end: far fewer than LONG tokens were sampled
        assert stats.decoded_tokens - before.decoded_tokens < LONG
        assert healthy(server)

        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                          json={"messages": [CHAT], "max_tokens": LONG, "stream": True, "temperature": 0}) as s:
            events = sse_events(s.iter_lines())
        assert events[-1]["error"]["code"] == "timeout" and "[DONE]" not in events
        wait_until(lambda: single.stats().active == 0 and healthy(server), what="the slot to be freed")
        assert single.stats().cancelled == before.cancelled + 2

        ok = httpx.post(f"{server.url}/chat", json={"prompt": "short", "max_tokens": 3}, timeout=10)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
        assert metric(text, "aner_timeouts_total") == 2


def test_client_disconnect_cancels_the_sequence(single):
    before = single.stats()
    with serving(service(single, max_tokens=LONG)) as server:
        client, response = _hold(server)
        pieces = 0
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content":"' in line:
                pieces += 1
                if pieces == 3:
                    break
        response.close()  # mid-stream
        client.close()
        wait_until(lambda: single.stats().cancelled == before.cancelled + 1, what="the stream's sequence to be cancelled")
        wait_until(lambda: healthy(server) and single.stats().active == 0, what="the slot to be freed")
        assert single.stats().completed == before.completed

        # a non-streaming client that gives up is noticed too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/chat", json={"prompt": "slow", "max_tokens": LONG}, timeout=0.3)
        wait_until(lambda: single.stats().cancelled == before.cancelled + 2, what="the request to be cancelled")
        wait_until(lambda: healthy(server), what="the slot to be freed")
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
        assert metric(text, "aner_disconnects_total") == 2


# -- limits and validation -----------------------------------------------------------------------------------
def test_body_too_large_is_refused_unread(batching):
    with serving(service(batching, max_body_bytes=4096)) as server:
        big = {"prompt": "x" * 5000}
        r = httpx.post(f"{server.url}/chat", json=big, timeout=10)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: refused once the bound is passed
            for _ in range(10):
                yield b"{" + b" " * 1000

        r = httpx.post(f"{server.url}/chat", content=chunked(), headers={"content-type": "application/json"},
                       timeout=10)
        assert r.status_code == 413
        assert httpx.post(f"{server.url}/chat", json={"prompt": "x" * 100, "max_tokens": 1},
                          timeout=10).status_code == 200
        assert healthy(server)


@pytest.mark.parametrize(
    "path, body, param, code",
    [
        ("/chat", {"prompt": 5}, "prompt", "string_type"),
        ("/chat", {}, "prompt", "missing"),
        ("/chat", {"prompt": "x", "max_tokens": "5"}, "max_tokens", "int_type"),
        ("/chat", {"prompt": "x", "max_tokens": 1.5}, "max_tokens", "int_type"),
        ("/chat", {"prompt": "x", "max_tokens": 65}, "max_tokens", "less_than_equal"),
        ("/chat", {"prompt": "x", "max_tokens": -1}, "max_tokens", "greater_than_equal"),
        ("/chat", {"prompt": "x", "temperature": 2.5}, "temperature", "less_than_equal"),
        ("/chat", {"prompt": "x", "temperature": True}, "temperature", "float_type"),
        ("/chat", {"prompt": "x", "seed": 2**32}, "seed", "less_than_equal"),
        ("/chat", {"prompt": "x", "stop": [""]}, "stop[0]", "invalid_value"),
        ("/chat", {"prompt": "x", "max_token": 5}, "max_token", "extra_forbidden"),
        ("/chat", [1, 2], None, "model_attributes_type"),
        ("/v1/chat/completions", {}, "messages", "missing"),
        ("/v1/chat/completions", {"messages": []}, "messages", "too_short"),
        ("/v1/chat/completions", {"messages": [CHAT] * 5}, "messages", "too_long"),
        ("/v1/chat/completions", {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "literal_error"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content", "missing"),
        ("/v1/chat/completions", {"messages": [CHAT], "n": 17}, "n", "less_than_equal"),
        ("/v1/chat/completions", {"messages": [CHAT], "logit_bias": {"x": 1}}, "logit_bias", "invalid_value"),
        ("/v1/chat/completions", {"messages": [CHAT], "stream": "yes"}, "stream", "bool_type"),
        ("/v1/chat/completions", {"messages": [CHAT], "max_completion_tokens": 1000}, "max_completion_tokens",
         "less_than_equal"),
    ],
)
def test_invalid_requests_name_the_field(batching, path, body, param, code):
    with serving(service(batching, max_rows=4)) as server:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=10)
        assert r.status_code in (400, 422), r.text
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == code, error
        assert error["type"] == "invalid_request_error" and error["message"]


NESTED_ARGUMENTS = '{"a":' + "[" * 100_000 + "]" * 100_000 + "}"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi\ud800"}]}, "messages[0].content"),
        ("/v1/completions", {"prompt": "hi\udc00"}, "prompt"),
        ("/chat", {"prompt": "\udfff"}, "prompt"),
        ("/v1/embeddings", {"input": "a\ud800"}, "input"),
        ("/v1/chat/completions", {"messages": [CHAT], "tools": [
            {"type": "function", "function": {"name": "f", "description": "\udc00"}}]}, "tools[0].function.description"),
        ("/v1/chat/completions", {"messages": [CHAT], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["\ud800"]}}}}, "response_format"),
        ("/v1/chat/completions", {"messages": [CHAT], "stop": ["\ud800"]}, "stop[0]"),
        ("/v1/chat/completions", {"messages": [CHAT], "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": [CHAT, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": NESTED_ARGUMENTS}}]},
            {"role": "tool", "tool_call_id": "1", "content": "r"}]}, "messages[1].tool_calls[0].function.arguments"),
    ],
    ids=["chat-content", "completion-prompt", "seed-prompt", "embeddings-input", "tool-description", "schema-enum",
         "stop", "logit-bias-key-of-5000-digits", "tool-call-arguments-nested-past-the-parser"],
)
def test_text_no_encoder_accepts_and_numbers_past_python_limits_answer_400(batching, path, body, param):
    """A JSON "\\ud800" escape is a lone surrogate in Python (no UTF-8 encoder takes it); these were 500s."""
    with serving(service(batching, max_rows=4)) as server:
        extra = {} if path == "/v1/embeddings" else {"max_tokens": 2}
        content = json.dumps({**body, **extra}).encode()  # ensure_ascii: the surrogates travel as escapes
        r = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == "invalid_value", error
        assert healthy(server)


def test_malformed_json_and_context_overflow_answer_400(batching):
    with serving(service(batching)) as server:
        r = httpx.post(f"{server.url}/chat", content=b'{"prompt": ', headers={"content-type": "application/json"},
                       timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = httpx.post(f"{server.url}/chat", json={"prompt": "word " * 600, "max_tokens": 8}, timeout=10)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "prompt" and r.json()["error"]["code"] == "context_length_exceeded"
        r = httpx.get(f"{server.url}/nowhere", timeout=5)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert httpx.get(f"{server.url}/chat", timeout=5).status_code == 405
        assert healthy(server)


def test_unauthenticated_requests_are_refused(batching):
    with serving(service(batching).auth(bearer_token=TOKEN)) as server:
        good = {"authorization": f"Bearer {TOKEN}"}
        for path, method in (("/chat", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET"),
                             ("/metrics", "GET")):
            for headers in ({}, {"authorization": "Bearer wrong-token-000"}, {"authorization": TOKEN}):
                r = httpx.request(method, f"{server.url}{path}", json={"prompt": "x"}, headers=headers, timeout=5)
                assert r.status_code == 401, (path, headers)
                assert r.headers["www-authenticate"] == "Bearer" and r.json()["error"]["type"] == "authentication_error"
        assert httpx.post(f"{server.url}/chat", json={"prompt": "x", "max_tokens": 1}, headers=good,
                          timeout=10).status_code == 200
        assert healthy(server)  # /health and /openapi.json need no token
        schema = httpx.get(f"{server.url}/openapi.json", timeout=5).json()
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        text = httpx.get(f"{server.url}/metrics", headers=good, timeout=5).text
        assert metric(text, "aner_http_requests_total", route="/chat", code="401") == 3


def test_health_and_metrics(batching, base):
    with serving(service(batching)) as server:
        assert httpx.post(f"{server.url}/chat", json={"prompt": "x", "max_tokens": 5}, timeout=10).status_code == 200
        r = httpx.get(f"{server.url}/metrics", timeout=5)
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = r.text
        for name in ("aner_http_requests_total", "aner_busy_rejections_total", "aner_completion_tokens_total",
                     "aner_prompt_tokens_total", "aner_queue_length", "aner_active_sequences", "aner_requests_total"):
            assert f"# TYPE {name} " in text
        assert metric(text, "aner_completion_tokens_total", model=batching.name) == 5
        assert metric(text, "aner_http_requests_total", route="/chat", code="200") == 1
        assert metric(text, "aner_max_sequences") == 4
    closed = base.with_context_pool(0)
    with serving(service(closed)) as server:
        closed.close()
        r = httpx.get(f"{server.url}/health", timeout=5)
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        r = httpx.post(f"{server.url}/chat", json={"prompt": "x"}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_closed"


def test_two_models_on_one_service(batching, qwen2_path):
    other = llm.load(qwen2_path, context=256)  # an ordinary lease: one request at a time
    try:
        builder = api.app("two").llm(path="/chat", model=batching, name="a").llm(path="/qwen", model=other, name="b")
        with serving(builder.output_limit(max_tokens=4)) as server:
            assert [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=5).json()["data"]] == ["a", "b"]
            for name in ("a", "b"):
                r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": name, "messages": [CHAT]}, timeout=10)
                assert r.status_code == 200 and r.json()["model"] == name
            assert httpx.post(f"{server.url}/qwen", json={"prompt": "x"}, timeout=10).json()["model"] == "b"
            r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "c", "messages": [CHAT]}, timeout=10)
            assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    finally:
        other.close()


# -- the builder, the handle, asgi() and the CLI ---------------------------------------------------------------
def test_builder_checks_arguments_and_is_immutable(batching):
    first = api.app("t").llm(model=batching)
    second = first.bind(port=0)
    assert first.port == 11435 and second.port == 0 and first.host == "127.0.0.1"
    bad = [
        lambda: api.app(""),
        lambda: first.llm(path="chat", model=batching, name="x"),
        lambda: first.llm(path="/v1/x", model=batching, name="x"),
        lambda: first.llm(path="/health", model=batching, name="x"),
        lambda: first.llm(path="/chat", model=batching, name="other"),  # path taken
        lambda: first.llm(path="/two", model=batching),  # id taken
        lambda: first.llm(path="/x", model="not a lease"),
        lambda: first.bind(port=70000),
        lambda: first.limits(max_rows=0),
        lambda: first.limits(timeout_ms=0),
        lambda: first.limits(max_concurrent=True),
        lambda: first.output_limit(max_tokens=-1),
        lambda: first.auth(bearer_token="short"),
        lambda: api.app("empty").asgi(),
    ]
    for make in bad:
        with pytest.raises(ConfigurationError):
            make()
    assert TOKEN not in repr(first.auth(bearer_token=TOKEN))


def test_server_handle_shows_itself_and_stops(batching):
    with serving(service(batching)) as server:
        assert server.running and server.url.startswith("http://127.0.0.1:")
        html = server._repr_html_()
        assert server.url in html and "running" in html and "/v1/chat/completions" in html
        assert server.url in repr(server)
    assert "stopped" in server._repr_html_()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)


def test_asgi_app_runs_under_any_asgi_server(batching):
    application = service(batching).asgi()

    async def run() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            chat = await client.post("/chat", json={"prompt": "x", "max_tokens": 2})
            health = await client.get("/health")
            return chat.status_code, health.status_code

    assert asyncio.run(run()) == (200, 200)
    for mount in application.state.mounts:
        mount.shutdown()


def test_cli_serves_with_an_api_key_from_the_environment(llama_path):
    env = {**os.environ, "ANER_TEST_KEY": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-m", "aner_nb", "serve", str(llama_path), "--port", "0", "--context", "512",
         "--max-sequences", "2", "--max-tokens", "8", "--threads", "1", "--api-key-env", "ANER_TEST_KEY",
         "--cpu-extra-buffers", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = match.group(1)
        assert httpx.post(f"{url}/chat", json={"prompt": "x"}, timeout=10).status_code == 401
        r = httpx.post(f"{url}/chat", json={"prompt": "x"}, headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert r.json()["timings"]["batch_max_sequences"] == 2
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        proc.stdout.close()
        proc.stderr.close()

    missing = subprocess.run([sys.executable, "-m", "aner_nb", "serve", str(llama_path), "--api-key-env", "ANER_UNSET_VAR"],
                             capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                                              if k != "ANER_UNSET_VAR"})
    assert missing.returncode == 2 and "ANER_UNSET_VAR" in missing.stderr
    bad = subprocess.run([sys.executable, "-m", "aner_nb", "serve", str(llama_path), "--cpu-extra-buffers", "yes"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--cpu-extra-buffers: invalid choice" in bad.stderr


# -- the published schema, fuzzed --------------------------------------------------------------------------------
def test_openapi_schema_fuzz_finds_no_server_error(batching):
    """schemathesis against /openapi.json: no 5xx but the documented 503 in a bounded run of every JSON route."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation import GenerationMode

    with serving(service(batching, max_tokens=4, max_rows=4)) as server:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        seen = {f"{op.method.upper()} {op.path}" for op in operations}
        assert {"POST /chat", "POST /v1/chat/completions", "GET /v1/models", "GET /health"} <= seen
        statuses: dict[str, set[int]] = {}
        for operation in operations:
            if operation.path == "/metrics":
                continue  # text, not JSON
            modes = [GenerationMode.POSITIVE]
            if operation.method.lower() == "post":  # bodies to break; GET routes have nothing to negate
                modes.append(GenerationMode.NEGATIVE)
            for mode in modes:
                # The chat routes must reach the model at least once (asserted below): their schema admits
                # bodies the library refuses (a null user content, a logit_bias id outside the vocabulary),
                # so they get more valid examples than the other routes.
                reach = mode == GenerationMode.POSITIVE and operation.path in ("/chat", "/v1/chat/completions")

                @settings(max_examples=50 if reach else 15, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def check(case):
                    if isinstance(case.body, dict) and case.body.get("stream") is True:
                        case.body["stream"] = False  # the fuzzed client reads JSON; SSE is tested above
                    response = case.call(base_url=server.url, timeout=10)
                    statuses.setdefault(f"{operation.method.upper()} {operation.path}", set()).add(response.status_code)
                    documented_busy = response.status_code == 503 and "retry-after" in response.headers
                    assert response.status_code < 500 or documented_busy, (case.body, response.text)

                check()
        for route in ("POST /chat", "POST /v1/chat/completions"):  # it reached the model, and the validation
            assert 200 in statuses[route] and statuses[route] & {400, 422}, statuses
        assert healthy(server)
