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
    .allowed_hosts(["llm.lab.example"])   # Host names besides localhost and loopback addresses
    .connections(max_per_client=32)       # open connections per client address (0: no limit)
    .start()                      # or .serve() to block, or .asgi() for any ASGI server
)
server.url                        # 'http://127.0.0.1:11435'
server.stop()                     # the lease stays open; close it yourself
```

Every builder call returns a new :class:`App` (the previous one is
unchanged) and checks its arguments at once. Loopback by default; optional
API keys (``.auth(bearer_token=..., api_keys=[...], api_key_file=path)``)
guard every route but ``/health`` and ``/openapi.json``. Browsers are kept
out unless let in: a ``Host`` that is not allowed (DNS rebinding) and an
``Origin`` that is neither the service's own nor a CORS origin get 403, and
a POST body that is not ``application/json`` 415 (see ``origin`` and
``guard``). Connections are bounded per client address and in total, idle
ones evicted oldest first (see ``connections``). Limits: request body size, ``max_tokens``
cap, ``max_rows`` messages per request, a request timeout that cancels the
generation and frees its slot, and a bound on requests admitted at once
(running plus queued; the gate is the only admission control); over it the answer is
``503`` with ``Retry-After``. See ``docs/deploy.md`` for replicas behind
nginx and ``docs/openai.md`` for what the OpenAI routes do with each
request field. Everything here is process local: queues, pools and
counters (``/metrics`` has a registry per application).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..llm import Lease
from ..llm.errors import ConfigurationError
from ..llm.options import REGISTRY
from ..llm.profiles import int_in as _int_in
from .config import ServiceConfig
from .connections import DEFAULT_PER_CLIENT
from .keys import check_key, read_key_file
from .origin import check_host_pattern, is_loopback_host
from .routes import RESERVED, MountSpec, service_routes
from .server import Server

__all__ = ["app", "App", "Server", "ServiceConfig"]

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ServiceConfig))

log = logging.getLogger("aner_nb.api")

DEFAULT_PORT = 11435
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
MAX_KEEPALIVE_S = 3600.0
MIN_READ_TIMEOUT_S, MAX_READ_TIMEOUT_S = 0.1, 3600.0
_MAX_TOKENS = REGISTRY["max_tokens"]  # the output limit's bounds and default
MAX_CONNECTIONS = 65536
_ORIGIN = re.compile(r"^https?://[^/\s?#]+$")  # scheme://host[:port], nothing after it


def _is_loopback(host: str) -> bool:
    return is_loopback_host(host)


@dataclass(frozen=True)
class App:
    """An immutable description of a service; build it with :func:`app` and the chained methods.

    It holds the application's :class:`ServiceConfig` (what is served and the
    request limits; each builder call replaces it) and what only the server
    needs (port, connection slots, read timeouts, logs). The config's fields
    read as the App's own (``App.timeout_ms``, ``App.cors_origins``), with
    ``served`` and ``allowed_host_names`` for its ``mounts`` and ``allowed_hosts``.
    """

    config: ServiceConfig = field(default_factory=ServiceConfig)
    port: int = DEFAULT_PORT
    max_connections: int | None = None  # None: 4 x the requests admitted at once + 32
    max_connections_per_client: int = DEFAULT_PER_CLIENT
    log_level: str = "warning"
    access_log: bool = False
    header_timeout_s: float = 10.0

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: a ServiceConfig field read through the App.
        if name in _CONFIG_FIELDS:
            return getattr(self.config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def served(self) -> tuple[MountSpec, ...]:
        """The served models, in the order they were added."""
        return self.config.mounts

    @property
    def allowed_host_names(self) -> tuple[str, ...]:
        """Host names answered besides the defaults (see :meth:`allowed_hosts`)."""
        return self.config.allowed_hosts

    def _configure(self, **changes: Any) -> "App":
        """A new App whose config has ``changes``."""
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **changes))

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
        return self._configure(mounts=(*self.served, MountSpec(path, model, name)))

    def bind(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> "App":
        """Where to listen; ``port=0`` picks a free port (``Server.url`` names it). Loopback by default."""
        if not isinstance(host, str) or not host:
            raise ConfigurationError(f"host must be an address or host name, got {host!r}")
        _int_in("port", port, 0, 65535)
        return dataclasses.replace(self._configure(host=host), port=port)

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
        at most one worker thread (default: a batching lease's sequences plus its
        queue, one for an ordinary lease); beyond it 503 with
        ``Retry-After: retry_after_s``.
        """
        _int_in("max_rows", max_rows, 1, 4096)
        _int_in("timeout_ms", timeout_ms, 1, 24 * 3600 * 1000)
        _int_in("max_body_bytes", max_body_bytes, 64, 1 << 30)
        if max_concurrent is not None:
            _int_in("max_concurrent", max_concurrent, 1, 1024)
        _int_in("retry_after_s", retry_after_s, 1, 3600)
        return self._configure(max_rows=max_rows, timeout_ms=timeout_ms, max_body_bytes=max_body_bytes,
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
        return dataclasses.replace(self._configure(body_timeout_s=float(body_s)), header_timeout_s=float(header_s))

    def output_limit(self, *, max_tokens: int = _MAX_TOKENS.default) -> "App":
        """The most tokens one request may generate; also the default when a request names none
        (bounds and default: the ``max_tokens`` request option's declaration)."""
        _int_in("max_tokens", max_tokens, int(_MAX_TOKENS.low), int(_MAX_TOKENS.high))
        return self._configure(max_tokens=max_tokens)

    def auth(self, *, bearer_token: str | None = None, api_keys: Iterable[str] = (),
             api_key_file: str | os.PathLike[str] | None = None) -> "App":
        """Require ``Authorization: Bearer <key>`` with one of the keys: ``bearer_token``, ``api_keys`` and
        the keys of ``api_key_file`` (one per line, blank lines and ``#`` comments ignored; read now, once).

        Each key is 8..512 printable ASCII characters without spaces; the
        token is compared with every key in constant time. No keys at all
        (the default) removes the requirement.
        """
        if bearer_token is not None and check_key(bearer_token) is not None:
            raise ConfigurationError("bearer_token must be 8..512 printable ASCII characters without spaces",
                                     param="bearer_token")
        if isinstance(api_keys, str):
            raise ConfigurationError("api_keys must be a list of keys, not one string", param="api_keys")
        keys = list(api_keys)
        for number, key in enumerate(keys):
            problem = check_key(key)
            if problem is not None:
                raise ConfigurationError(f"api_keys[{number}]: {problem}", param="api_keys")
        if api_key_file is not None:
            try:
                keys.extend(read_key_file(api_key_file))
            except ValueError as exc:
                raise ConfigurationError(str(exc), param="api_key_file") from None
        return self._configure(bearer_token=bearer_token, api_keys=tuple(dict.fromkeys(keys)))

    @property
    def authenticated(self) -> bool:
        """Whether requests need a key."""
        return self.config.authenticated

    def allowed_hosts(self, hosts: Iterable[str] = ()) -> "App":
        """``Host`` names answered besides the defaults (``localhost``, ``*.localhost``, loopback addresses;
        bound elsewhere also any IP address and the bound name): names, ``*.example.org`` for subdomains,
        or ``*`` for any host (behind a gateway that checks Host itself). Others get 403: DNS rebinding
        cannot read the service from a browser."""
        if isinstance(hosts, str):
            raise ConfigurationError("hosts must be a list of host names, not one string", param="hosts")
        try:
            listed = tuple(dict.fromkeys(check_host_pattern(h) for h in hosts))
        except ValueError as exc:
            raise ConfigurationError(str(exc), param="hosts") from None
        return self._configure(allowed_hosts=listed)

    def connections(self, *, max_per_client: int = DEFAULT_PER_CLIENT, max_total: int | None = None) -> "App":
        """Connection slots: at most ``max_per_client`` open connections per client address (0: no limit;
        more are answered 429 at once and closed) and ``max_total`` in all (default 4 x the requests
        admitted at once + 32); at the total, the oldest idle connection is closed to make room."""
        _int_in("max_per_client", max_per_client, 0, MAX_CONNECTIONS)
        if max_total is not None:
            _int_in("max_total", max_total, 1, MAX_CONNECTIONS)
        return dataclasses.replace(self, max_connections=max_total, max_connections_per_client=max_per_client)

    def sse(self, *, keepalive_s: float = 15.0) -> "App":
        """Send a ``: keep-alive`` SSE comment every ``keepalive_s`` seconds while a stream has no new text
        (waiting in the queue, evaluating its prompt), so idle-timeout proxies keep it open; 0 turns it off."""
        if isinstance(keepalive_s, bool) or not isinstance(keepalive_s, (int, float)) \
                or not math.isfinite(keepalive_s) or not 0 <= keepalive_s <= MAX_KEEPALIVE_S:
            raise ConfigurationError(f"keepalive_s must be a number of seconds in 0..{MAX_KEEPALIVE_S:g} "
                                     f"(0 = off), got {keepalive_s!r}", param="keepalive_s")
        return self._configure(sse_keepalive_s=float(keepalive_s))

    def fields(self, *, lenient: bool = False) -> "App":
        """Unknown fields on the OpenAI routes: a 400 naming the field (the default, strict), or with
        ``lenient=True`` ignored and listed in the answer's ``X-Aner-Ignored-Fields`` header, for clients
        that send other servers' ``extra_body`` knobs. A known field this service cannot honour (``n`` over
        its bound, an unsupported value) is refused either way."""
        if not isinstance(lenient, bool):
            raise ConfigurationError(f"lenient must be True or False, got {lenient!r}", param="lenient")
        return self._configure(lenient_fields=lenient)

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
        return self._configure(cors_origins=tuple(dict.fromkeys(listed)))

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
        from .service import build_app

        if not self.served:
            raise ConfigurationError("nothing to serve: add a model with .llm(path='/chat', model=lease)")
        return build_app(self.config)

    def _server(self) -> Server:
        asgi = self.asgi()
        if not _is_loopback(self.host) and not self.authenticated:
            log.warning("serving on %s without an API key: anyone who can reach it can use the model", self.host)
        capacity = sum(m.capacity for m in asgi.state.mounts)
        routes = [r.listing for r in service_routes((s.path, s.name) for s in self.served)]
        total = self.max_connections if self.max_connections is not None else 4 * capacity + 32
        return Server(asgi, title=self.title, host=self.host, port=self.port, routes=routes,
                      models=[s.name for s in self.served], max_connections=total,
                      max_connections_per_client=self.max_connections_per_client,
                      log_level=self.log_level, access_log=self.access_log, retry_after_s=self.retry_after_s,
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
    return App(config=ServiceConfig(title=title))
