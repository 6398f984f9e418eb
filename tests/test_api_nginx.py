"""Two replicas (``aner-nb serve`` processes) behind nginx on loopback: requests spread, then fail over.

nginx comes from the system packages (``apt-get install -y nginx``; ``.ci/run``
installs it). It runs in the foreground with its own prefix, config, pid and
logs under the test's temporary directory, listening on 127.0.0.1 only, and
is stopped by the test, as are the replicas. Skipped when no nginx binary is
found.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install -y nginx)")

CONFIG = """\
daemon off;
master_process on;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    client_max_body_size 1m;
    client_body_buffer_size 1m;

    upstream aner_replicas {{
        server 127.0.0.1:{a} max_fails=1 fail_timeout=30s;
        server 127.0.0.1:{b} max_fails=1 fail_timeout=30s;
        keepalive 4;
        keepalive_timeout 4s;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://aner_replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;  # the replicas answer loopback Host names only
            proxy_next_upstream error timeout http_502 http_503 non_idempotent;
            proxy_next_upstream_tries 2;
            proxy_connect_timeout 2s;
            proxy_read_timeout 130s;
            proxy_buffering off;
            add_header X-Upstream $upstream_addr always;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    return proc.returncode


@pytest.fixture
def replicas(llama_path):
    """Two independent ``aner-nb serve`` processes on free loopback ports: [(process, port), ...]."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "aner_nb", "serve", str(llama_path), "--port", "0", "--context", "512",
             "--max-sequences", "2", "--max-tokens", "64", "--threads", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]
    try:
        out = []
        for proc in procs:
            line = proc.stdout.readline()
            match = re.search(r"at http://127\.0\.0\.1:(\d+)", line)
            assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
            out.append((proc, int(match.group(1))))
        yield out
    finally:
        for proc in procs:
            stop(proc)


@pytest.fixture
def gateway(replicas, tmp_path: Path):
    """nginx in the foreground, proxying 127.0.0.1:<port> to both replicas; yields its URL."""
    prefix = tmp_path / "nginx"
    prefix.mkdir()
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(CONFIG.format(prefix=prefix, port=port, a=replicas[0][1], b=replicas[1][1]))
    proc = subprocess.Popen([NGINX, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, (prefix / "error.log").read_text()
            return httpx.get(f"{url}/health", timeout=2).status_code == 200

        wait_until(up, what="nginx to accept connections")
        yield url
    finally:
        stop(proc, signal.SIGQUIT)  # graceful nginx shutdown


def test_requests_spread_over_replicas_and_fail_over(replicas, gateway):
    ports = {str(port) for _, port in replicas}
    with httpx.Client(base_url=gateway, timeout=20) as client:
        used = []
        for i in range(8):
            r = client.post("/chat", json={"prompt": f"question {i}", "max_tokens": 4})
            assert r.status_code == 200, r.text
            used.append(r.headers["x-upstream"].rsplit(":", 1)[1])
        assert set(used) == ports  # both replicas answered

        for _, port in replicas:  # each replica counted its own share: nothing is shared between them
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            served = re.search(r'aner_http_requests_total\{(?=[^}]*route="/chat")(?=[^}]*code="200")[^}]*\} ([\d.e+]+)', text)
            assert served and float(served.group(1)) == used.count(str(port))

        # SSE passes the gateway unbuffered: the events arrive in several reads while the answer is
        # being generated, not as one body at the end (what proxy buffering would deliver). 64 tokens: an
        # 8-token answer of the tiny model can be written in ~1 ms, and once arrived in 2 reads on CI.
        reads = []
        with client.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 64, "stream": True}) as s:
            for raw in s.iter_raw():
                if raw:
                    reads.append((time.monotonic(), raw))
        body = b"".join(raw for _, raw in reads).decode()
        lines = [line for line in body.splitlines() if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]" and len(lines) >= 4, body[:300]
        first_event = next(t for t, raw in reads if b"data: " in raw)
        assert len(reads) >= 3 and reads[-1][0] > first_event

        down_proc, down_port = replicas[0]
        assert stop(down_proc) == 0  # SIGTERM: the replica shuts down cleanly
        after = []
        for i in range(6):
            r = client.post("/chat", json={"prompt": f"after {i}", "max_tokens": 4})
            assert r.status_code == 200, r.text
            after.append(r.headers["x-upstream"].rsplit(":", 1)[1])
        assert set(after) == {str(replicas[1][1])}  # only the survivor answers
        assert client.get("/health").status_code == 200
