"""Argument grammar of ``%llm``, ``%%generate`` and ``%%chat``.

One argparse parser per subcommand. Parsers never print usage or exit the
kernel: every error becomes an IPython ``UsageError`` with a one-line message
(shown without a traceback), and ``-h`` prints the help and stops. Each
parser's epilog is the Python-API equivalent, so ``%llm help SUB`` and
``%llm SUB -h`` always show how to do the same thing without the magic.
"""

from __future__ import annotations

import argparse
import difflib
import keyword
import re
import sys
from typing import Any, Mapping

from IPython.core.error import UsageError
from IPython.utils.process import arg_split

from ..llm import KV_CACHE_TYPES
from ..llm.profiles import CPU_EXTRA_BUFFERS, FLASH_ATTENTION

__all__ = [
    "HelpShown",
    "SUBCOMMANDS",
    "NOT_YET",
    "BENCH_PROMPT",
    "parse_llm",
    "parse_generate",
    "parse_chat",
    "subcommand_parser",
    "overview",
    "interpolate",
    "one_line",
    "check_name",
]


class HelpShown(Exception):
    """``-h`` was given: the help was printed and nothing should run."""


def one_line(text: object) -> str:
    """Collapse whitespace so a message is one line."""
    return " ".join(str(text).split())


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises UsageError instead of printing usage and exiting."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {one_line(message)} (see `{self.prog} -h`)")

    def exit(self, status: int = 0, message: str | None = None) -> Any:  # type: ignore[override]
        if message:
            sys.stdout.write(message)
        raise HelpShown()


def _int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    return value


# name -> (usage summary, one-line description, Python equivalent)
_DOC: dict[str, tuple[str, str, str]] = {
    "load": (
        "%llm load PATH --as NAME [--context N] [--device D] [--kv-cache-type T] "
        "[--flash-attention P] [--chat-template T] [--cpu-extra-buffers B]",
        "Admit, hash and load a GGUF model; re-running with the same NAME closes the previous NAME first.",
        "NAME = llm.load(PATH, context=N, device=D, kv_cache_type=T, flash_attention=P, chat_template=T, "
        "cpu_extra_buffers=B)",
    ),
    "optimize": (
        "%llm optimize SRC --as NAME [--threads N] [--prefill-threads N] [--batch-tokens N] "
        "[--micro-batch-tokens N] [--prefix-cache-entries N] [--prefix-cache-tokens N] [--speculative-tokens N]",
        "Derive a latency-profile lease (threads, batch sizes, prefix cache, prompt lookup) on the same weights.",
        "NAME = SRC.with_optimizer(threads=N, prefill_threads=N, batch_tokens=N, micro_batch_tokens=N, "
        "prefix_cache_entries=N, prefix_cache_tokens=N, speculative_tokens=N)",
    ),
    "batch": (
        "%llm batch SRC --as NAME --max-sequences N",
        "Derive a continuous-batching (throughput) lease serving up to N sequences at once.",
        "NAME = SRC.with_batching(N)",
    ),
    "adapter": (
        "%llm adapter SRC MANIFEST --as NAME",
        "Derive a lease with the LoRA adapter described by MANIFEST.",
        "NAME = SRC.with_adapter(MANIFEST)",
    ),
    "pool": (
        "%llm pool SRC --as NAME --max-idle N",
        "Derive a lease that keeps up to N (0..4) idle contexts between requests.",
        "NAME = SRC.with_context_pool(N)",
    ),
    "list": (
        "%llm list",
        "A DataFrame of the live handles: name, kind, architecture, profile, device, context, fingerprint, state.",
        "from aner_nb.magics import handle_table; handle_table(globals())",
    ),
    "info": (
        "%llm info NAME",
        "Metadata, load summary, memory summary and KV estimate of one handle, as a DataFrame.",
        "from aner_nb.magics import handle_info; handle_info(NAME)  # NAME.memory_summary(), NAME.load_summary()",
    ),
    "kv": (
        "%llm kv NAME [--context N] [--kv-cache-type T] [--slots N]",
        "KV-cache bytes for N resident contexts of this model (every KV type unless --kv-cache-type).",
        "from aner_nb.magics import kv_table; kv_table(NAME, context=N, kv_cache_type=T, slots=S)  "
        "# llm.kv_estimate(context, layers, kv_heads, head_dim_k, head_dim_v, T) * S",
    ),
    "close": (
        "%llm close NAME [NAME ...] | --all",
        "Close handles (and the %%chat sessions opened on them); weights are freed when no lease uses them.",
        "NAME.close()",
    ),
    "serve": (
        "%llm serve NAME [--port P]",
        "Serve a handle over HTTP on 127.0.0.1 (POST /chat, POST /v1/chat/completions, GET /v1/models, /health, "
        "/metrics) from a background thread; the handle stays alive until %llm stop.",
        "server = api.app(title).llm(path='/chat', model=NAME).bind(port=P).start()   # from aner_nb import api",
    ),
    "stop": (
        "%llm stop [NAME]",
        "Stop the HTTP server of NAME (default: every server started by %llm serve); the handle stays open.",
        "server.stop()",
    ),
    "bench": (
        "%llm bench A B [--prompt TEXT ...] [--max-tokens N] [--rounds N] [--warmup N] [--as VAR]",
        "Paired benchmark of two handles: the same prompts on both, ABBA order, warm-up rounds dropped. "
        "Shows medians with min/max and the ratio to A (first_token_ms, decode_tokens_per_s, total_ms) and, "
        "per prompt, whether B's output is identical to A's; the BenchResult goes to VAR and _.",
        "from aner_nb import bench; from aner_nb.magics import bench_table, bench_outputs; "
        "VAR = bench.run_sides([bench.lease_side('A', A), bench.lease_side('B', B)], "
        "[bench.Case('p1', TEXT, max_tokens=N)], rounds=N, warmup=N, baseline='A', manifest_=bench.manifest(B)); "
        "bench_table(VAR); bench_outputs(VAR)",
    ),
    "help": (
        "%llm help [SUBCOMMAND]",
        "Show this overview, or one subcommand's options.",
        "help(aner_nb.llm)",
    ),
}

SUBCOMMANDS = tuple(_DOC)
NOT_YET: tuple[str, ...] = ()  # subcommands documented but not wired yet (none at present)

# %llm bench without --prompt: one short prompt, so a quick A/B needs no arguments.
BENCH_PROMPT = "Write one sentence about why the sky is blue."

_CELL_DOC = {
    "generate": (
        "%%generate NAME [--max-tokens N] [--temperature T] [--seed S] [--stop STR] [--as VAR] "
        "[--stream | --no-stream | --quiet]",
        "The cell body is the prompt ({var} is replaced by the variable's value; unknown names stay as "
        "written, {{var}} is a literal {var}). The answer streams into one display that ends with the "
        "timings panel; the Response goes to VAR and to _. Ctrl-C cancels; the handle stays usable.",
        "s = NAME.stream(prompt, max_tokens=N, temperature=T, seed=S, stop=[STR]); "
        "for piece in s: print(piece, end=''); VAR = s.response   # or VAR = NAME.generate(prompt, ...)",
    ),
    "chat": (
        "%%chat NAME [--session VAR] [--system TEXT] [--new] [--max-tokens N] [--temperature T] [--seed S] "
        "[--stop STR] [--as VAR] [--stream | --no-stream | --quiet]",
        "Send the cell body as the next user turn of a persistent session (default VAR: NAME_chat), "
        "which keeps its history in its own context across cells. --new starts over.",
        "VAR = NAME.session(system=TEXT); r = VAR.send(body, max_tokens=N)   # or VAR.stream(body, ...)",
    ),
}


def _escape(text: str) -> str:
    """argparse %-formats usage strings; the magics' own % signs must survive."""
    return text.replace("%", "%%")


def _epilog(python: str) -> str:
    return f"Python equivalent:\n  {python}"


def _add_as(p: argparse.ArgumentParser, required: bool = True, what: str = "the new handle") -> None:
    p.add_argument("--as", dest="name", metavar="NAME", required=required, help=f"variable name for {what}")


def subcommand_parser(sub: str) -> argparse.ArgumentParser:
    """The parser of one ``%llm`` subcommand."""
    usage, description, python = _DOC[sub]
    p = _Parser(prog=f"%llm {sub}", description=description, epilog=_epilog(python), usage=_escape(usage))
    if sub == "load":
        p.add_argument("path", metavar="PATH", help="a single-file GGUF text model")
        _add_as(p)
        p.add_argument("--context", type=_int, metavar="N", help="context tokens (default 4096)")
        p.add_argument("--device", metavar="D", help="auto, cpu, cuda, cuda:0, metal (default auto)")
        p.add_argument("--kv-cache-type", choices=KV_CACHE_TYPES, help="KV cache type (default f16)")
        p.add_argument("--flash-attention", choices=FLASH_ATTENTION, help="flash attention (default auto)")
        p.add_argument("--chat-template", metavar="T", help="a built-in template name (e.g. gemma) or a Jinja string")
        p.add_argument("--cpu-extra-buffers", choices=CPU_EXTRA_BUFFERS,
                       help="AMX/repack weight buffers (default auto: probed once per CPU and build)")
    elif sub == "optimize":
        p.add_argument("src", metavar="SRC", help="the source handle")
        _add_as(p)
        for flag in ("threads", "prefill-threads", "batch-tokens", "micro-batch-tokens",
                     "prefix-cache-entries", "prefix-cache-tokens", "speculative-tokens"):
            p.add_argument(f"--{flag}", type=_int, metavar="N")
    elif sub == "batch":
        p.add_argument("src", metavar="SRC", help="the source handle")
        _add_as(p)
        p.add_argument("--max-sequences", type=_int, metavar="N", required=True)
    elif sub == "adapter":
        p.add_argument("src", metavar="SRC", help="the source handle")
        p.add_argument("manifest", metavar="MANIFEST", help="the adapter manifest file")
        _add_as(p)
    elif sub == "pool":
        p.add_argument("src", metavar="SRC", help="the source handle")
        _add_as(p)
        p.add_argument("--max-idle", type=_int, metavar="N", required=True)
    elif sub == "info":
        p.add_argument("target", metavar="NAME")
    elif sub == "kv":
        p.add_argument("target", metavar="NAME")
        p.add_argument("--context", type=_int, metavar="N", help="context tokens (default: the handle's)")
        p.add_argument("--kv-cache-type", choices=KV_CACHE_TYPES, help="one KV type (default: all of them)")
        p.add_argument("--slots", type=_int, metavar="N", default=1,
                       help="resident contexts of this size: active requests + idle pool + sessions (default 1)")
    elif sub == "close":
        p.add_argument("targets", metavar="NAME", nargs="*")
        p.add_argument("--all", action="store_true", help="close every handle the extension tracks")
    elif sub == "serve":
        p.add_argument("target", metavar="NAME")
        p.add_argument("--port", type=_int, metavar="P", default=11435, help="port on 127.0.0.1 (default 11435; 0: any free)")
    elif sub == "stop":
        p.add_argument("target", metavar="NAME", nargs="?")
    elif sub == "help":
        p.add_argument("topic", metavar="SUBCOMMAND", nargs="?")
    elif sub == "bench":
        p.add_argument("a", metavar="A", help="the baseline handle (a lease)")
        p.add_argument("b", metavar="B", help="the handle compared with A (a lease)")
        p.add_argument("--prompt", dest="prompts", action="append", metavar="TEXT",
                       help="a prompt (repeatable; {var} is replaced by the variable's value; "
                       "default: one short built-in prompt)")
        p.add_argument("--max-tokens", type=_int, metavar="N", default=64, help="tokens per request (default 64)")
        p.add_argument("--rounds", type=_int, metavar="N", default=3, help="measured rounds (default 3)")
        p.add_argument("--warmup", type=_int, metavar="N", default=1, help="warm-up rounds, dropped (default 1)")
        p.add_argument("--as", dest="var", metavar="VAR", help="also store the BenchResult in this variable")
    return p


def _request_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=_int, metavar="N",
                   help="most tokens to generate (default: %%config LLMMagics.max_tokens)")
    p.add_argument("--temperature", type=float, metavar="T", default=0.0, help="0 (greedy, default) .. 2")
    p.add_argument("--seed", type=_int, metavar="S", default=0)
    p.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    p.add_argument("--as", dest="var", metavar="VAR", help="also store the Response in this variable")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stream", dest="display", action="store_const", const="stream",
                      help="stream into the display (default: %%config LLMMagics.display)")
    mode.add_argument("--no-stream", dest="display", action="store_const", const="final",
                      help="show only the final answer and timings")
    mode.add_argument("--quiet", dest="display", action="store_const", const="none",
                      help="show nothing (the Response still goes to VAR and _)")


def cell_parser(kind: str) -> argparse.ArgumentParser:
    usage, description, python = _CELL_DOC[kind]
    p = _Parser(prog=f"%%{kind}", description=description, epilog=_epilog(python), usage=_escape(usage))
    p.add_argument("target", metavar="NAME", help="the handle to ask")
    if kind == "chat":
        p.add_argument("--session", metavar="VAR", help="variable holding the session (default NAME_chat)")
        p.add_argument("--system", metavar="TEXT", help="system prompt of a new session")
        p.add_argument("--new", action="store_true", help="close the existing session and start a new one")
    _request_options(p)
    return p


def _split(line: str, prog: str) -> list[str]:
    try:
        return arg_split(line, posix=not sys.platform.startswith("win"), strict=True)
    except ValueError as exc:
        raise UsageError(f"{prog}: {one_line(exc)} (check the quotes)") from None


def parse_llm(line: str) -> tuple[str, argparse.Namespace]:
    """Split ``%llm`` arguments into (subcommand, options); raises UsageError or HelpShown."""
    argv = _split(line, "%llm")
    if not argv:
        return "help", argparse.Namespace(topic=None)
    sub, rest = argv[0], argv[1:]
    if sub in ("-h", "--help"):
        return "help", argparse.Namespace(topic=None)
    if sub not in _DOC:
        close = difflib.get_close_matches(sub, SUBCOMMANDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(f"%llm: unknown subcommand {sub!r}; {hint}use one of: {', '.join(SUBCOMMANDS)}")
    return sub, subcommand_parser(sub).parse_args(rest)


def parse_generate(line: str) -> argparse.Namespace:
    return cell_parser("generate").parse_args(_split(line, "%%generate"))


def parse_chat(line: str) -> argparse.Namespace:
    return cell_parser("chat").parse_args(_split(line, "%%chat"))


def check_name(name: str, prog: str, what: str = "--as") -> str:
    """A variable name a handle or result can be stored under."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UsageError(f"{prog}: {what} {name!r} is not a valid Python variable name")
    return name


def overview() -> str:
    """The ``%llm help`` text: every magic, what it does, and its Python equivalent."""
    lines = [
        "aner_nb notebook magics (load with %load_ext aner_nb). `from aner_nb import llm` is the library under them.",
        "",
    ]
    for usage, description, python in [*(_DOC[s] for s in SUBCOMMANDS), *_CELL_DOC.values()]:
        lines += [usage, f"    {description}", f"    Python: {python}", ""]
    lines += [
        "Handles live in the notebook namespace under --as NAME and are tracked weakly: `del NAME`, "
        "overwriting NAME, %reset, a failed cell, %unload_ext aner_nb and kernel exit release their memory.",
        "Settings: %config LLMMagics.stream_interval / max_tokens / display / release_failed_cells.",
        "Details of one subcommand: %llm help SUBCOMMAND (or %llm SUBCOMMAND -h).",
    ]
    return "\n".join(lines)


_VAR = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


def interpolate(template: str, namespace: Mapping[str, Any]) -> str:
    """Replace ``{name}`` with ``str(namespace[name])``; unknown names stay, ``{{name}}`` is a literal ``{name}``.

    Only plain names are looked up (no attribute access or expressions), so
    braces in JSON or code inside a prompt are left alone.
    """

    def sub(match: "re.Match[str]") -> str:
        escaped, name = match.groups()
        if escaped is not None:
            return "{" + escaped + "}"
        if name in namespace:
            return str(namespace[name])
        return match.group(0)

    return _VAR.sub(sub, template)
