"""Who may address the service: Host allow-list, Origin check, JSON-only POST bodies, several API keys.

The policies are checked as plain functions first, then on a real loopback
server (the tiny llama fixture, one batching lease) with httpx and with the
clients people use against it: the ``openai`` SDK, LangChain's ``ChatOpenAI``
and curl with its default headers. A refused request must not start a
generation: ``aner_requests_total`` (admissions) is compared before and after.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest

from aner_nb import api
from aner_nb.api import cli
from aner_nb.api.keys import MAX_FILE_BYTES, read_key_file
from aner_nb.api.origin import HostPolicy, OriginPolicy, check_host_pattern, normalize_host
from aner_nb.llm.errors import ConfigurationError
from test_api import CHAT, base, batching, metric, serving, service  # noqa: F401 - base/batching are fixtures

EVIL = "http://evil.example"
KEYS = ("key-one-0123456789", "key-two-abcdefghij")


def admitted(server) -> float:
    return metric(httpx.get(f"{server.url}/metrics", timeout=5).text, "aner_requests_total")


def refusal(r, status, code):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"], error
    return error


# -- the policies, without a server ------------------------------------------------------------------
def test_host_names_are_normalized_and_malformed_ones_are_none():
    assert normalize_host("LocalHost.:11435") == "localhost"
    assert normalize_host("[::1]:8080") == "::1" and normalize_host("127.0.0.1") == "127.0.0.1"
    for bad in ("", "a b", "::1", "[::1", "[::1]x", "host:99999", "host:x", "user@host", "a/b"):
        assert normalize_host(bad) is None, bad


def test_host_policy_on_loopback_and_elsewhere():
    loop = HostPolicy("127.0.0.1")
    for ok in ("localhost", "app.localhost", "127.0.0.1", "127.8.9.10", "::1"):
        assert loop.permits(ok), ok
    for refused in ("evil.example", "localhost.evil.example", "10.0.0.5", "0.0.0.0"):
        assert not loop.permits(refused), refused
    listed = HostPolicy("127.0.0.1", (check_host_pattern("LLM.Lab.Example."), check_host_pattern("*.corp.example")))
    assert listed.permits("llm.lab.example") and listed.permits("a.b.corp.example")
    assert not listed.permits("corp.example") and not listed.permits("xcorp.example")
    assert HostPolicy("127.0.0.1", ("*",)).permits("anything.example")
    wide = HostPolicy("0.0.0.0")
    assert wide.permits("10.0.0.5") and wide.permits("fe80::1") and not wide.permits("evil.example")
    named = HostPolicy("gpu-box.lan")
    assert named.permits("gpu-box.lan") and not named.permits("evil.example")
    for bad in ("http://x", "x:80", "a..b", "", "*x", "é.example"):
        with pytest.raises(ValueError):
            check_host_pattern(bad)


def test_origin_policy_allows_cors_origins_and_the_request_s_own_origin_only():
    none = OriginPolicy()
    assert none.permits("http://127.0.0.1:8000", "127.0.0.1:8000", "http")
    assert none.permits("http://localhost", "localhost:80", "http")
    assert not none.permits("http://127.0.0.1:8001", "127.0.0.1:8000", "http")  # another port: another origin
    assert not none.permits("https://127.0.0.1:8000", "127.0.0.1:8000", "http")
    assert not none.permits(EVIL, "127.0.0.1:8000", "http") and not none.permits("null", "127.0.0.1:8000", "http")
    cors = OriginPolicy(("https://nb.example",))
    assert cors.permits("https://NB.example", "127.0.0.1:8000", "http") and not cors.permits(EVIL, None, "http")
    assert OriginPolicy(("*",)).permits("null", None, "http")


def test_key_files_are_bounded_and_errors_never_show_a_key(tmp_path):
    good = tmp_path / "keys"
    good.write_text(f"# service keys\n\n  {KEYS[0]}  \n{KEYS[1]}\n{KEYS[0]}\n")
    assert read_key_file(good) == KEYS
    cases = {"short": "# c\nshort-1\n", "spaced": "has a space in it\n", "empty": "# nothing\n\n",
             "big": "k" * 20 + "\n" + "x" * MAX_FILE_BYTES}
    messages = {}
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValueError) as caught:
            read_key_file(path)
        messages[name] = str(caught.value)
    assert "line 2" in messages["short"] and "short-1" not in messages["short"]
    assert "has a space" not in messages["spaced"] and "line 1" in messages["spaced"]
    assert "no keys" in messages["empty"] and f"larger than {MAX_FILE_BYTES}" in messages["big"]
    with pytest.raises(ValueError, match="no such file|No such file"):
        read_key_file(tmp_path / "missing")
    with pytest.raises(ConfigurationError, match="line 2"):
        api.app("t").auth(api_key_file=tmp_path / "short")


def test_builders_check_hosts_and_connection_limits():
    assert api.app("t").allowed_hosts(["A.example", "a.example", "*"]).allowed_host_names == ("a.example", "*")
    for bad in (["http://a.example"], "a.example", ["a.example:80"]):
        with pytest.raises(ConfigurationError):
            api.app("t").allowed_hosts(bad)
    for bad in (dict(max_per_client=-1), dict(max_total=0), dict(max_per_client=True)):
        with pytest.raises(ConfigurationError):
            api.app("t").connections(**bad)
    app = api.app("t").auth(api_keys=list(KEYS))
    assert app.authenticated and KEYS[0] not in repr(app)


def test_cli_reads_hosts_keys_origins_and_connection_limits(llama_path, tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    monkeypatch.setenv("ANER_NB_ALLOWED_HOSTS", "ignored.example")
    p = cli.parser()
    args = cli.resolve(p, p.parse_args([str(llama_path), "--api-key-file", str(keys), "--allowed-hosts",
                                        "llm.example,*.lab.example", "--cors-origins", "http://a.example,http://b.example",
                                        "--cors-origin", "http://c.example", "--max-connections-per-client", "4",
                                        "--max-connections", "100"]))
    builder, _ = cli.check(args)
    assert builder.api_keys == KEYS and builder.allowed_host_names == ("llm.example", "*.lab.example")
    assert builder.cors_origins == ("http://a.example", "http://b.example", "http://c.example")
    assert builder.max_connections_per_client == 4 and builder.max_connections == 100
    defaults = cli.check(cli.resolve(p, p.parse_args([str(llama_path)])))[0]
    assert defaults.allowed_host_names == ("ignored.example",) and defaults.max_connections is None
    assert defaults.max_connections_per_client == 32 and not defaults.authenticated
    bad = cli.resolve(p, p.parse_args([str(llama_path), "--api-key-file", str(tmp_path / "none")]))
    with pytest.raises(ConfigurationError, match="API key file"):
        cli.check(bad)


# -- on a server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(batching):  # noqa: F811 - the imported fixture
    with serving(service(batching, max_tokens=16)) as running:
        yield running


def test_a_foreign_host_is_refused_and_loopback_names_are_served(server):
    before = admitted(server)
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"host": "evil.example"},
                   json={"model": "m", "messages": [CHAT], "max_tokens": 2}, timeout=10)
    assert "evil.example" in refusal(r, 403, "host_not_allowed")["message"]
    refusal(httpx.get(f"{server.url}/health", headers={"host": "evil.example:11435"}, timeout=5), 403,
            "host_not_allowed")
    refusal(httpx.get(f"{server.url}/health", headers={"host": "not a host"}, timeout=5), 403, "host_not_allowed")
    for host in ("localhost", f"localhost:{server.port}", "127.0.0.1", f"[::1]:{server.port}", "nb.localhost",
                 "LOCALHOST."):
        assert httpx.get(f"{server.url}/health", headers={"host": host}, timeout=5).status_code == 200, host
    assert admitted(server) == before
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert metric(metrics, "aner_http_requests_total", route="/v1/chat/completions", code="403") >= 1


def test_a_foreign_origin_is_refused_and_the_service_s_own_origin_is_served(server):
    before = admitted(server)
    body = {"prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{server.url}/chat", headers={"origin": EVIL}, json=body, timeout=10)
    refusal(r, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in r.headers
    refusal(httpx.get(f"{server.url}/v1/models", headers={"origin": "null"}, timeout=5), 403, "origin_not_allowed")
    preflight = httpx.options(f"{server.url}/chat", headers={"origin": EVIL, "access-control-request-method": "POST"},
                              timeout=5)
    refusal(preflight, 403, "origin_not_allowed")
    assert admitted(server) == before
    own = httpx.post(f"{server.url}/chat", headers={"origin": server.url}, json=body, timeout=30)
    assert own.status_code == 200 and admitted(server) == before + 1


def test_post_bodies_must_be_declared_json(server):
    before = admitted(server)
    body = b'{"prompt": "hi", "max_tokens": 2}'
    for declared in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                     "multipart/form-data; boundary=x", "application/json; charset=latin-1", "application/jsonx",
                     None):
        headers = {"content-type": declared} if declared else {}
        r = httpx.post(f"{server.url}/chat", content=body, headers=headers, timeout=10)
        error = refusal(r, 415, "unsupported_media_type")
        assert "application/json" in error["message"], declared
    assert admitted(server) == before
    for declared in ("application/json", "Application/JSON; charset=\"utf-8\""):
        r = httpx.post(f"{server.url}/chat", content=body, headers={"content-type": declared}, timeout=30)
        assert r.status_code == 200, (declared, r.text)
    assert admitted(server) == before + 2


def test_curl_with_its_default_headers(server):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    data = '{"model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}'
    ok = subprocess.run([curl, "-s", "-w", "\n%{http_code}", f"{server.url}/v1/chat/completions",
                         "-H", "Content-Type: application/json", "-d", data],
                        capture_output=True, text=True, timeout=60)
    text, status = ok.stdout.rsplit("\n", 1)
    assert status == "200" and '"chat.completion"' in text, ok
    form = subprocess.run([curl, "-s", "-w", "\n%{http_code}", f"{server.url}/v1/chat/completions", "-d", data],
                          capture_output=True, text=True, timeout=60)  # curl's default: a form body
    assert form.stdout.rsplit("\n", 1)[1] == "415" and "unsupported_media_type" in form.stdout, form


def test_cors_origins_opt_browser_pages_in(batching):  # noqa: F811
    allowed = "http://nb.example:8888"
    with serving(service(batching, max_tokens=8).cors(origins=[allowed]).allowed_hosts(["llm.lab.example"])) as s:
        pre = httpx.options(f"{s.url}/v1/chat/completions", timeout=5, headers={
            "origin": allowed, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == allowed
        r = httpx.post(f"{s.url}/v1/chat/completions", headers={"origin": allowed},
                       json={"model": "m", "messages": [CHAT], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed
        plain = httpx.post(f"{s.url}/chat", headers={"origin": allowed, "content-type": "text/plain"},
                           content=b'{"prompt": "x"}', timeout=10)
        refusal(plain, 415, "unsupported_media_type")  # an allowed origin still sends JSON
        refusal(httpx.get(f"{s.url}/health", headers={"origin": EVIL}, timeout=5), 403, "origin_not_allowed")
        assert httpx.get(f"{s.url}/health", headers={"host": "llm.lab.example"}, timeout=5).status_code == 200
        refusal(httpx.get(f"{s.url}/health", headers={"host": "other.lab.example"}, timeout=5), 403,
                "host_not_allowed")


@pytest.fixture(scope="module")
def keyed(batching, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text("# two keys\n" + "\n".join(KEYS) + "\n")
    path.chmod(0o600)
    with serving(service(batching, max_tokens=200).auth(api_key_file=path)) as running:
        yield running


def test_an_api_key_file_with_two_keys(keyed):
    body = {"prompt": "hi", "max_tokens": 2}
    for key in KEYS:
        r = httpx.post(f"{keyed.url}/chat", headers={"authorization": f"Bearer {key}"}, json=body, timeout=30)
        assert r.status_code == 200, r.text
    for wrong in (KEYS[0] + "x", KEYS[0][:-1], "Bearer", KEYS[0].upper()):
        r = httpx.post(f"{keyed.url}/chat", headers={"authorization": f"Bearer {wrong}"}, json=body, timeout=10)
        refusal(r, 401, "invalid_api_key")
    refusal(httpx.post(f"{keyed.url}/chat", json=body, timeout=10), 401, "invalid_api_key")
    assert httpx.get(f"{keyed.url}/health", timeout=5).status_code == 200  # open path
    schema = httpx.get(f"{keyed.url}/openapi.json", timeout=5).json()
    assert "bearer" in schema["components"]["securitySchemes"]


def test_the_openai_sdk_with_either_key(keyed):
    openai = pytest.importorskip("openai")
    for key in KEYS:
        client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=key, max_retries=0, timeout=30)
        answer = client.chat.completions.create(model="any", messages=[CHAT], max_tokens=4, seed=3)
        assert answer.object == "chat.completion" and answer.usage.completion_tokens <= 4
        streamed = client.chat.completions.create(model="any", messages=[CHAT], max_tokens=4, seed=3, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer.choices[0].message.content
    wrong = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="not-a-key-000", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_langchain_chat_openai(keyed):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=f"{keyed.url}/v1", api_key=KEYS[1], model="any", max_tokens=4,
                                       temperature=0, max_retries=0, timeout=30)
    message = chat.invoke("Tell me about the harbour.")
    assert isinstance(message.content, str)
    assert "".join(chunk.content for chunk in chat.stream("Tell me about the harbour.")) == message.content


def test_llm_serve_binds_loopback_with_the_checks_and_says_how_to_add_a_key(ip, llama_path, capsys, monkeypatch):
    from test_magics import load, run

    load(ip, llama_path)
    run(ip, "%llm batch base --as many --max-sequences 2")
    server = ip.run_line_magic("llm", "serve many --port 0")
    try:
        out = capsys.readouterr().out
        assert server.host == "127.0.0.1" and server.url in out and "--api-key-env" in out
        refusal(httpx.get(f"{server.url}/health", headers={"host": "evil.example"}, timeout=5), 403, "host_not_allowed")
        r = httpx.post(f"{server.url}/chat", content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"},
                       timeout=10)
        refusal(r, 415, "unsupported_media_type")
    finally:
        ip.run_line_magic("llm", "stop")
    monkeypatch.setenv("ANER_TEST_KEY", KEYS[0])
    keyed = ip.run_line_magic("llm", "serve many --port 0 --api-key-env ANER_TEST_KEY")
    try:
        assert "ANER_TEST_KEY" in capsys.readouterr().out
        body = {"prompt": "hi", "max_tokens": 2}
        refusal(httpx.post(f"{keyed.url}/chat", json=body, timeout=10), 401, "invalid_api_key")
        ok = httpx.post(f"{keyed.url}/chat", json=body, headers={"authorization": f"Bearer {KEYS[0]}"}, timeout=30)
        assert ok.status_code == 200
    finally:
        ip.run_line_magic("llm", "stop")
    monkeypatch.delenv("ANER_TEST_KEY")
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="ANER_TEST_KEY is unset"):
        ip.run_line_magic("llm", "serve many --port 0 --api-key-env ANER_TEST_KEY")
    assert os.environ.get("ANER_TEST_KEY") is None
