"""Logprobs, echo, ``logit_bias`` and ``n`` over HTTP, through the real ``openai`` SDK and raw SSE.

The numbers are the library's (``tests/test_logprobs.py`` checks those
against llama-cpp-python's logits); here each route must return exactly
them, in OpenAI's shapes, whole and streamed, for one choice or several.
"""

from __future__ import annotations

import json

import httpx
import pytest

from test_api import CHAT, base, batching, serving, service  # noqa: F401 - base/batching are fixtures

openai = pytest.importorskip("openai")

PROMPT = "The harbour at dawn"
QUESTION = "Tell me about the harbour."


@pytest.fixture(scope="module")
def solo_server(base):  # noqa: F811 - the imported fixture
    with serving(service(base, max_tokens=64)) as running:
        yield running


@pytest.fixture(scope="module")
def batch_server(batching):  # noqa: F811
    with serving(service(batching, max_tokens=64)) as running:
        yield running


@pytest.fixture(scope="module")
def client(solo_server):
    return openai.OpenAI(base_url=f"{solo_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def batch_client(batch_server):
    return openai.OpenAI(base_url=f"{batch_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _sse(url: str, body: dict) -> list[dict]:
    """The data events of a streamed answer, [DONE] excluded."""
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# -- chat completions ----------------------------------------------------------------------------------
def test_chat_logprobs_are_the_librarys_in_openais_shape(client, base):  # noqa: F811
    answer = client.chat.completions.create(model="any", messages=[CHAT], max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=3)
    library = base.chat([CHAT], max_tokens=12, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert [c.logprob for c in content] == [e.logprob for e in library.logprobs]
    assert [c.token for c in content] == [e.text for e in library.logprobs]
    assert [bytes(c.bytes) for c in content] == [e.piece for e in library.logprobs]
    assert [[a.logprob for a in c.top_logprobs] for c in content] == [[a.logprob for a in e.top] for e in library.logprobs]
    assert all(len(c.top_logprobs) == 3 for c in content)
    plain = client.chat.completions.create(model="any", messages=[CHAT], max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_streamed_equal_the_whole_answer(client, solo_server):
    whole = client.chat.completions.create(model="any", messages=[CHAT], max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model="any", messages=[CHAT], max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for chunk in chunks for choice in chunk.choices if choice.logprobs
                for c in (choice.logprobs.content or [])]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in whole.choices[0].logprobs.content]
    text_chunks = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert all(chunk.choices[0].logprobs.content for chunk in text_chunks)  # each text chunk carries its tokens


def test_top_logprobs_without_logprobs_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="any", messages=[CHAT], max_tokens=2, top_logprobs=2)
    assert refused.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="any", messages=[CHAT], max_tokens=2, logprobs=True, top_logprobs=21)


# -- completions: the legacy shape and echo -------------------------------------------------------------
def test_completion_logprobs_in_the_legacy_shape(client, base):  # noqa: F811
    answer = client.completions.create(model="any", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    library = base.complete(PROMPT, max_tokens=10, logprobs=True, top_logprobs=3)
    lp = answer.choices[0].logprobs
    assert lp.token_logprobs == [e.logprob for e in library.logprobs]
    assert lp.tokens == [e.text for e in library.logprobs]
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert [max(top.values()) for top in lp.top_logprobs] == [e.top[0].logprob for e in library.logprobs]
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets
    chunks = list(client.completions.create(model="any", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3,
                                            stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    offsets_streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    assert offsets_streamed == lp.text_offset


def test_echo_with_max_tokens_0_scores_the_prompt(client, base):  # noqa: F811
    scored = client.completions.create(model="any", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == PROMPT and scored.usage.completion_tokens == 0
    library = base.complete(PROMPT, max_tokens=0, prompt_logprobs=True, top_logprobs=1)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [e.logprob for e in library.prompt_logprobs[1:]]
    assert len(lp.tokens) == len(base.prompt_tokens(PROMPT, raw=True))
    assert "".join(lp.tokens) == PROMPT
    assert lp.text_offset[-1] + len(lp.tokens[-1]) == len(PROMPT)
    echoed = client.completions.create(model="any", prompt=PROMPT, max_tokens=4, echo=True, temperature=0)
    assert echoed.choices[0].text == PROMPT + base.complete(PROMPT, max_tokens=4).text


def test_echo_scoring_is_refused_where_it_cannot_be_served(batch_client, client):
    with pytest.raises(openai.BadRequestError) as batched:
        batch_client.completions.create(model="any", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    assert batched.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as streamed:
        client.completions.create(model="any", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, stream=True)
    assert streamed.value.body["param"] == "echo"


# -- logit_bias ----------------------------------------------------------------------------------------
def test_logit_bias_of_minus_100_on_the_greedy_token_changes_the_answer(client, base):  # noqa: F811
    plain = base.chat([CHAT], max_tokens=10)
    banned = plain.tokens[0]
    biased = client.chat.completions.create(model="any", messages=[CHAT], max_tokens=10, temperature=0,
                                            logit_bias={str(banned): -100})
    library = base.chat([CHAT], max_tokens=10, logit_bias={banned: -100})
    assert biased.choices[0].message.content == library.text != plain.text
    assert banned not in library.tokens
    completion = client.completions.create(model="any", prompt=PROMPT, max_tokens=6, temperature=0,
                                           logit_bias={str(base.complete(PROMPT, max_tokens=1).tokens[0]): -100})
    assert completion.choices[0].text != base.complete(PROMPT, max_tokens=6).text


def test_a_bias_outside_the_vocabulary_or_range_is_a_400_naming_logit_bias(client):
    with pytest.raises(openai.BadRequestError) as outside:
        client.chat.completions.create(model="any", messages=[CHAT], max_tokens=2, logit_bias={"99999999": 1})
    assert outside.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as high:
        client.chat.completions.create(model="any", messages=[CHAT], max_tokens=2, logit_bias={"5": 200})
    assert high.value.body["param"].startswith("logit_bias")


# -- n choices -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["solo", "batch"])
def test_n_greedy_choices_are_identical(which, client, batch_client):
    sdk = client if which == "solo" else batch_client
    answer = sdk.chat.completions.create(model="any", messages=[CHAT], max_tokens=8, temperature=0, n=3,
                                         logprobs=True)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    texts = {c.message.content for c in answer.choices}
    assert len(texts) == 1
    one = sdk.chat.completions.create(model="any", messages=[CHAT], max_tokens=8, temperature=0)
    assert answer.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert answer.usage.prompt_tokens == one.usage.prompt_tokens
    first = [t.logprob for t in answer.choices[0].logprobs.content]
    for choice in answer.choices[1:]:  # concurrent rows round to within 1e-3 of each other (see above)
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(first, abs=0 if which == "solo" else 1e-3)


@pytest.mark.parametrize("which", ["solo", "batch"])
def test_n_seeded_choices_are_reproducible_one_by_one(which, client, batch_client):
    sdk = client if which == "solo" else batch_client
    answer = sdk.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=40, n=3)
    again = sdk.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=40, n=3)
    assert [c.text for c in answer.choices] == [c.text for c in again.choices]
    for i, choice in enumerate(answer.choices):
        alone = sdk.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=40 + i)
        assert choice.text == alone.choices[0].text
    assert len({c.text for c in answer.choices}) > 1  # other seeds, other samples


@pytest.mark.parametrize("which", ["solo", "batch"])
def test_n_streamed_choices_carry_their_index(which, solo_server, batch_server):
    url = (solo_server if which == "solo" else batch_server).url
    body = {"messages": [CHAT], "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 3, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True}
    events = _sse(f"{url}/v1/chat/completions", body)
    texts = {0: "", 1: "", 2: ""}
    scores: dict[int, list[float]] = {0: [], 1: [], 2: []}
    finished = set()
    for e in events[:-1]:
        for choice in e["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            scores[choice["index"]] += [c["logprob"] for c in ((choice.get("logprobs") or {}).get("content") or [])]
            if choice.get("finish_reason"):
                finished.add(choice["index"])
    assert finished == {0, 1, 2}
    whole = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=60).json()
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    # Concurrent choices share steps whose make-up depends on timing, and rows of different steps round
    # differently in the CPU kernels (test_logprobs.py): the same tokens, logprobs equal to rounding that
    # grows along the answer (seen: 1.2e-3 by the 8th token on an AVX2 EPYC, at b4cc6d2 too). A choice's
    # scores streamed under another index would differ by whole units.
    for i, choice in enumerate(whole["choices"]):
        assert scores[i] == pytest.approx([t["logprob"] for t in choice["logprobs"]["content"]], abs=1e-2)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_n_out_of_bounds_is_a_422(client):
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="any", messages=[CHAT], max_tokens=2, n=17)
