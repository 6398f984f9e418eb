"""``%llm serve`` and ``%llm stop``: a handle over HTTP from a background thread.

The servers are kept by :class:`~aner_nb.magics.servers.ServerRegistry`,
which the handle registry asks to stop a handle's server before it closes it.
"""

from __future__ import annotations

import os
from typing import Any

from IPython.core.error import UsageError

from .base import MagicsBase, library_errors
from .parser import argument, int_arg, subcommand

__all__ = ["ServingMagics", "served_note"]


class ServingMagics(MagicsBase):
    """Handlers that start and stop HTTP servers."""

    @subcommand(
        "serve",
        usage="%llm serve NAME [--port P] [--api-key-env VAR]",
        description="Serve a handle over HTTP on 127.0.0.1 (POST /chat, POST /v1/chat/completions, GET /v1/models, "
        "/health, /metrics) from a background thread; the handle stays alive until %llm stop. Only loopback "
        "Host names are answered and browser pages of other origins are refused (403); with --api-key-env "
        "every request but /health needs 'Authorization: Bearer <the value of VAR>'.",
        python="server = api.app(title).llm(path='/chat', model=NAME).bind(port=P).start()   # from aner_nb import api",
    )
    @argument("target", metavar="NAME")
    @argument("--port", type=int_arg, metavar="P", default=11435, help="port on 127.0.0.1 (default 11435; 0: any free)")
    @argument("--api-key-env", metavar="VAR", default=None,
              help="require the API key held in environment variable VAR (never typed into a cell)")
    def _llm_serve(self, args: Any) -> Any:
        handle = self._handle(args.target, "%llm serve")
        if handle.kind == "session":
            raise UsageError(f"%llm serve: {args.target!r} is a chat session; serve the lease it was opened on")
        running = self.servers.running().get(args.target)
        if running is not None:
            raise UsageError(f"%llm serve: {args.target} is already served at {running.url}; %llm stop {args.target} first")
        key = None
        if args.api_key_env is not None:
            key = os.environ.get(args.api_key_env)
            if not key:
                raise UsageError(f"%llm serve: environment variable {args.api_key_env} is unset or empty")
        from .. import api

        with library_errors("%llm serve"):
            builder = api.app(f"aner_nb {args.target}").llm(path="/chat", model=handle).bind(port=args.port)
            server = builder.auth(bearer_token=key).start()
        self.servers.add(args.target, handle, server)
        print(served_note(args.target, server.url, args.api_key_env))
        return server

    @subcommand(
        "stop",
        usage="%llm stop [NAME]",
        description="Stop the HTTP server of NAME (default: every server started by %llm serve); "
        "the handle stays open.",
        python="server.stop()",
    )
    @argument("target", metavar="NAME", nargs="?")
    def _llm_stop(self, args: Any) -> None:
        served = list(self.servers.running())
        if args.target is not None and args.target not in served:
            listed = f"; served: {', '.join(served)}" if served else "; nothing is served"
            raise UsageError(f"%llm stop: {args.target!r} is not served{listed}")
        stopped = self.servers.stop(args.target)
        print(f"stopped serving {', '.join(stopped)}" if stopped else "no server was running")


def served_note(name: str, url: str, key_env: str | None) -> str:
    """What ``%llm serve`` prints: where, what is checked, and how to add (or send) an API key."""
    checks = "loopback only; Host names other than localhost/loopback and other browser origins get 403"
    if key_env is not None:
        return (f"serving {name} at {url} ({checks}); requests need 'Authorization: Bearer $" + key_env + "'")
    return (f"serving {name} at {url} ({checks}); no API key: any program on this machine can call it. "
            f"To require one: %llm stop {name}, set an environment variable (e.g. ANER_API_KEY) to a secret "
            f"of 8+ characters, then %llm serve {name} --api-key-env ANER_API_KEY")
