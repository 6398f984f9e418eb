"""Running the ASGI application with uvicorn: blocking (``serve``) or on a background thread (``start``).

The listening socket is bound here, before uvicorn starts, so ``port=0``
picks a free port and ``Server.url`` always names the real one. uvicorn is
pinned to its asyncio loop and h11 protocol (no optional accelerators whose
presence would change behaviour between machines), extended with read
deadlines for request heads and bodies and a lingering close
(``edges.EdgeProtocol``), and with connection slots of its own
(``connections.ConnectionRegistry``: a per-client limit, a total limit above
the application's own admission limits, idle connections evicted oldest
first) in place of uvicorn's ``limit_concurrency``, which answers every
request 503 once idle sockets fill it.
"""

from __future__ import annotations

import html
import ipaddress
import logging
import signal
import socket
import threading
import time
from typing import Any

__all__ = ["Server", "bind_socket"]


def bind_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6 literal, or a name such as ``localhost``)."""
    family = socket.AF_INET
    try:
        if ipaddress.ip_address(host).version == 6:
            family = socket.AF_INET6
    except ValueError:
        host = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted sockets inherit this: without it a response written as headers then body waits
        # for the client's delayed ACK (about 40 ms per request on Linux loopback).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


class Server:
    """A running service: ``url``, ``stop()``, ``wait()``; a context manager; shows itself in notebooks."""

    def __init__(self, asgi: Any, *, title: str, host: str, port: int, routes: list[str], models: list[str],
                 max_connections: int, max_connections_per_client: int = 32, graceful_s: float = 5.0,
                 log_level: str = "warning", access_log: bool = False, header_timeout_s: float = 10.0,
                 body_timeout_s: float = 30.0, retry_after_s: int = 1) -> None:
        import uvicorn

        from .connections import ConnectionRegistry
        from .edges import edge_protocol

        self.title = title
        self.routes = routes
        self.models = models
        self._sock = bind_socket(host, port)
        bound_host, bound_port = self._sock.getsockname()[:2]
        self.host = host
        self.port = bound_port
        shown = f"[{bound_host}]" if ":" in bound_host else host
        self.url = f"http://{shown}:{bound_port}"
        self.connections = ConnectionRegistry(max_total=max_connections, max_per_client=max_connections_per_client)
        metrics = getattr(getattr(asgi, "state", None), "metrics", None)
        if metrics is not None:
            metrics.watch_connections(lambda: self.connections)
        protocol = edge_protocol(header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s,
                                 registry=self.connections, retry_after_s=retry_after_s)
        config = uvicorn.Config(
            asgi, loop="asyncio", http=protocol, ws="none", lifespan="on", log_level=log_level,
            access_log=access_log, timeout_keep_alive=5, limit_concurrency=None,  # the registry bounds connections
            timeout_graceful_shutdown=graceful_s,
        )
        if access_log:  # uvicorn logs access lines at INFO: show them whatever the server's level
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        self._server: Any = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopped = threading.Event()

    # -- lifetime -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
        finally:
            self._sock.close()
            self._stopped.set()

    def start(self, timeout_s: float = 30.0) -> "Server":
        """Serve on a daemon thread; return once the service accepts connections."""
        self._thread = threading.Thread(target=self._run, name=f"aner-http-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._stopped.is_set() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP service did not start: {self._error or 'timed out'}")
            time.sleep(0.01)
        return self

    def serve(self) -> None:
        """Serve until Ctrl-C or SIGTERM (or ``stop()`` from another thread), then shut down gracefully."""
        if self._thread is None:
            self.start()
        requested = threading.Event()
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda *_: requested.set())
        try:
            while not requested.is_set() and not self._stopped.is_set():
                requested.wait(0.2)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stop()
        if self._error is not None:
            raise self._error

    @property
    def running(self) -> bool:
        return self._server is not None and self._server.started and not self._stopped.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the service has stopped; returns whether it has."""
        return self._stopped.wait(timeout)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, cancel running generations, wait for the thread; the served leases stay open."""
        server = self._server
        if server is None:
            return
        server.should_exit = True
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                server.force_exit = True
                thread.join(timeout_s)
        elif thread is None:
            self._sock.close()
            self._stopped.set()
        if self._stopped.is_set():
            self._server = None  # a stopped handle (kept by a notebook) must not keep the served leases alive

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- display ------------------------------------------------------------------------------
    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<aner_nb.api.Server {self.title!r} {self.url} models={self.models} {state}>"

    def _repr_html_(self) -> str:
        state = "running" if self.running else "stopped"
        rows = [
            ("url", f"<a href='{html.escape(self.url)}/health' target='_blank'>{html.escape(self.url)}</a>"),
            ("state", state),
            ("models", html.escape(", ".join(self.models))),
            ("routes", "<br>".join(html.escape(r) for r in self.routes)),
        ]
        body = "".join(f"<tr><th style='text-align:left'>{k}</th><td style='text-align:left'>{v}</td></tr>"
                       for k, v in rows)
        return f"<div class='aner-server'><b>{html.escape(self.title)}</b><table>{body}</table></div>"
