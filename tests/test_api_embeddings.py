"""``POST /v1/embeddings``, ``/tokenize`` and ``/detokenize`` over a real server: httpx, the ``openai`` SDK, LangChain.

One loopback server for the module, serving the tiny llama fixture on a batching lease (what ``aner-nb serve``
serves). Answers are compared with the library's ``embed``/``tokenize`` on the same lease (the library's
parity with llama-cpp-python is tests/test_embeddings.py) and, for the token routes, with llama-cpp-python's
tokenizer. Refusals are checked for their status and ``param``; the gates (bearer token, Host) hold on the
new routes as on the others; the work runs on the service's worker threads.
"""

from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import pytest

from aner_nb import llm
from test_api import TOKEN, base, batching, healthy, serving, service, wait_until  # noqa: F401 - fixtures

openai = pytest.importorskip("openai")
langchain_openai = pytest.importorskip("langchain_openai")
llama_cpp = pytest.importorskip("llama_cpp")

TEXTS = ["The harbour at dawn", "hello world", "Tell me about the lighthouse keeper."]


@pytest.fixture(scope="module")
def server(batching):  # noqa: F811 - the imported fixture
    with serving(service(batching)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def post(server, path, body, **kwargs):
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kwargs)


def refused(r, status, param, code=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# -- /v1/embeddings with httpx ---------------------------------------------------------------------------
def test_every_input_shape_answers_the_librarys_vectors(server, batching):  # noqa: F811
    expected = batching.embed(TEXTS)
    ids = [batching.tokenize(t) for t in TEXTS]
    for given, rows in ((TEXTS[0], expected[:1]), (TEXTS, expected), (ids[0], expected[:1]), (ids, expected)):
        r = post(server, "/v1/embeddings", {"model": "any", "input": given})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == batching.name
        assert [d["index"] for d in body["data"]] == list(range(len(rows)))
        assert all(d["object"] == "embedding" for d in body["data"])
        got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
        np.testing.assert_allclose(got, rows, atol=1e-6)  # one input alone, or batched as the library ran it
        tokens = sum(len(t) for t in (ids[:1] if len(rows) == 1 else ids))
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_base64_decodes_to_the_same_floats(server, batching):  # noqa: F811
    floats = post(server, "/v1/embeddings", {"input": TEXTS, "encoding_format": "float"}).json()["data"]
    packed = post(server, "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"}).json()["data"]
    for f, p in zip(floats, packed):
        decoded = np.frombuffer(base64.b64decode(p["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.array(f["embedding"], dtype=np.float32))


def test_dimensions_is_served_only_at_the_models_width(server, batching):  # noqa: F811
    width = batching.facts.embedding_length
    assert post(server, "/v1/embeddings", {"input": "a", "dimensions": width}).status_code == 200
    error = refused(post(server, "/v1/embeddings", {"input": "a", "dimensions": 8}), 400, "dimensions",
                    "unsupported_parameter")
    assert str(width) in error["message"]


def test_refusals_name_the_field(server, batching):  # noqa: F811
    n_vocab = batching.facts.vocab_size
    long = "word " * 2100  # over the 2048-token context
    refused(post(server, "/v1/embeddings", {"input": ["ok", long]}), 400, "input[1]", "invalid_value")
    refused(post(server, "/v1/embeddings", {"input": [[1, n_vocab]]}), 400, "input[0][1]", "invalid_value")
    refused(post(server, "/v1/embeddings", {"input": [1, -3]}), 400, "input[1]", "invalid_value")
    refused(post(server, "/v1/embeddings", {"input": []}), 400, "input", "invalid_value")
    refused(post(server, "/v1/embeddings", {"input": ["a", ""]}), 400, "input[1]", "invalid_value")
    refused(post(server, "/v1/embeddings", {"input": "a", "pooling": "max"}), 400, "pooling", "unknown_parameter")
    refused(post(server, "/v1/embeddings", {"input": "a", "encoding_format": "int8"}), 422, "encoding_format")
    assert post(server, "/v1/embeddings", {"input": [1, "a"]}).status_code == 422
    assert post(server, "/v1/embeddings", {}).status_code == 422
    assert post(server, "/v1/embeddings", {"input": "a", "user": "someone"}).status_code == 200  # ignored


def test_the_work_runs_on_the_services_worker_threads(server, batching, monkeypatch):  # noqa: F811
    threads = []
    real = batching.embed

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(batching, "embed", spy)
    assert post(server, "/v1/embeddings", {"input": "a"}).status_code == 200
    assert threads and threads[0].startswith("aner-http-"), threads


def test_the_gates_hold_on_the_new_routes(batching):  # noqa: F811
    with serving(service(batching).auth(bearer_token=TOKEN)) as server:
        for path, body in (("/v1/embeddings", {"input": "a"}), ("/tokenize", {"content": "a"}),
                           ("/detokenize", {"tokens": [1]})):
            assert post(server, path, body).status_code == 401, path
            assert post(server, path, body, headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200, path
            assert post(server, path, body, headers={"host": "evil.example"}).status_code == 403, path
            text = httpx.post(f"{server.url}{path}", content=b"{}", timeout=5,
                              headers={"authorization": f"Bearer {TOKEN}", "content-type": "text/plain"})
            assert text.status_code == 415, path


def _hold(server):
    """A long raw-completion stream, returned once admitted (its headers arrived)."""
    client = httpx.Client(timeout=10)
    request = client.build_request("POST", f"{server.url}/v1/completions",
                                   json={"prompt": "The harbour", "max_tokens": 1900, "stream": True, "temperature": 0})
    response = client.send(request, stream=True)
    assert response.status_code == 200, response.read()
    return client, response


def test_an_ordinary_lease_embeds_one_call_at_a_time_and_not_when_closed(base, llama_path):  # noqa: F811
    for limits, message in (({}, "busy"), ({"max_concurrent": 2}, "already running")):
        with serving(service(base, max_tokens=1900, **limits)) as server:
            client, response = _hold(server)
            try:
                r = post(server, "/v1/embeddings", {"input": "a"})
                assert r.status_code == 503 and "retry-after" in r.headers and message in r.json()["error"]["message"]
            finally:
                response.close()
                client.close()
            wait_until(lambda: healthy(server), what="the held request to be cancelled")
            assert post(server, "/v1/embeddings", {"input": "a"}).status_code == 200
    closing = llm.load(llama_path, context=256)
    with serving(service(closing)) as server:
        closing.close()
        for path, body in (("/v1/embeddings", {"input": "a"}), ("/tokenize", {"content": "a"})):
            assert post(server, path, body).json()["error"]["code"] == "model_closed", path


# -- real clients ----------------------------------------------------------------------------------------
def test_openai_sdk_embeddings_create(client, batching):  # noqa: F811
    expected = batching.embed(TEXTS)
    answer = client.embeddings.create(model="any", input=TEXTS)  # the SDK asks for base64 and decodes it
    np.testing.assert_allclose(np.array([d.embedding for d in answer.data]), expected, atol=1e-7)
    assert answer.usage.prompt_tokens == sum(len(batching.tokenize(t)) for t in TEXTS)
    floats = client.embeddings.create(model="any", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, expected[0], atol=1e-7)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="any", input="a", dimensions=3)
    assert caught.value.body["param"] == "dimensions"


def test_langchain_openai_embeddings(server, batching):  # noqa: F811
    # check_embedding_ctx_length=False: send the texts, not tiktoken's ids of another vocabulary
    embedder = langchain_openai.OpenAIEmbeddings(base_url=f"{server.url}/v1", api_key="unused", model="any",
                                                 check_embedding_ctx_length=False, max_retries=0)
    expected = batching.embed(TEXTS)
    np.testing.assert_allclose(np.array(embedder.embed_documents(TEXTS)), expected, atol=1e-6)
    np.testing.assert_allclose(embedder.embed_query(TEXTS[1]), expected[1], atol=1e-6)


# -- /tokenize and /detokenize ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(llama_path):
    model = llama_cpp.Llama(str(llama_path), n_ctx=64, n_threads=1, verbose=False, vocab_only=True)
    yield model
    model.close()


@pytest.mark.parametrize("text", ["hello world", "<|im_start|>user\nThe harbour at dawn, 42 ships!<|im_end|>"])
def test_tokenize_round_trips_and_equals_llama_cpp_python(server, reference, text):
    tokens = post(server, "/tokenize", {"content": text}).json()["tokens"]
    assert tokens == reference.tokenize(text.encode(), add_bos=False, special=True)  # llama.cpp server's defaults
    assert post(server, "/detokenize", {"tokens": tokens}).json() == {"content": text}
    plain = post(server, "/tokenize", {"content": text, "add_special": True, "parse_special": False}).json()
    assert plain["tokens"] == reference.tokenize(text.encode(), add_bos=True, special=False)
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens
    assert "".join(p["piece"] for p in pieces) == text  # ASCII: every piece is text


def test_pieces_that_are_not_utf8_come_as_bytes(server, batching):  # noqa: F811
    tokens = batching.tokenize("é", add_special=False)
    pieces = post(server, "/tokenize", {"content": "é", "with_pieces": True}).json()["tokens"]
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert raw == "é".encode() and [p["id"] for p in pieces] == tokens
    if len(tokens) > 1:  # a byte-level vocabulary splits it into two bytes, neither valid UTF-8 alone
        assert all(isinstance(p["piece"], list) for p in pieces)


def test_token_routes_refuse_ids_outside_the_vocabulary_and_unknown_fields(server, batching):  # noqa: F811
    n_vocab = batching.facts.vocab_size
    refused(post(server, "/detokenize", {"tokens": [1, n_vocab]}), 400, "tokens[1]", "invalid_value")
    refused(post(server, "/detokenize", {"tokens": [-1]}), 400, "tokens[0]", "invalid_value")
    refused(post(server, "/detokenize", {"tokens": ["1"]}), 422, "tokens[0]")
    refused(post(server, "/tokenize", {"content": "a", "extra": 1}), 422, "extra")
    refused(post(server, "/tokenize", {"content": 5}), 422, "content")
    assert post(server, "/detokenize", {"tokens": []}).json() == {"content": ""}


# -- the declaration behind the docs -----------------------------------------------------------------------
def test_the_docs_table_is_generated_from_the_field_declaration():
    from pathlib import Path

    from aner_nb.api import embeddings, openai_fields

    doc = (Path(__file__).resolve().parents[1] / "docs" / "openai.md").read_text(encoding="utf-8")
    assert openai_fields.render_embeddings_doc(doc) == doc, (
        "run python -m aner_nb.api.openai_fields --write docs/openai.md")
    assert set(openai_fields.EMBEDDING_FIELDS) == set(embeddings.EmbeddingRequest.model_fields)
    with pytest.raises(ValueError, match="no generated-table region"):
        openai_fields.render_embeddings_doc("no region here")
