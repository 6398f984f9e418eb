"""``aner-nb serve MODEL.gguf``: load a model, serve it over a batching lease until Ctrl-C or SIGTERM.

The API key is read from an environment variable (``--api-key-env VAR``),
never from the command line, where other users could read it in the
process list. Once the service accepts connections one line goes to
stdout: ``aner-nb serve: <model id> at <url>`` (with ``--port 0`` it names
the port that was picked).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..llm.profiles import CPU_EXTRA_BUFFERS
from .routes import service_routes

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    routes = ", ".join(r.listing for r in service_routes([("/chat", "")]) if not r.builtin)
    p = argparse.ArgumentParser(
        prog="aner-nb serve",
        description=f"Serve a GGUF model over HTTP: {routes} (/v1 is OpenAI-compatible). "
        "Concurrent requests share one continuous-batching scheduler.",
    )
    p.add_argument("model", metavar="MODEL.gguf", help="a single-file GGUF text model")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=11435, help="port (default 11435; 0 picks a free one)")
    p.add_argument("--max-sequences", type=int, default=4, metavar="N",
                   help="requests decoded together (default 4); up to 8 more wait in the queue")
    p.add_argument("--context", type=int, default=4096, metavar="N",
                   help="context cells, split equally between the sequences (default 4096)")
    p.add_argument("--chat-template", metavar="T", help="a built-in template name (e.g. gemma) or a Jinja string")
    p.add_argument("--cpu-extra-buffers", choices=CPU_EXTRA_BUFFERS, default=None,
                   help="AMX/repack weight buffers: auto probes once per CPU and build in a child process "
                   "(default $ANER_NB_CPU_EXTRA_BUFFERS or auto)")
    p.add_argument("--api-key-env", metavar="VAR",
                   help="require 'Authorization: Bearer <key>' with the key read from environment variable VAR")
    p.add_argument("--name", help="the model id clients see (default: the model's name)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="output cap per request (default 256)")
    p.add_argument("--timeout-ms", type=int, default=120_000, metavar="MS", help="request timeout (default 120000)")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="engine threads for every decode step, one-row or batched (default 0: the engine's defaults)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from .. import api, llm
    from ..llm.errors import LLMError

    token = None
    if args.api_key_env:
        token = os.environ.get(args.api_key_env)
        if not token:
            print(f"aner-nb serve: environment variable {args.api_key_env} is unset or empty", file=sys.stderr)
            return 2
    try:
        base = llm.load(args.model, context=args.context, chat_template=args.chat_template,
                        cpu_extra_buffers=args.cpu_extra_buffers)
    except (LLMError, OSError) as exc:
        print(f"aner-nb serve: cannot load {args.model}: {exc}", file=sys.stderr)
        return 2
    model = source = None
    try:
        source = base.with_optimizer(threads=args.threads, prefill_threads=args.threads) if args.threads else base
        model = source.with_batching(args.max_sequences)
        service = (
            api.app(f"aner-nb serve {os.path.basename(args.model)}")
            .llm(path="/chat", model=model, name=args.name)
            .bind(host=args.host, port=args.port)
            .limits(timeout_ms=args.timeout_ms)
            .output_limit(max_tokens=args.max_tokens)
            .auth(bearer_token=token)
        )
        server = service.start()
        print(f"aner-nb serve: {server.models[0]} at {server.url}", flush=True)
        server.serve()
    except (LLMError, OSError, RuntimeError) as exc:
        print(f"aner-nb serve: {exc}", file=sys.stderr)
        return 2
    finally:
        for lease in (model, source, base):
            if lease is not None:
                lease.close()
    return 0
