"""Who may address the service: the ``Host`` allow-list and the ``Origin`` check (the outermost ASGI layer).

A service on loopback is still reachable from every browser tab on the
machine. Two browser attacks need no credentials:

- **DNS rebinding**: a page at ``http://attacker.example`` re-points its own
  name to 127.0.0.1 and then reads the service *as that origin*. Its
  requests carry ``Host: attacker.example``; the ``Host`` allow-list refuses
  them (403 ``host_not_allowed``).
- **Cross-site requests**: any page can send requests to
  ``http://127.0.0.1:11435`` (a form POST, ``fetch`` in ``no-cors`` mode); the
  browser adds ``Origin: https://that.page``. A request whose ``Origin`` is
  present and not allowed is refused (403 ``origin_not_allowed``), preflights
  included, before it reaches routing, CORS or the model. (The ``Guard``
  also answers 415 to a POST that is not ``application/json``, which a
  browser cannot send cross-site without a preflight.)

The rules (:class:`HostPolicy`, :class:`OriginPolicy`):

- Host names compare case-insensitively, without the port and a trailing
  dot. Always allowed: ``localhost``, ``*.localhost`` (browsers resolve
  these to loopback themselves, RFC 6761) and loopback addresses
  (``127.0.0.0/8``, ``[::1]``). Bound to a non-loopback address, also any
  IP address literal (a browser that sends ``Host: 10.0.0.5`` is on a page
  of ``10.0.0.5`` itself, not on a rebound name) and the bound host when it
  is a name. Anything else only when listed (``allowed_hosts``; an entry
  ``*.example.org`` allows the subdomains of example.org, ``*`` allows any
  host). A request without ``Host`` (HTTP/1.0) is allowed: no browser sends one.
- An ``Origin`` is allowed when it is listed as a CORS origin (``*``: any,
  ``null`` included), or is the request's own origin (same scheme, host and
  port as ``Host``). No ``Origin`` header (curl, SDKs, servers) is allowed.

Refusals are the service's JSON error shape, type ``permission_error``.
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

from .envelope import error_json

__all__ = ["HostPolicy", "OriginPolicy", "OriginGuard", "normalize_host", "check_host_pattern"]

Scope = dict[str, Any]
Message = dict[str, Any]

LOOPBACK_NAMES = ("localhost", "*.localhost")
MAX_PATTERN = 253  # a DNS name's length


def _split_host(value: str) -> tuple[str, str | None] | None:
    """``host[:port]`` (``[v6][:port]``) as (lowercased host without a trailing dot, port text or None); None if malformed."""
    value = value.strip()
    if not value or any(c.isspace() for c in value) or "/" in value or "@" in value:
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            return None
        port = rest[1:] if rest else None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep:
            host, port_text = value, ""
        elif ":" in host:  # a bare IPv6 address (no brackets): not a valid Host
            return None
        port = port_text if sep else None
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        return None
    host = host.lower().rstrip(".")
    return (host, port) if host else None


def normalize_host(value: str) -> str | None:
    """The host part of a ``Host`` header value, lowercased, without port or trailing dot; None if malformed."""
    split = _split_host(value)
    return split[0] if split is not None else None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback address literal."""
    if host == "localhost":
        return True
    ip = _ip(host.strip("[]"))
    return ip is not None and ip.is_loopback


def check_host_pattern(pattern: str) -> str:
    """An ``allowed_hosts`` entry, normalized: ``*``, a name, ``*.`` + a name, or an IP address; else ValueError."""
    if not isinstance(pattern, str):
        raise ValueError(f"an allowed host is a string, got {pattern!r}")
    text = pattern.strip().lower().rstrip(".")
    if text == "*":
        return text
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if _ip(text) is not None:
        return str(_ip(text))
    name = text[2:] if text.startswith("*.") else text
    labels = name.split(".")
    if not name or len(name) > MAX_PATTERN or not all(
            label and len(label) <= 63 and all(c.isalnum() or c in "-_" for c in label) and label.isascii()
            for label in labels):
        raise ValueError(f"an allowed host is '*', a host name (optionally '*.' + a name, for its subdomains) "
                         f"or an IP address, without scheme or port; got {pattern!r}")
    return text


@dataclass(frozen=True)
class HostPolicy:
    """Which ``Host`` values are answered. ``bind`` is the address the service listens on."""

    bind: str
    listed: tuple[str, ...] = ()  # normalized patterns (check_host_pattern)

    @property
    def any(self) -> bool:
        return "*" in self.listed

    def allowed(self) -> list[str]:
        """What is allowed, in words (for messages and docs)."""
        shown = ["localhost", "*.localhost", "loopback addresses"]
        if not is_loopback_host(self.bind):
            shown.append("any IP address")
            if _ip(self.bind) is None:
                shown.append(self.bind.lower())
        return shown + [p for p in self.listed if p not in shown]

    def permits(self, host: str) -> bool:
        """Whether the normalized host name (see ``normalize_host``) may be served."""
        if self.any:
            return True
        if host == "localhost" or host.endswith(".localhost"):
            return True
        ip = _ip(host)
        if ip is not None:
            if ip.is_loopback or (isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None
                                  and ip.ipv4_mapped.is_loopback):
                return True
            if not is_loopback_host(self.bind):
                return True
            return str(ip) in self.listed
        if host == self.bind.lower().rstrip(".") and not is_loopback_host(self.bind):
            return True
        for pattern in self.listed:
            if pattern == host or (pattern.startswith("*.") and host.endswith(pattern[1:])):
                return True
        return False


@dataclass(frozen=True)
class OriginPolicy:
    """Which ``Origin`` values are answered: the CORS origins (``*``: any) and the request's own origin."""

    cors: tuple[str, ...] = ()

    def permits(self, origin: str, host_header: str | None, scheme: str) -> bool:
        if "*" in self.cors:
            return True
        lowered = origin.strip().lower()
        if lowered in (o.lower() for o in self.cors):
            return True
        if host_header is None or lowered == "null":
            return False
        own = _origin_key(f"{scheme}://{host_header}")
        return own is not None and _origin_key(lowered) == own


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _origin_key(origin: str) -> tuple[str, str, str] | None:
    """``scheme://host[:port]`` as (scheme, host, port with the scheme's default filled in); None if malformed."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or scheme not in _DEFAULT_PORTS:
        return None
    split = _split_host(rest)
    if split is None:
        return None
    host, port = split
    return scheme, host, port or _DEFAULT_PORTS[scheme]


def _refusal(message: str, code: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = error_json(message, type="permission_error", code=code)
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body


class OriginGuard:
    """ASGI middleware, outermost: 403 for a ``Host`` or an ``Origin`` that is not allowed."""

    def __init__(self, app: Any, *, hosts: HostPolicy, origins: OriginPolicy,
                 record: Callable[[str, int, float], None] | None = None, routes: Iterable[str] = ()) -> None:
        self.app = app
        self.hosts = hosts
        self.origins = origins
        self.record = record
        self.routes = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        refusal = self.check(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        headers, body = refusal
        await send({"type": "http.response.start", "status": 403, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        if self.record is not None:
            path = scope.get("path", "")
            self.record(path if path in self.routes else "other", 403, time.perf_counter() - started)

    def check(self, scope: Scope) -> tuple[list[tuple[bytes, bytes]], bytes] | None:
        host_header = origin = None
        for name, value in scope.get("headers", ()):
            if name == b"host" and host_header is None:
                host_header = value.decode("latin-1")
            elif name == b"origin" and origin is None:
                origin = value.decode("latin-1")
        if host_header is not None and not self.hosts.any:
            host = normalize_host(host_header)
            if host is None or not self.hosts.permits(host):
                return _refusal(f"Host {host_header[:100]!r} is not allowed here (allowed: "
                                f"{', '.join(self.hosts.allowed())}); add it with --allowed-hosts or "
                                ".allowed_hosts(...)", "host_not_allowed")
        if origin is not None and not self.origins.permits(origin, host_header, scope.get("scheme", "http")):
            return _refusal(f"Origin {origin[:100]!r} is not allowed to call this service; allow a browser origin "
                            "with --cors-origin or .cors(origins=[...])", "origin_not_allowed")
        return None
