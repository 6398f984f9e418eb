"""SSE keep-alive comments: sent while a stream has no text yet, off when configured so, seen through nginx.

A request "waits" here by queueing behind a long greedy stream on a
batching lease with one sequence (``with_batching(1)``): no text can come
until the first stream is closed, which is the situation of a long prefill
as a client or proxy sees it (headers sent, then silence).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
import types

import httpx
import pytest

from test_api import CHAT, LONG, _hold, base, healthy, serving, service, single, wait_until  # noqa: F401 - fixtures

WAITING = {"messages": [CHAT], "max_tokens": 4, "stream": True, "temperature": 0}
COMMENTS = 3  # keep-alive comments a queued stream must show before its first text


@contextlib.contextmanager
def held(url, streams=2):
    """``streams`` long greedy streams on a one-sequence lease: the first decodes, the rest queue behind it."""
    holds = [_hold(types.SimpleNamespace(url=url)) for _ in range(streams)]
    try:
        yield
    finally:
        for client, response in holds:
            response.close()
            client.close()


@contextlib.contextmanager
def queued(url):
    """A short streamed request (queued behind the held ones); yields its line iterator."""
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=WAITING) as response:
            assert response.status_code == 200, response.read()
            yield response.iter_lines()


def comments_before_text(lines, enough=COMMENTS):
    """Read ``lines`` until ``enough`` keep-alive comments or a text piece; returns the lines read."""
    read = []
    for line in lines:
        read.append(line)
        if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
            break
        if sum(x == ": keep-alive" for x in read) >= enough:
            break
    return read


def test_keepalive_comments_while_queued_and_leaving_still_cancels(single):  # noqa: F811
    before = single.stats()
    with serving(service(single, max_tokens=LONG).sse(keepalive_s=0.1)) as server:
        with held(server.url), queued(server.url) as lines:
            read = comments_before_text(lines)
            assert [x for x in read if x.startswith(":")] == [": keep-alive"] * COMMENTS, read
        # the queued client left while waiting (then the held ones): each was cancelled, none completed
        wait_until(lambda: single.stats().cancelled == before.cancelled + 3, what="the requests to be cancelled")
        wait_until(lambda: healthy(server) and single.stats().active == 0, what="the slots to be freed")
        assert single.stats().completed == before.completed


def test_text_follows_the_comments_once_admitted(single):  # noqa: F811
    with serving(service(single, max_tokens=LONG).sse(keepalive_s=0.1)) as server:
        with contextlib.ExitStack() as holds:
            holds.enter_context(held(server.url, streams=1))
            with queued(server.url) as lines:
                read = comments_before_text(lines, enough=2)
                holds.close()  # the held stream goes: the queued one is admitted
                rest = [x for x in lines if x]
        assert ": keep-alive" in read and rest[-1] == "data: [DONE]"
        assert any('"finish_reason":"length"' in x for x in rest)


def test_no_comments_when_keepalive_is_off(single):  # noqa: F811
    with serving(service(single, max_tokens=LONG).sse(keepalive_s=0)) as server:
        with contextlib.ExitStack() as holds:
            holds.enter_context(held(server.url, streams=1))
            with queued(server.url) as lines:
                first = next(lines)  # the opening chunk, sent at once
                time.sleep(0.5)
                holds.close()
                rest = [x for x in lines if x]
        assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
        assert not any(x.startswith(":") for x in rest)


def test_keepalive_comments_pass_through_nginx(llama_path, tmp_path):
    """One replica (one sequence, 0.1 s keep-alive) behind nginx: a queued stream's comments reach the client."""
    nginx = pytest.importorskip("test_api_nginx")
    if nginx.NGINX is None:
        pytest.skip("nginx is not installed (apt-get install -y nginx)")
    replica = subprocess.Popen(
        [sys.executable, "-m", "aner_nb", "serve", str(llama_path), "--port", "0", "--context", "2048",
         "--max-sequences", "1", "--max-tokens", str(LONG), "--threads", "1", "--sse-keepalive", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        match = re.search(r"at http://127\.0\.0\.1:(\d+)", replica.stdout.readline())
        assert match, replica.stderr.read() if replica.poll() is not None else ""
        port = int(match.group(1))
        prefix = tmp_path / "nginx"
        prefix.mkdir()
        listen = nginx.free_port()
        conf = prefix / "nginx.conf"
        conf.write_text(nginx.CONFIG.format(prefix=prefix, port=listen, a=port, b=port))
        proxy = subprocess.Popen([nginx.NGINX, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        gateway = f"http://127.0.0.1:{listen}"
        try:
            nginx.wait_until(lambda: httpx.get(f"{gateway}/health", timeout=2).status_code == 200, what="nginx")
            with held(f"http://127.0.0.1:{port}"), queued(gateway) as lines:
                read = comments_before_text(lines)
            assert [x for x in read if x.startswith(":")] == [": keep-alive"] * COMMENTS, read
        finally:
            nginx.stop(proxy)
    finally:
        nginx.stop(replica)


def test_a_stream_closed_just_as_its_source_ended_leaves_no_unretrieved_task():
    """The client leaves while a keep-alive was out and the source has meanwhile ended: the finished
    ``__anext__`` task's StopAsyncIteration is retrieved, so asyncio logs nothing."""
    import asyncio
    import gc

    from aner_nb.api.sse import with_keepalive

    reported: list = []

    async def source():
        await asyncio.sleep(0.05)
        return
        yield  # pragma: no cover - an async generator that ends without an item

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx))
        stream = with_keepalive(source(), keepalive_s=0.01)
        assert await stream.__anext__() is None  # a keep-alive while the source still waits
        await asyncio.sleep(0.1)  # the source ends meanwhile; nobody asks for the next item
        await stream.aclose()  # the client went away
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert not [c for c in reported if "never retrieved" in str(c.get("message", ""))], reported
