"""The HTTP servers ``%llm serve`` started, by the name of the handle each serves.

Kept apart from the handle registry (which only tracks handles weakly): a
served lease is held strongly on purpose, so it stays alive until ``%llm
stop``, closing it, ``%unload_ext`` or kernel exit stops its server. The
registry calls :meth:`ServerRegistry.release` before it closes a handle (and
with ``None`` before it closes them all).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerRegistry"]


class ServerRegistry:
    """Running ``aner_nb.api.Server`` objects of one shell, with the lease each serves."""

    def __init__(self) -> None:
        self._servers: dict[str, tuple[Any, Any]] = {}  # handle name -> (lease, server)

    def add(self, name: str, handle: Any, server: Any) -> None:
        self._servers[name] = (handle, server)

    def running(self) -> dict[str, Any]:
        """Running servers by the name of the handle they serve."""
        return {name: server for name, (_, server) in self._servers.items()}

    def stop(self, name: str | None = None) -> list[str]:
        """Stop the server of ``name`` (every server when None); returns the names stopped."""
        names = [name] if name is not None else list(self._servers)
        stopped = []
        for n in names:
            entry = self._servers.pop(n, None)
            if entry is not None:
                entry[1].stop()
                stopped.append(n)
        return stopped

    def release(self, handle: Any = None) -> list[str]:
        """Stop the servers of ``handle`` (a handle about to close), or every server when None."""
        if handle is None:
            return self.stop()
        stopped = []
        for name, (lease, _server) in list(self._servers.items()):
            if lease is handle:
                stopped += self.stop(name)
        return stopped
