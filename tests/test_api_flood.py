"""Connection floods: one client's idle sockets cannot starve another client (real loopback server).

Linux routes all of 127.0.0.0/8 to the loopback interface, so binding a
client socket to ``127.0.0.2`` makes it a different client address from the
ordinary client on ``127.0.0.1``. Client A opens 200 connections and sends
nothing; client B then sends ordinary requests, which must all be answered
200 within their own (httpx) timeout. What happened to A's sockets is read
from the sockets themselves (an answer, then end of file) and from the
``/metrics`` connection counters. Every socket is closed by the test.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time

import httpx
import pytest

from aner_nb.api.connections import ConnectionRegistry, client_key
from test_api import base, batching, metric, serving, service, wait_until  # noqa: F401 - base/batching are fixtures

FLOOD = 200
ATTACKER = "127.0.0.2"
WAIT_S = 60.0  # a bound on waiting for the server to act on sockets (a failure guard, not a measurement)


def _can_bind(address: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


pytestmark = pytest.mark.skipif(not _can_bind(ATTACKER), reason=f"cannot bind a client socket to {ATTACKER}")


@contextlib.contextmanager
def flood(server, count=FLOOD):
    """``count`` connections from ATTACKER that send nothing; all closed afterwards."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((ATTACKER, 0))
            s.settimeout(WAIT_S)
            s.connect(("127.0.0.1", server.port))
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


def closed_by_server(socks, expected):
    """Read every socket until ``expected`` of them reached end of file (or a reset); returns (closed, answers)."""
    pending = {s.fileno(): s for s in socks}
    data = {fd: b"" for fd in pending}
    closed = set()
    deadline = time.monotonic() + WAIT_S
    while len(closed) < expected and time.monotonic() < deadline:
        ready, _, _ = select.select(list(pending), [], [], 1.0)  # select: fds above 1024 are not expected here
        for fd in ready:
            try:
                chunk = pending[fd].recv(65536)
            except ConnectionResetError:
                chunk = b""
            if chunk:
                data[fd] += chunk
            else:
                closed.add(fd)
                del pending[fd]
    return [s for s in socks if s.fileno() in closed], {fd: data[fd] for fd in closed}


def still_open(sock) -> bool:
    """Nothing to read and no end of file: the server holds the connection open."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        return False  # data or end of file
    finally:
        sock.setblocking(True)


def ordinary_requests(server, n=5):
    """B: ``n`` requests on one keep-alive connection, then ``n`` on fresh connections; all must be 200."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for i in range(n):
            r = client.post("/chat", json={"prompt": "hi", "max_tokens": 2, "seed": i})
            assert r.status_code == 200, r.text
            assert client.get("/health").status_code == 200
    for _ in range(n):
        assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 200


def test_client_keys_group_addresses():
    assert client_key(("127.0.0.2", 5000)) == "127.0.0.2"
    assert client_key(("::ffff:10.0.0.1", 1, 0, 0)) == "10.0.0.1"
    assert client_key(("2001:db8::1", 1, 0, 0)) == client_key(("2001:db8::ffff", 2, 0, 0)) == "2001:db8::/64"
    assert client_key(None) == "unknown"


def test_registry_makes_room_for_a_client_from_its_own_idle_then_the_oldest_idle():
    class Conn:
        evicted = False

        def evict(self):
            self.evicted = True

    reg = ConnectionRegistry(max_total=3, max_per_client=2)
    a1, a2, a3, a4, b1, b2, c1 = (Conn() for _ in range(7))
    assert reg.admit(a1, "a") is None and reg.admit(a2, "a") is None
    # at a's limit: a's own oldest idle connection makes room (on loopback every local client is one "a")
    assert reg.admit(a3, "a") is None and a1.evicted and not a2.evicted and reg.of("a") == 2 and reg.evicted == 1
    reg.busy(a2)
    reg.busy(a3)
    assert reg.admit(a4, "a") == "per_client" and reg.refused["per_client"] == 1  # every one of a's is busy
    assert reg.admit(b1, "b") is None and reg.open == 3
    reg.busy(b1)
    assert reg.admit(b2, "b") == "capacity" and reg.refused["capacity"] == 1  # none idle anywhere
    reg.idle(a2)
    assert reg.admit(c1, "c") is None and a2.evicted and not a3.evicted and reg.evicted == 2  # the oldest idle


def test_a_clients_idle_connections_beyond_its_limit_make_room_for_its_new_ones(batching):  # noqa: F811
    """A's 200 silent sockets keep at most 16 slots, its newest: each new one closes A's oldest idle one (so a
    process sharing A's address, as every local process shares 127.0.0.1, is never locked out by idle sockets)."""
    per_client = 16
    builder = service(batching, max_tokens=4).read_timeouts(header_s=600).connections(max_per_client=per_client)
    with serving(builder) as server:
        with flood(server) as socks:
            evicted, answers = closed_by_server(socks, FLOOD - per_client)
            assert len(evicted) == FLOOD - per_client and not any(answers.values())  # closed without an answer
            assert set(evicted) == set(socks[:FLOOD - per_client])  # the oldest
            kept = socks[FLOOD - per_client:]
            assert all(still_open(s) for s in kept)
            ordinary_requests(server)
            assert all(still_open(s) for s in kept)  # B needed no slot of A's: A keeps its 16 idle sockets
            text = httpx.get(f"{server.url}/metrics", timeout=30).text
            assert metric(text, "aner_http_connections_refused_total", reason="per_client") == 0
            assert metric(text, "aner_http_connections_evicted_total") == FLOOD - per_client
            assert metric(text, "aner_http_connections") >= per_client + 1
            assert server.connections.of(ATTACKER) == per_client
            with socket.socket() as same_address:  # A's address with a real request: served, not refused
                same_address.bind((ATTACKER, 0))
                same_address.settimeout(WAIT_S)
                same_address.connect(("127.0.0.1", server.port))
                same_address.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                assert same_address.recv(64).startswith(b"HTTP/1.1 200")
        ordinary_requests(server, n=1)


def test_at_the_total_limit_the_oldest_idle_connections_make_room(batching):  # noqa: F811
    total = 40
    builder = service(batching, max_tokens=4).read_timeouts(header_s=600).connections(max_per_client=0,
                                                                                      max_total=total)
    with serving(builder) as server:
        with flood(server) as socks:
            evicted, answers = closed_by_server(socks, FLOOD - total)
            assert len(evicted) == FLOOD - total and not any(answers.values())  # closed without an answer
            assert set(evicted) == set(socks[:FLOOD - total])  # oldest first
            # B: a request in flight (its head sent, its body not yet) takes a slot (evicting A's oldest)...
            body = b'{"prompt": "hi", "max_tokens": 2}'
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as busy:
                busy.sendall(b"POST /chat HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
                wait_until(lambda: server.connections.open == total and server.connections.idle_count == total - 1,
                           timeout=WAIT_S, what="B's request to be in flight")
                # ...and is never evicted: 50 more of A's connections evict A's own idle ones.
                with flood(server, 50) as more:
                    gone, _ = closed_by_server(socks[FLOOD - total:], total)
                    assert len(gone) == total
                    busy.sendall(body[5:])
                    answer = busy.recv(65536)
                    assert answer.startswith(b"HTTP/1.1 200 "), answer
                    assert sum(still_open(s) for s in more) == total - 1  # A's newest: all slots but B's
            ordinary_requests(server)
            text = httpx.get(f"{server.url}/metrics", timeout=30).text
            assert metric(text, "aner_http_connections_evicted_total") >= FLOOD - total + 1 + 50
            assert metric(text, "aner_http_connections_refused_total", reason="capacity") == 0
            assert server.connections.open <= total
