"""Connection slots per server: a per-client limit, a total limit, and idle connections evicted oldest first.

One :class:`ConnectionRegistry` per running server (``Server``), used by its
``EdgeProtocol`` connections on the server's event loop thread (so it
needs no lock). A client is a peer address (an IPv6 client is its /64
network, which one host usually owns whole).

When a connection opens:

1. its client already holds ``max_per_client`` connections (0: no such
   limit): that client's own oldest idle connection is closed to make room;
   when every one of them has a request in flight the new one is refused,
   answered ``429 too_many_connections`` at once (before any request is
   read) and closed. (Refusing the new one while old ones idle would let
   any local process lock every other local client out: on loopback they
   are all one client, ``127.0.0.1``.)
2. the server holds ``max_total`` connections: the oldest *idle* one (no
   request in flight: never used yet, or waiting between keep-alive
   requests; a request head still arriving counts as idle) is closed to make
   room; when every connection has a request in flight the new one is
   refused, ``503 server_full`` with ``Retry-After``.

So one client holding hundreds of idle keep-alive sockets takes at most
``max_per_client`` slots and loses the oldest of them to its own new ones, and clients from many addresses holding idle
sockets lose them to new clients instead of starving them. A connection
with a request in flight is never evicted. The counts are exported on
``/metrics`` (``aner_http_connections``, ``aner_http_connections_idle``,
``aner_http_connections_refused_total{reason}``,
``aner_http_connections_evicted_total``).
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from typing import Any, Protocol

__all__ = ["ConnectionRegistry", "client_key", "DEFAULT_PER_CLIENT"]

DEFAULT_PER_CLIENT = 32
REFUSED_REASONS = ("per_client", "capacity")


class Evictable(Protocol):
    def evict(self) -> None: ...


def client_key(peer: Any) -> str:
    """The client a connection belongs to: its peer address (IPv6: the /64 network)."""
    if not isinstance(peer, (tuple, list)) or not peer:
        return "unknown"
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except ValueError:
        return str(peer[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if not ip.is_loopback:
            return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


class ConnectionRegistry:
    """The server's open connections by client, and which of them are idle (oldest first)."""

    def __init__(self, *, max_total: int, max_per_client: int = DEFAULT_PER_CLIENT) -> None:
        if max_total < 1 or max_per_client < 0:
            raise ValueError("max_total must be >= 1 and max_per_client >= 0")
        self.max_total = max_total
        self.max_per_client = max_per_client
        self._client: dict[Any, str] = {}  # connection -> client
        self._per_client: dict[str, int] = {}
        self._idle: OrderedDict[Any, None] = OrderedDict()  # oldest idle first
        self.refused = dict.fromkeys(REFUSED_REASONS, 0)
        self.evicted = 0
        self.accepted = 0

    # -- what the protocol reports --------------------------------------------------------
    def admit(self, connection: Evictable, client: str) -> str | None:
        """Register a new connection (idle); or the reason it is refused (``per_client``, ``capacity``)."""
        if self.max_per_client and self._per_client.get(client, 0) >= self.max_per_client:
            own = next((c for c in self._idle if self._client[c] == client), None)  # oldest idle first
            if own is None:
                self.refused["per_client"] += 1
                return "per_client"
            self._evict(own)
        while len(self._client) >= self.max_total:
            victim = next(iter(self._idle), None)
            if victim is None:
                self.refused["capacity"] += 1
                return "capacity"
            self._evict(victim)
        self._client[connection] = client
        self._per_client[client] = self._per_client.get(client, 0) + 1
        self._idle[connection] = None
        self.accepted += 1
        return None

    def _evict(self, victim: Evictable) -> None:
        self.release(victim)
        self.evicted += 1
        victim.evict()

    def busy(self, connection: Any) -> None:
        """A request is in flight on ``connection``: it is not evicted until it becomes idle again."""
        self._idle.pop(connection, None)

    def idle(self, connection: Any) -> None:
        """``connection`` has no request in flight (again): it is now the newest idle one."""
        if connection in self._client and connection not in self._idle:
            self._idle[connection] = None

    def release(self, connection: Any) -> None:
        """``connection`` is closed (or being evicted); its slot is free. Unknown connections are ignored."""
        client = self._client.pop(connection, None)
        if client is None:
            return
        self._idle.pop(connection, None)
        left = self._per_client[client] - 1
        if left:
            self._per_client[client] = left
        else:
            del self._per_client[client]

    # -- what metrics and tests read --------------------------------------------------------
    @property
    def open(self) -> int:
        return len(self._client)

    @property
    def idle_count(self) -> int:
        return len(self._idle)

    def of(self, client: str) -> int:
        return self._per_client.get(client, 0)
