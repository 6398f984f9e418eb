"""``aner-nb serve MODEL.gguf``: load a model, serve it over a batching lease until Ctrl-C or SIGTERM.

Every option is checked before the model file is read (hashing a large
model takes a while; a typo should not): its type and range, then the load
settings (``LoadSettings``) and the service settings (the ``api.app``
builders), each failure one line on stderr with exit code 2. Each option
``--some-option`` also takes its default from the environment variable
``ANER_NB_SOME_OPTION`` (the model path from ``ANER_NB_MODEL``); the
command line wins. API keys are read from an environment variable
(``--api-key-env VAR``) and/or a file (``--api-key-file PATH``, one key per
line), never from the command line, where other users could read them in
the process list.

Once the service accepts connections it prints ``aner-nb serve: <model id>
at <url>`` (with ``--port 0`` it names the port that was picked), then the
model's SHA-256 fingerprint and the context each sequence gets.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Optional

from .._version import __version__
from ..llm.batching import MAX_SEQUENCES
from ..llm.draft_policy import MAX_SPECULATIVE_TOKENS
from ..llm.memory import KV_CACHE_TYPES
from ..llm.options import REGISTRY
from ..llm.profiles import CPU_EXTRA_BUFFERS, DEFAULT_DISK_BYTES, FLASH_ATTENTION, MAX_CONTEXT, MAX_TIER_BYTES
from . import LOG_LEVELS, MAX_CONNECTIONS, MAX_KEEPALIVE_S, MAX_READ_TIMEOUT_S, MIN_READ_TIMEOUT_S
from .connections import DEFAULT_PER_CLIENT
from .routes import service_routes

__all__ = ["main", "parser", "OPTIONS"]

ENV_PREFIX = "ANER_NB_"
# --context 0: the model's declared context, capped so a long-context model does not reserve gigabytes of KV.
AUTO_CONTEXT_CAP = 16_384
DEFAULT_OUTPUT_TOKENS = 2048  # a chat answer's worth; requests that omit max_tokens stop at what fits anyway
_MAX_TOKENS = REGISTRY["max_tokens"]  # --max-tokens: the request option's bounds and default


def _int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"expected an integer in {low}..{high}, got {text!r}") from None
        if not low <= value <= high:
            raise ValueError(f"expected an integer in {low}..{high}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    bounds = f"0..{MAX_KEEPALIVE_S:g} (0 = off)"
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected seconds in {bounds}, got {text!r}") from None
    if not math.isfinite(value) or not 0 <= value <= MAX_KEEPALIVE_S:
        raise ValueError(f"expected seconds in {bounds}, got {text}")
    return value


def _read_timeout(text: str) -> float:
    bounds = f"{MIN_READ_TIMEOUT_S:g}..{MAX_READ_TIMEOUT_S:g}"
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected seconds in {bounds}, got {text!r}") from None
    if not math.isfinite(value) or not MIN_READ_TIMEOUT_S <= value <= MAX_READ_TIMEOUT_S:
        raise ValueError(f"expected seconds in {bounds}, got {text}")
    return value


def _text(text: str) -> str:
    if not text.strip():
        raise ValueError("expected a non-empty value")
    return text


def _names(text: str) -> list[str]:
    """A comma-separated list (of host names)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError("expected a comma-separated list of host names (or *)")
    return names


def _flag(text: str) -> bool:
    """An environment variable's yes/no."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 1/true/yes/on or 0/false/no/off, got {text!r}")


@dataclass(frozen=True)
class Option:
    """One option of ``aner-nb serve``: its flag, how a value is read, its default and its help."""

    dest: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    metavar: Optional[str] = None
    choices: Optional[tuple[str, ...]] = None
    kind: str = "value"  # "value", "repeat" (given several times; comma-separated in the environment), "switch"
    aliases: tuple[str, ...] = ()  # other spellings of the flag

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    def from_env(self) -> Any:
        """The value of the environment variable, parsed; None when it is unset or empty."""
        raw = os.environ.get(self.env, "").strip()
        if not raw:
            return None
        if self.kind == "repeat":
            return [self.parse(part.strip()) for part in raw.split(",") if part.strip()]
        if self.choices is not None and raw not in self.choices:
            raise ValueError(f"invalid choice {raw!r} (choose from {', '.join(self.choices)})")
        return self.parse(raw)


OPTIONS: tuple[Option, ...] = (
    Option("host", _text, "127.0.0.1", "address to listen on (loopback only by default)"),
    Option("port", _int_in(0, 65535), 11435, "port; 0 picks a free one", "PORT"),
    Option("max_sequences", _int_in(1, MAX_SEQUENCES), 4, "requests decoded together; up to 8 more wait in the queue", "N"),
    Option("prefix_cache_entries", _int_in(0, 16), 0, "evaluated prompt prefixes kept and shared by later requests "
           "that start with the same tokens (a common system prompt is evaluated once); each costs one more "
           "sequence's KV", "N"),
    Option("prefix_cache_tokens", _int_in(1, MAX_CONTEXT), 2048, "tokens each shared prefix keeps at most", "N"),
    Option("prefix_cache_ram_bytes", _int_in(0, MAX_TIER_BYTES), 0, "keep shared prefixes evicted from live KV in "
           "host RAM, at most N bytes (0: off; needs --prefix-cache-entries)", "N"),
    Option("prefix_cache_dir", _text, None, "keep every evaluated prompt prefix in DIR too, so a restarted server "
           "restores it instead of evaluating it (needs --prefix-cache-entries)", "DIR"),
    Option("prefix_cache_disk_bytes", _int_in(1, MAX_TIER_BYTES), DEFAULT_DISK_BYTES,
           "at most N bytes in --prefix-cache-dir", "N"),
    Option("speculative_tokens", _int_in(0, MAX_SPECULATIVE_TOKENS), 0, "prompt-lookup proposals a plain greedy "
           "request may verify per step, where the measured row costs say they pay (0: off)", "N"),
    Option("context", _int_in(0, MAX_CONTEXT), 0, "context cells, split equally between the sequences (0: the "
           f"model's declared context, at most {AUTO_CONTEXT_CAP:,})", "N"),
    Option("chat_template", _text, None, "a built-in template name (e.g. gemma) or a Jinja string", "T"),
    Option("device", _text, "auto", "auto, cpu, cuda, cuda:N, metal or mps (an explicit device never falls back)"),
    Option("kv_cache_type", str, "f16", "KV cache type (q8_0/q4_0 need flash attention)", choices=KV_CACHE_TYPES),
    Option("flash_attention", str, "auto", "flash attention", choices=FLASH_ATTENTION),
    Option("cpu_extra_buffers", str, "auto", "AMX/repack weight buffers: auto probes once per CPU and build in a "
           "child process", choices=CPU_EXTRA_BUFFERS),
    Option("threads", _int_in(0, 256), 0, "engine threads for every decode step, one-row or batched "
           "(0: the engine's defaults)", "N"),
    Option("name", _text, None, "the model id clients see (none: the model's name)"),
    Option("max_output_tokens", _int_in(int(_MAX_TOKENS.low), int(_MAX_TOKENS.high)), DEFAULT_OUTPUT_TOKENS,
           "output cap per request: a larger max_tokens is answered 422 naming the cap (OpenAI refuses a "
           "max_tokens its model cannot give); a request without max_tokens gets the cap, or what fits its "
           "sequence's context", "N", aliases=("--max-tokens",)),
    Option("max_messages", _int_in(1, 4096), 256, "messages per chat request (a longer one is answered 400)", "N"),
    Option("max_body_bytes", _int_in(64, 1 << 30), 4 << 20, "request body size; a larger body is answered 413 "
           "unread", "BYTES"),
    Option("timeout_ms", _int_in(1, 24 * 3600 * 1000), 120_000, "request timeout", "MS"),
    Option("sse_keepalive", _seconds, 15.0, "seconds between ': keep-alive' comments while a stream has no new "
           "text (0 = off)", "SECONDS"),
    Option("header_timeout", _read_timeout, 10.0, "seconds a request's line and headers may take to arrive; "
           "a slower connection is closed (slow-loris)", "SECONDS"),
    Option("body_timeout", _read_timeout, 30.0, "seconds a request's body may take to arrive after its headers; "
           "a slower one is answered 408", "SECONDS"),
    Option("api_key_env", _text, None, "require 'Authorization: Bearer <key>' with the key read from environment "
           "variable VAR", "VAR"),
    Option("api_key_file", _text, None, "also accept the keys in this file (one per line; blank lines and # "
           "comments ignored; read once at start, at most 64 KiB)", "PATH"),
    Option("cors_origin", _text, [], "a browser origin (https://host[:port], or *) allowed to call the service; "
           "repeatable or comma-separated; other origins get 403", "ORIGIN", kind="repeat", aliases=("--cors-origins",)),
    Option("allowed_hosts", _names, [], "Host names answered besides localhost, *.localhost and loopback "
           "addresses (bound elsewhere also any IP address and the --host name); comma-separated, *.domain for "
           "subdomains, * for any; other hosts get 403 (DNS rebinding)", "HOSTS"),
    Option("max_connections_per_client", _int_in(0, MAX_CONNECTIONS), DEFAULT_PER_CLIENT, "open connections per "
           "client address; more are answered 429 and closed at once (0: no limit; behind a gateway every "
           "request comes from its address)", "N"),
    Option("max_connections", _int_in(0, MAX_CONNECTIONS), 0, "open connections in all; at the limit the oldest "
           "idle one is closed to make room (0: 4 x the requests admitted at once + 32)", "N"),
    Option("log_level", str, "warning", "log level of the server and the library", choices=LOG_LEVELS),
    Option("access_log", _flag, False, "log one line per request", kind="switch"),
    Option("lenient_fields", _flag, False, "ignore unknown fields on the OpenAI routes (named in the answer's "
           "X-Aner-Ignored-Fields header) instead of answering 400, for clients that send other servers' "
           "extra_body knobs", kind="switch"),
)


def _argument_type(option: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return option.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = option.dest  # argparse names the type in some messages
    return convert


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return "none" if not value else ",".join(value)
    return "none" if value is None else str(value)


def parser() -> argparse.ArgumentParser:
    routes = ", ".join(r.listing for r in service_routes([("/chat", "")]) if not r.builtin)
    p = argparse.ArgumentParser(
        prog="aner-nb serve",
        description=f"Serve a GGUF model over HTTP: {routes} (/v1 is OpenAI-compatible). "
        "Concurrent requests share one continuous-batching scheduler.",
        epilog=f"Every option --some-option defaults to the environment variable {ENV_PREFIX}SOME_OPTION "
        f"(MODEL.gguf to {ENV_PREFIX}MODEL; a repeatable option takes a comma-separated list; a switch "
        "takes 1/0); the command line wins. Options are checked before the model is read.",
    )
    p.add_argument("model", metavar="MODEL.gguf", nargs="?", default=None,
                   help=f"a single-file GGUF text model (env {ENV_PREFIX}MODEL)")
    p.add_argument("--version", action="version", version=_version())
    for option in OPTIONS:
        text = f"{option.help} (default {_shown(option.default)}; env {option.env})"
        if option.kind == "switch":
            p.add_argument(option.flag, dest=option.dest, action=argparse.BooleanOptionalAction, default=None,
                           help=text)
        elif option.kind == "repeat":
            p.add_argument(option.flag, *option.aliases, dest=option.dest, action="append",
                           type=_argument_type(option), default=None, metavar=option.metavar, help=text)
        else:
            p.add_argument(option.flag, *option.aliases, dest=option.dest, type=_argument_type(option),
                           default=None, metavar=option.metavar, choices=option.choices, help=text)
    return p


def _version() -> str:
    try:
        engine = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        engine = "not installed"
    return f"aner-nb {__version__} (llama-cpp-python {engine})"


def resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill every option the command line left out from its environment variable, else its default."""
    for option in OPTIONS:
        if getattr(args, option.dest) is not None:
            continue
        try:
            value = option.from_env()
        except ValueError as exc:
            p.error(f"{option.env} (for {option.flag}): {exc}")
        setattr(args, option.dest, option.default if value is None else value)
    if args.model is None:
        args.model = os.environ.get(ENV_PREFIX + "MODEL") or None
    if args.model is None:
        p.error(f"the model path is required (MODEL.gguf or {ENV_PREFIX}MODEL)")
    return args


def check(args: argparse.Namespace) -> tuple[Any, Optional[str]]:
    """Check everything but the model's contents; returns the service builder (no model yet) and the API key.

    Raises ``ValueError`` or the library's ``ConfigurationError`` with a one-line message.
    """
    from .. import api
    from ..llm.chat import resolve_template
    from ..llm.loader import resolve_device
    from ..llm.profiles import LoadSettings, OptimizerSettings

    if not os.path.isfile(args.model):
        raise ValueError(f"{args.model}: no such file")
    token = None
    if args.api_key_env:
        token = os.environ.get(args.api_key_env)
        if not token:
            raise ValueError(f"environment variable {args.api_key_env} is unset or empty")
    LoadSettings(context=args.context or 1, device=args.device, kv_cache_type=args.kv_cache_type,
                 flash_attention=args.flash_attention, chat_template=args.chat_template,
                 cpu_extra_buffers=args.cpu_extra_buffers)
    resolve_device(args.device)  # an explicit device this build lacks fails now, not after hashing
    if args.chat_template is not None:
        resolve_template(args.chat_template, None)  # a built-in name, or Jinja that compiles in the sandbox
    OptimizerSettings(threads=args.threads, prefill_threads=args.threads)
    OptimizerSettings(  # the prefix tiers need shared prefixes: refused before the model is hashed
        prefix_cache_entries=args.prefix_cache_entries, prefix_cache_ram_bytes=args.prefix_cache_ram_bytes,
        prefix_cache_dir=args.prefix_cache_dir, prefix_cache_disk_bytes=args.prefix_cache_disk_bytes,
    )
    if args.context and args.context < args.max_sequences:
        raise ValueError(f"--max-sequences {args.max_sequences} must be <= --context {args.context}: each sequence "
                         "gets an equal share of the context")
    try:
        socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"--host {args.host}: {exc}") from None
    origins = [o.strip() for value in args.cors_origin for o in value.split(",") if o.strip()]
    builder = (
        api.app(f"aner-nb serve {os.path.basename(args.model)}")
        .bind(host=args.host, port=args.port)
        .limits(timeout_ms=args.timeout_ms, max_rows=args.max_messages, max_body_bytes=args.max_body_bytes)
        .output_limit(max_tokens=args.max_output_tokens)
        .auth(bearer_token=token, api_key_file=args.api_key_file)
        .sse(keepalive_s=args.sse_keepalive)
        .read_timeouts(header_s=args.header_timeout, body_s=args.body_timeout)
        .cors(origins=origins)
        .allowed_hosts(args.allowed_hosts)
        .connections(max_per_client=args.max_connections_per_client, max_total=args.max_connections or None)
        .logs(level=args.log_level, access_log=args.access_log)
        .fields(lenient=args.lenient_fields)
    )
    return builder, token


def auto_context(model: str, sequences: int) -> int:
    """``--context 0``: the model's declared context (at most AUTO_CONTEXT_CAP), so each of ``sequences``
    gets an equal share of what the model was trained for; at least one cell per sequence."""
    from ..llm.artifact import inspect_model

    return max(sequences, min(inspect_model(model).context_length, AUTO_CONTEXT_CAP))


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = resolve(p, p.parse_args(argv))
    from .. import llm
    from ..llm.errors import LLMError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        builder, _ = check(args)
    except (ValueError, LLMError) as exc:
        print(f"aner-nb serve: {exc}", file=sys.stderr)
        return 2
    try:
        context = args.context or auto_context(args.model, args.max_sequences)
        base = llm.load(args.model, context=context, device=args.device, kv_cache_type=args.kv_cache_type,
                        flash_attention=args.flash_attention, chat_template=args.chat_template,
                        cpu_extra_buffers=args.cpu_extra_buffers)
    except (LLMError, OSError) as exc:
        print(f"aner-nb serve: cannot load {args.model}: {exc}", file=sys.stderr)
        return 2
    return _serve(builder, base, args)


def _serve(builder: Any, base: Any, args: argparse.Namespace) -> int:
    """Serve ``base`` (through a batching lease) until stopped; close every lease made here."""
    from ..llm.errors import LLMError

    model = source = None
    try:
        source = base.with_optimizer(threads=args.threads, prefill_threads=args.threads) if args.threads else base
        model = source.with_batching(
            args.max_sequences, prefix_cache_entries=args.prefix_cache_entries,
            prefix_cache_tokens=args.prefix_cache_tokens, prefix_cache_ram_bytes=args.prefix_cache_ram_bytes,
            prefix_cache_dir=os.path.expanduser(args.prefix_cache_dir) if args.prefix_cache_dir else None,
            prefix_cache_disk_bytes=args.prefix_cache_disk_bytes, speculative_tokens=args.speculative_tokens,
        )
        server = builder.llm(path="/chat", model=model, name=args.name).start()
        stats = model.stats()
        print(f"aner-nb serve: {server.models[0]} at {server.url}", flush=True)
        print(f"  model sha256 {model.fingerprint}", flush=True)
        print(f"  context {stats.sequence_context} tokens per sequence x {stats.max_sequences} sequences "
              f"(+{stats.queue_limit} queued)", flush=True)
        if stats.prefix_cache_capacity:
            print(f"  shared prefixes: up to {stats.prefix_cache_capacity} of {args.prefix_cache_tokens} tokens",
                  flush=True)
        server.serve()
    except (LLMError, OSError, RuntimeError) as exc:
        print(f"aner-nb serve: {exc}", file=sys.stderr)
        return 2
    finally:
        for lease in (model, source, base):
            if lease is not None:
                lease.close()
    return 0
