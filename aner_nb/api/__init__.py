"""The HTTP service: the seed ``/chat`` route and OpenAI-compatible routes over served leases.

```python
from aner_nb import api, llm

model = llm.load("model.gguf", context=4096).with_batching(4)
server = (
    api.app("my service")
    .llm(path="/chat", model=model)
    .bind(host="127.0.0.1", port=11435)
    .limits(max_rows=64, timeout_ms=120000)
    .output_limit(max_tokens=256)
    .sse(keepalive_s=15)          # ': keep-alive' comments while a stream has no text yet
    .read_timeouts(header_s=10, body_s=30)   # slow request heads are closed, slow bodies answered 408
    .cors(origins=["https://notebook.example"])   # browser origins; none by default
    .start()                      # or .serve() to block, or .asgi() for any ASGI server
)
server.url                        # 'http://127.0.0.1:11435'
server.stop()                     # the lease stays open; close it yourself
```

Every builder call returns a new :class:`App` (the previous one is
unchanged) and checks its arguments at once. Loopback by default; an
optional bearer token (``.auth(bearer_token=...)``) guards every route but
``/health`` and ``/openapi.json``. Limits: request body size, ``max_tokens``
cap, ``max_rows`` messages per request, a request timeout that cancels the
generation and frees its slot, and a bound on requests admitted at once
(running plus queued, one worker thread each); over it the answer is
``503`` with ``Retry-After``. See ``docs/deploy.md`` for replicas behind
nginx and ``docs/openai.md`` for what the OpenAI routes do with each
request field. Everything here is process local: queues, pools and
counters (``/metrics`` has a registry per application).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..llm import Lease
from ..llm.errors import ConfigurationError
from ..llm.profiles import MAX_TOKENS
from ..llm.profiles import int_in as _int_in
from .routes import RESERVED, MountSpec, service_routes
from .server import Server

__all__ = ["app", "App", "Server"]

log = logging.getLogger("aner_nb.api")

DEFAULT_PORT = 11435
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
MAX_KEEPALIVE_S = 3600.0
MIN_READ_TIMEOUT_S, MAX_READ_TIMEOUT_S = 0.1, 3600.0
_ORIGIN = re.compile(r"^https?://[^/\s?#]+$")  # scheme://host[:port], nothing after it


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class App:
    """An immutable description of a service; build it with :func:`app` and the chained methods."""

    title: str = "aner_nb"
    served: tuple[MountSpec, ...] = ()
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    max_rows: int = 64
    timeout_ms: int = 120_000
    max_body_bytes: int = 1 << 20
    max_concurrent: int | None = None
    retry_after_s: int = 1
    max_tokens: int = 256
    bearer_token: str | None = field(default=None, repr=False)
    sse_keepalive_s: float = 15.0
    cors_origins: tuple[str, ...] = ()
    log_level: str = "warning"
    access_log: bool = False
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    # -- builders ---------------------------------------------------------------------------
    def llm(self, path: str = "/chat", *, model: Any, name: str | None = None) -> "App":
        """Serve ``model`` (a lease or a batching lease): the seed route at ``path``, and under its id
        (``name``, default the model's name) on ``/v1/chat/completions`` and ``/v1/models``."""
        if not isinstance(path, str) or not path.startswith("/") or path.rstrip("/") != path or "{" in path:
            raise ConfigurationError(f"path must be an absolute route such as '/chat' (no trailing slash), got {path!r}")
        if any(path == r or path.startswith(r + "/") for r in RESERVED):
            raise ConfigurationError(f"path {path!r} is reserved; reserved: {', '.join(RESERVED)}")
        _check_servable(model)
        name = model.name if name is None else name
        if not isinstance(name, str) or not name.strip():
            raise ConfigurationError(f"name must be a non-empty string, got {name!r}")
        for other in self.served:
            if other.path == path:
                raise ConfigurationError(f"path {path!r} already serves {other.name!r}")
            if other.name == name:
                raise ConfigurationError(f"model id {name!r} is already served at {other.path}; pass name=")
        return dataclasses.replace(self, served=(*self.served, MountSpec(path, model, name)))

    def bind(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> "App":
        """Where to listen; ``port=0`` picks a free port (``Server.url`` names it). Loopback by default."""
        if not isinstance(host, str) or not host:
            raise ConfigurationError(f"host must be an address or host name, got {host!r}")
        _int_in("port", port, 0, 65535)
        return dataclasses.replace(self, host=host, port=port)

    def limits(
        self,
        *,
        max_rows: int = 64,
        timeout_ms: int = 120_000,
        max_body_bytes: int = 1 << 20,
        max_concurrent: int | None = None,
        retry_after_s: int = 1,
    ) -> "App":
        """Request limits.

        ``max_rows``: messages per request. ``timeout_ms``: from admission to
        the last token; past it the generation is cancelled (504).
        ``max_body_bytes``: request bodies above it get 413 unread.
        ``max_concurrent``: requests admitted at once per model, each holding
        one worker thread (default: a batching lease's sequences plus its
        queue, one for an ordinary lease); beyond it 503 with
        ``Retry-After: retry_after_s``.
        """
        _int_in("max_rows", max_rows, 1, 4096)
        _int_in("timeout_ms", timeout_ms, 1, 24 * 3600 * 1000)
        _int_in("max_body_bytes", max_body_bytes, 64, 1 << 30)
        if max_concurrent is not None:
            _int_in("max_concurrent", max_concurrent, 1, 1024)
        _int_in("retry_after_s", retry_after_s, 1, 3600)
        return dataclasses.replace(self, max_rows=max_rows, timeout_ms=timeout_ms, max_body_bytes=max_body_bytes,
                                   max_concurrent=max_concurrent, retry_after_s=retry_after_s)

    def read_timeouts(self, *, header_s: float = 10.0, body_s: float = 30.0) -> "App":
        """How long a request may take to arrive: its line and headers ``header_s`` seconds from the
        connection opening (or the previous request ending), else the connection is closed; its body
        ``body_s`` seconds from its headers, else 408. Slow clients (slow-loris) cannot hold connections."""
        for name, value in (("header_s", header_s), ("body_s", body_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not MIN_READ_TIMEOUT_S <= value <= MAX_READ_TIMEOUT_S:
                raise ConfigurationError(f"{name} must be a number of seconds in {MIN_READ_TIMEOUT_S:g}.."
                                         f"{MAX_READ_TIMEOUT_S:g}, got {value!r}", param=name)
        return dataclasses.replace(self, header_timeout_s=float(header_s), body_timeout_s=float(body_s))

    def output_limit(self, *, max_tokens: int = 256) -> "App":
        """The most tokens one request may generate; also the default when a request names none."""
        _int_in("max_tokens", max_tokens, 0, MAX_TOKENS)
        return dataclasses.replace(self, max_tokens=max_tokens)

    def auth(self, *, bearer_token: str | None) -> "App":
        """Require ``Authorization: Bearer <token>`` (compared in constant time); None removes it."""
        if bearer_token is not None and (not isinstance(bearer_token, str) or len(bearer_token) < 8
                                         or any(c.isspace() for c in bearer_token) or not bearer_token.isascii()):
            raise ConfigurationError("bearer_token must be at least 8 printable ASCII characters without spaces")
        return dataclasses.replace(self, bearer_token=bearer_token)

    def sse(self, *, keepalive_s: float = 15.0) -> "App":
        """Send a ``: keep-alive`` SSE comment every ``keepalive_s`` seconds while a stream has no new text
        (waiting in the queue, evaluating its prompt), so idle-timeout proxies keep it open; 0 turns it off."""
        if isinstance(keepalive_s, bool) or not isinstance(keepalive_s, (int, float)) \
                or not math.isfinite(keepalive_s) or not 0 <= keepalive_s <= MAX_KEEPALIVE_S:
            raise ConfigurationError(f"keepalive_s must be a number of seconds in 0..{MAX_KEEPALIVE_S:g} "
                                     f"(0 = off), got {keepalive_s!r}", param="keepalive_s")
        return dataclasses.replace(self, sse_keepalive_s=float(keepalive_s))

    def cors(self, *, origins: Iterable[str] = ()) -> "App":
        """Let browser pages from ``origins`` (``https://host[:port]``, or ``*`` for any) call the service.

        None by default. The answers carry CORS headers (Starlette's
        ``CORSMiddleware``) and preflight requests need no bearer token; a
        token, if set, is still required on the requests themselves.
        """
        if isinstance(origins, str):
            raise ConfigurationError("origins must be a list of origins, not one string", param="origins")
        listed = tuple(origins)
        for origin in listed:
            if not isinstance(origin, str) or not (origin == "*" or _ORIGIN.match(origin)):
                raise ConfigurationError(f"a CORS origin is '*' or scheme://host[:port] (http or https, no path), "
                                         f"got {origin!r}", param="origins")
        return dataclasses.replace(self, cors_origins=tuple(dict.fromkeys(listed)))

    def logs(self, *, level: str = "warning", access_log: bool = False) -> "App":
        """The server's log level (one of LOG_LEVELS) and whether it logs one line per request."""
        if level not in LOG_LEVELS:
            raise ConfigurationError(f"level must be one of {', '.join(LOG_LEVELS)}, got {level!r}", param="level")
        if not isinstance(access_log, bool):
            raise ConfigurationError(f"access_log must be True or False, got {access_log!r}", param="access_log")
        return dataclasses.replace(self, log_level=level, access_log=access_log)

    # -- running ----------------------------------------------------------------------------
    def asgi(self) -> Any:
        """A new ASGI application (FastAPI) for any ASGI server; each call has its own pools and counters."""
        from .service import ServiceConfig, build_app

        if not self.served:
            raise ConfigurationError("nothing to serve: add a model with .llm(path='/chat', model=lease)")
        config = ServiceConfig(
            title=self.title,
            mounts=self.served,
            max_rows=self.max_rows, timeout_ms=self.timeout_ms, max_body_bytes=self.max_body_bytes,
            max_concurrent=self.max_concurrent, retry_after_s=self.retry_after_s, max_tokens=self.max_tokens,
            bearer_token=self.bearer_token, sse_keepalive_s=self.sse_keepalive_s, cors_origins=self.cors_origins,
            body_timeout_s=self.body_timeout_s,
        )
        return build_app(config)

    def _server(self) -> Server:
        asgi = self.asgi()
        if not _is_loopback(self.host) and self.bearer_token is None:
            log.warning("serving on %s without a bearer token: anyone who can reach it can use the model", self.host)
        capacity = sum(m.capacity for m in asgi.state.mounts)
        routes = [r.listing for r in service_routes((s.path, s.name) for s in self.served)]
        return Server(asgi, title=self.title, host=self.host, port=self.port, routes=routes,
                      models=[s.name for s in self.served], limit_concurrency=4 * capacity + 32,
                      log_level=self.log_level, access_log=self.access_log,
                      header_timeout_s=self.header_timeout_s, body_timeout_s=self.body_timeout_s)

    def start(self, timeout_s: float = 30.0) -> Server:
        """Serve on a background thread (for notebooks); returns the running :class:`Server`."""
        return self._server().start(timeout_s)

    def serve(self) -> None:
        """Serve on this thread until Ctrl-C or SIGTERM."""
        self._server().serve()


def _check_servable(model: Any) -> None:
    """A lease that answers stateless requests: open, and not a session (which keeps one conversation)."""
    if not isinstance(model, Lease):
        raise ConfigurationError(f"model must be a lease from aner_nb.llm (load, with_batching...), got {type(model).__name__}")
    if model.kind == "session":
        raise ConfigurationError("a session keeps one conversation's state; serve the lease it was opened on instead")
    if model.closed:
        raise ConfigurationError("model is closed; serve an open lease")
    if not model.supports("stream"):
        raise ConfigurationError(f"a {model.kind} lease cannot stream, so it cannot be served")


def app(title: str = "aner_nb") -> App:
    """Start describing a service: ``api.app(title).llm(path=..., model=...).bind(...).start()``."""
    if not isinstance(title, str) or not title.strip():
        raise ConfigurationError(f"title must be a non-empty string, got {title!r}")
    return App(title=title)
