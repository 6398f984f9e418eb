"""The output cap as chat clients meet it: an omitted max_tokens gets the cap or what fits, a larger one is 422."""

from __future__ import annotations

import httpx
import pytest

from test_api import base, service, serving  # noqa: F401 - base is a fixture

CAP = 48


@pytest.fixture(scope="module")
def small(base):  # noqa: F811 - the imported fixture
    model = base.with_batching(2)  # each sequence gets half the lease's context
    yield model
    model.close()


@pytest.fixture(scope="module")
def url(small):
    with serving(service(small, max_tokens=CAP)) as server:
        yield server.url


def chat(url, content, **fields):
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_an_omitted_max_tokens_gets_what_fits_the_sequence_instead_of_a_context_error(url, small):
    share = small.stats().sequence_context
    # A prompt that leaves fewer than CAP tokens of its sequence's context.
    words, content = 1, "x"
    while len(small.prompt_tokens(content)) < share - CAP // 2:
        words += 8
        content = " ".join(["word"] * words)
    room = share - len(small.prompt_tokens(content))
    assert 0 < room < CAP
    r = chat(url, content)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= share
    assert usage["completion_tokens"] <= room
    # Asked for explicitly, the same room is refused (OpenAI's context_length_exceeded): the client said how
    # much it wanted, and the message says how much would fit.
    refused = chat(url, content, max_tokens=CAP)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded", refused.text
    assert f"at most {room}" in refused.json()["error"]["message"]


def test_a_short_prompt_without_max_tokens_gets_the_cap(url):
    r = chat(url, "hi")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= CAP


def test_max_tokens_above_the_cap_is_answered_422_naming_it(url):
    r = chat(url, "hi", max_tokens=CAP + 1)  # out of range, as any field out of its bounds (docs/openai.md)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and str(CAP) in error["message"]
