"""HTTP edges on a real loopback server, driven with raw sockets: oversized, slow, malformed and non-UTF-8
requests, and clients that disconnect at every phase of a streamed answer.

Each test ends by checking the server is healthy (``/health`` ok, nothing in flight) and still answers.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import struct
import threading
import time

import httpx
import pytest

from test_api import (CHAT, LONG, base, batching, healthy, metric, serving, service, single,  # noqa: F401 - fixtures
                      sse_events, wait_until)

BIG = 5 << 20  # five times the default body bound


# -- raw HTTP/1.1 over a socket ---------------------------------------------------------------------------------
def connect(server, timeout=10.0):
    return socket.create_connection((server.host, server.port), timeout=timeout)


def head(method, path, *, length=None, chunked=False, extra=b""):
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Content-Type: application/json"]
    if length is not None:
        lines.append(b"Content-Length: %d" % length)
    if chunked:
        lines.append(b"Transfer-Encoding: chunked")
    return b"\r\n".join(lines) + b"\r\n" + extra + b"\r\n"


def parse(data):
    """(status, headers, body) of the first response in ``data`` (its body by Content-Length)."""
    top, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    length = int(headers.get("content-length", len(rest)))
    return int(status_line.split()[1]), headers, rest[:length]


def read_response(sock):
    """Read one response: its head, then Content-Length bytes of body (or up to the end)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    status, headers, body = parse(data)
    want = int(headers.get("content-length", 0))
    while len(body) < want:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def send_while_reading(sock, pieces):
    """Send every piece (the body in 64 KiB writes), collecting what the server answers meanwhile."""
    received = b""
    for piece in pieces:
        sock.sendall(piece)
        while select.select([sock], [], [], 0)[0]:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    return received


def read_to_end(sock, received=b""):
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return received
        received += chunk


def error_of(body):
    return json.loads(body)["error"]


def still_serves(server):
    assert healthy(server)
    r = httpx.post(f"{server.url}/chat", json={"prompt": "still there?", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200, r.text


# -- oversized, non-UTF-8, malformed ---------------------------------------------------------------------------
def test_an_oversized_body_gets_a_413_the_client_can_read(batching):
    """The client sends all of a 5 MB body before it reads (as most clients do): the answer is not lost to a reset."""
    body = b'{"prompt": "' + b"x" * BIG + b'"}'
    pieces = [body[i:i + 65536] for i in range(0, len(body), 65536)]
    chunked = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]
    with serving(service(batching)) as server:
        for first, rest in ((head("POST", "/chat", length=len(body)), pieces),  # declared: refused unread
                            (head("POST", "/chat", chunked=True), chunked)):  # refused once past the bound
            with connect(server) as sock:
                received = send_while_reading(sock, [first, *rest])  # no ECONNRESET while sending
                status, headers, answer = parse(read_to_end(sock, received))  # nor before the answer is read
            assert status == 413 and headers["connection"] == "close"
            assert error_of(answer)["code"] == "request_too_large" and "1048576 bytes" in error_of(answer)["message"]
        still_serves(server)


def test_a_body_that_is_not_utf8_is_answered_400_invalid_encoding(batching):
    with serving(service(batching)) as server, connect(server) as sock:
        latin1 = '{"prompt": "café"}'.encode("latin-1")
        sock.sendall(head("POST", "/chat", length=len(latin1)) + latin1)
        status, _, body = read_response(sock)
        error = error_of(body)
        assert status == 400 and error["code"] == "invalid_encoding" and error["type"] == "invalid_request_error"
        assert "0xe9 at offset 15" in error["message"] and "UTF-8" in error["message"]

        truncated = b'{"prompt": "caf'
        sock.sendall(head("POST", "/chat", length=len(truncated)) + truncated)  # the same connection still works
        status, _, body = read_response(sock)
        assert status == 400 and error_of(body)["code"] == "invalid_json"

        utf8 = json.dumps({"prompt": "café ☕", "max_tokens": 2}, ensure_ascii=False).encode()
        sock.sendall(head("POST", "/chat", length=len(utf8)) + utf8)
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
        still_serves(server)


@pytest.mark.parametrize("framing, status, code, reason", [
    (b"zz\r\n{}\r\n0\r\n\r\n", 400, "malformed_request", "chunk header"),  # a chunk size that is not hex
    (b"2\r\n{}XX0\r\n\r\n", 400, "malformed_request", ""),  # chunk data not followed by CRLF
    (b"-5\r\n", 400, "malformed_request", "chunk header"),
])
def test_malformed_chunked_encoding_is_answered_400_in_json(batching, framing, status, code, reason):
    with serving(service(batching)) as server:
        for pause in (0.0, 0.3):  # at once, and once the application is waiting for the rest of the body
            with connect(server) as sock:
                sock.sendall(head("POST", "/chat", chunked=True))
                time.sleep(pause)
                sock.sendall(framing)
                got, headers, body = parse(read_to_end(sock))
            error = error_of(body)
            assert got == status and headers["connection"] == "close" and error["code"] == code, body
            assert error["message"].startswith("malformed HTTP request") and reason in error["message"]
        still_serves(server)


def test_an_oversized_request_head_is_answered_431(batching):
    """h11 bounds a head still incomplete (16 KiB): sent in pieces, past the bound it is refused."""
    filler = b"X-Filler: " + b"a" * (64 << 10) + b"\r\n"
    with serving(service(batching)) as server, connect(server) as sock:
        received = send_while_reading(sock, [head("GET", "/health")[:-2]] + [
            filler[i:i + 4096] for i in range(0, len(filler), 4096)])  # the rest is read and dropped: no reset
        status, _, body = parse(read_to_end(sock, received))
        assert status == 431 and error_of(body)["code"] == "header_too_large"
        still_serves(server)


def test_a_whole_request_head_over_the_bound_is_answered_431_too(batching):
    """A head that arrives complete in one write bypassed h11's bound (5,000 headers, 52.7 KiB, answered 200)."""
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 4) for i in range(5000))
    with serving(service(batching)) as server, connect(server) as sock:
        sock.sendall(head("GET", "/health")[:-2] + many + b"\r\n")
        status, _, body = read_response(sock)
        assert status == 431 and error_of(body)["code"] == "header_too_large" and "above the" in error_of(body)["message"]
    with serving(service(batching)) as server, connect(server) as sock:
        fits = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 4) for i in range(500))  # 6 KB: under the bound
        sock.sendall(head("GET", "/health")[:-2] + fits + b"\r\n")
        assert read_response(sock)[0] == 200
        still_serves(server)


# -- slow clients ----------------------------------------------------------------------------------------------
def _trickle(sock, data, gap, until):
    """Send ``data`` a byte at a time every ``gap`` seconds until the server closes; what it answered, or None."""
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            break
        if select.select([sock], [], [], gap)[0] or time.monotonic() > until:
            break
    try:
        return read_to_end(sock) if time.monotonic() <= until else None
    except OSError:
        return b""  # reset: closed all the same


def test_slow_request_heads_and_bodies_are_cut_off_while_others_are_served(batching):
    with serving(service(batching).read_timeouts(header_s=1.0, body_s=1.5)) as server:
        silent = connect(server)  # sends nothing at all
        slow_head = connect(server)
        slow_head.sendall(b"POST /chat HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow_body = connect(server)
        slow_body.sendall(head("POST", "/chat", length=200) + b'{"prompt": ')
        unread = connect(server)  # a body nothing reads: /health answers at once, the body keeps trickling
        unread.sendall(head("GET", "/health", length=200))
        results: dict[str, bytes | None] = {}

        def run(name, sock, data):
            results[name] = _trickle(sock, data, gap=0.2, until=time.monotonic() + 20)

        threads = [threading.Thread(target=run, args=("head", slow_head, b"X-Slow: " + b"a" * 200)),
                   threading.Thread(target=run, args=("body", slow_body, b'"' + b"a" * 199)),
                   threading.Thread(target=run, args=("unread", unread, b"a" * 200))]
        for t in threads:
            t.start()
        try:
            r = httpx.post(f"{server.url}/chat", json={"prompt": "meanwhile", "max_tokens": 4}, timeout=10)
            assert r.status_code == 200  # the slow connections hold nothing others need
            silent.settimeout(20)
            assert silent.recv(100) == b""  # closed, without an answer to a request it never sent
        finally:
            for t in threads:
                t.join(30)
            for sock in (silent, slow_head, slow_body, unread):
                sock.close()
        closed = results["head"]  # answered a bare 408 then closed (or reset, had a byte crossed the close)
        assert closed is not None and (closed == b"" or closed.startswith(b"HTTP/1.1 408")), closed
        status, headers, body = parse(results["body"])
        assert status == 408 and headers["connection"] == "close" and error_of(body)["code"] == "request_timeout"
        status, _, body = parse(results["unread"])  # answered, then closed when its body did not finish
        assert status == 200 and json.loads(body)["status"] == "ok"
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
        assert metric(text, "aner_http_requests_total", route="/chat", code="408") == 1
        still_serves(server)


def test_read_timeouts_are_checked():
    from aner_nb import api
    from aner_nb.llm.errors import ConfigurationError

    for bad in (0, -1, 0.01, 1e9, float("nan"), True, "5"):
        with pytest.raises(ConfigurationError):
            api.app("t").read_timeouts(header_s=bad)
        with pytest.raises(ConfigurationError):
            api.app("t").read_timeouts(body_s=bad)
    built = api.app("t").read_timeouts(header_s=2, body_s=3)
    assert (built.header_timeout_s, built.body_timeout_s) == (2.0, 3.0)


# -- disconnects at every phase of a streamed answer -------------------------------------------------------------
def _stream_request(max_tokens, include_usage=False):
    body = json.dumps({"messages": [CHAT], "max_tokens": max_tokens, "stream": True, "temperature": 0,
                       "stream_options": {"include_usage": include_usage}}).encode()
    return head("POST", "/v1/chat/completions", length=len(body)) + body


def _reset(sock):
    """Close with a reset (SO_LINGER 0), as a killed client does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _read_until(sock, marker, data=b""):
    while marker not in data:
        chunk = sock.recv(4096)
        assert chunk, f"closed before {marker!r}: {data[-300:]!r}"
        data += chunk
    return data


def _fresh(base_lease):
    """What a request made on a fresh, idle service answers (greedy): the library's own output."""
    return base_lease.generate("after a disconnect", max_tokens=8, seed=0).text


def _next_equals_fresh(server, model, reference):
    wait_until(lambda: healthy(server), what="the slot to be free")
    wait_until(lambda: model.stats().active == 0 and model.stats().waiting == 0, what="an idle scheduler")
    r = httpx.post(f"{server.url}/chat", json={"prompt": "after a disconnect", "max_tokens": 8}, timeout=10)
    assert r.status_code == 200 and r.json()["text"] == reference


def test_a_client_that_leaves_at_any_phase_of_a_stream_leaves_nothing_behind(single, base):  # noqa: F811
    reference = _fresh(base)
    before = single.stats()
    with serving(service(single, max_tokens=LONG).sse(keepalive_s=0.2)) as server:
        # before the first token: the request is sent and the client is gone at once
        sock = connect(server)
        sock.sendall(_stream_request(LONG))
        _reset(sock)
        wait_until(lambda: single.stats().cancelled == before.cancelled + 1, what="the request to be cancelled")
        _next_equals_fresh(server, single, reference)

        # while queued: one stream decodes, a second waits in the scheduler's queue and leaves
        holder = connect(server)
        holder.sendall(_stream_request(LONG))
        _read_until(holder, b'"content":"')
        queued = connect(server)
        queued.sendall(_stream_request(LONG))
        _read_until(queued, b": keep-alive")  # admitted, answered 200, and still waiting for a sequence
        assert single.stats().waiting == 1
        _reset(queued)
        wait_until(lambda: single.stats().waiting == 0, what="the queued request to leave the queue")
        assert single.stats().active == 1  # the holder decodes on

        # mid-stream
        _reset(holder)
        wait_until(lambda: single.stats().cancelled == before.cancelled + 3, what="both to be cancelled")
        _next_equals_fresh(server, single, reference)

        # at the end: the last text chunk has come, the finish, usage and [DONE] chunks have not been read
        sock = connect(server)
        sock.sendall(_stream_request(6, include_usage=True))
        _read_until(sock, b'"finish_reason":"length"')
        _reset(sock)
        _next_equals_fresh(server, single, reference)
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
        assert metric(text, "aner_disconnects_total") == 3
    after = single.stats()
    assert after.cancelled == before.cancelled + 3 and after.completed == before.completed + 4


def test_a_client_gone_while_usage_and_done_are_sent_leaves_nothing_behind(single, base):  # noqa: F811
    """At the ASGI level the disconnect can be placed exactly: reported as the usage chunk is sent."""
    reference = _fresh(base)
    app = service(single, max_tokens=64).asgi()
    body = json.dumps({"messages": [CHAT], "max_tokens": 6, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()

    async def run() -> list[bytes]:
        gone = asyncio.Event()
        sent: list[bytes] = []
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if gone.is_set():
                return  # as uvicorn does once its client is gone: the message is dropped
            if message["type"] == "http.response.body":
                sent.append(message.get("body", b""))
                if b'"usage"' in message.get("body", b""):
                    gone.set()

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                                                                  (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        await app(scope, receive, send)
        return sent

    sent = asyncio.run(run())
    assert any(b'"usage"' in piece for piece in sent) and not any(b"[DONE]" in piece for piece in sent)
    mount = app.state.mounts[0]
    wait_until(lambda: mount.gate.in_flight == 0, what="the gate to be left")
    assert single.stats().active == 0 and single.stats().waiting == 0
    with serving(service(single, max_tokens=64)) as server:
        _next_equals_fresh(server, single, reference)


def test_serve_takes_the_read_timeouts_from_flags_and_environment(llama_path, monkeypatch, capsys):
    from aner_nb.api import cli

    with pytest.raises(SystemExit) as ended:
        cli.main([str(llama_path), "--header-timeout", "0"])
    assert ended.value.code == 2 and "--header-timeout: expected seconds in 0.1..3600" in capsys.readouterr().err
    monkeypatch.setenv("ANER_NB_BODY_TIMEOUT", "2.5")
    p = cli.parser()
    args = cli.resolve(p, p.parse_args([str(llama_path), "--header-timeout", "4"]))
    builder, _ = cli.check(args)
    assert (builder.header_timeout_s, builder.body_timeout_s) == (4.0, 2.5)
