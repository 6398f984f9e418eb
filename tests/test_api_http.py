"""CORS (only when configured) and the Prometheus metrics (a registry per application), on a loopback server."""

from __future__ import annotations

import httpx
import pytest

from aner_nb import api
from aner_nb.llm.errors import ConfigurationError
from test_api import CHAT, TOKEN, base, batching, metric, serving, service  # noqa: F401 - base/batching are fixtures

ORIGIN = "http://notebook.example:8888"
PREFLIGHT = {"origin": ORIGIN, "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type"}


def test_no_cors_headers_unless_configured(batching):  # noqa: F811
    with serving(service(batching)) as server:
        r = httpx.get(f"{server.url}/health", headers={"origin": ORIGIN}, timeout=5)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers  # not an allowed origin
        r = httpx.options(f"{server.url}/v1/chat/completions", headers=PREFLIGHT, timeout=5)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_cors_for_the_configured_origins_only(batching):  # noqa: F811
    with serving(service(batching).cors(origins=[ORIGIN]).auth(bearer_token=TOKEN)) as server:
        r = httpx.options(f"{server.url}/v1/chat/completions", headers=PREFLIGHT, timeout=5)  # no token needed
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        auth = {"authorization": f"Bearer {TOKEN}", "origin": ORIGIN}
        r = httpx.post(f"{server.url}/v1/chat/completions", headers=auth, timeout=10,
                       json={"messages": [CHAT], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        refused = httpx.post(f"{server.url}/chat", headers={"origin": ORIGIN}, json={"prompt": "x"}, timeout=5)
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
        other = httpx.get(f"{server.url}/health", headers={"origin": "http://elsewhere.example"}, timeout=5)
        assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
        r = httpx.options(f"{server.url}/chat", headers={**PREFLIGHT, "origin": "http://elsewhere.example"}, timeout=5)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_cors_origins_are_checked():
    for bad in (["ftp://x"], ["http://x/path"], ["notanorigin"], "http://x"):
        with pytest.raises(ConfigurationError):
            api.app("t").cors(origins=bad)
    assert api.app("t").cors(origins=["*", "https://a.example", "https://a.example"]).cors_origins == (
        "*", "https://a.example")


def test_metrics_histograms_counters_and_gauges(batching):  # noqa: F811
    with serving(service(batching)) as server:
        assert httpx.post(f"{server.url}/chat", json={"prompt": "x", "max_tokens": 5}, timeout=10).status_code == 200
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3},
                          timeout=10).status_code == 200
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=10,
                          json={"messages": [CHAT], "max_tokens": 4, "stream": True}) as s:
            s.read()
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
        for route in ("/chat", "/v1/completions", "/v1/chat/completions"):
            assert metric(text, "aner_http_request_duration_seconds_count", route=route) == 1
            assert metric(text, "aner_http_time_to_first_token_seconds_count", route=route) == 1
            assert metric(text, "aner_http_request_duration_seconds_bucket", route=route, le="+Inf") == 1
        for family in ("aner_prefill_duration_seconds", "aner_decode_duration_seconds", "aner_queue_duration_seconds"):
            assert f"# TYPE {family} histogram" in text
            assert metric(text, f"{family}_count", model=batching.name) == 3
        assert metric(text, "aner_completion_tokens_total", model=batching.name) == 12
        assert metric(text, "aner_requests_total", model=batching.name) == 3
        assert metric(text, "aner_active_sequences", model=batching.name) == 0
        assert metric(text, "aner_scheduler_completed_total", model=batching.name) >= 3
        assert metric(text, "process_resident_memory_bytes") > 10 * 2**20


def test_each_application_has_its_own_registry(batching):  # noqa: F811
    with serving(service(batching)) as one, serving(service(batching)) as two:
        assert httpx.post(f"{one.url}/chat", json={"prompt": "x", "max_tokens": 2}, timeout=10).status_code == 200
        first = httpx.get(f"{one.url}/metrics", timeout=5).text
        second = httpx.get(f"{two.url}/metrics", timeout=5).text
        assert metric(first, "aner_http_requests_total", route="/chat", code="200") == 1
        assert 'route="/chat",code="200"' not in second and 'code="200",route="/chat"' not in second
        assert metric(second, "aner_completion_tokens_total", model=batching.name) == 0
