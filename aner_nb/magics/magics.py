"""``LLMMagics``: the ``%llm`` line magic and the ``%%generate`` / ``%%chat`` cell magics.

Thin on purpose: parse the arguments, call the library (or the pure
functions of ``tables``), show the result (``display``). As with IPython's
``magic_arguments``, each subcommand's grammar sits on its handler: a
``%llm`` subcommand is one ``_llm_NAME`` method with ``@subcommand(...)``
(usage, description, Python equivalent) and its ``@argument`` options; the
method order is the order ``%llm help`` lists them. Handle lifetime is the
registry's job (``handles``), cell prompts are filled in by ``prompt``, tab
completion reads the grammars (``completion``); ``Extension`` wires
everything into one shell and takes it out again symmetrically.

A cell or ``%llm info`` / ``kv`` / ``bench`` without a NAME asks the default
handle (``LLMMagics.default_handle``, set by ``%llm use``; with
``default_to_latest``, else the most recently loaded or derived one) and
says which handle that was. Ctrl-C in a request cell cancels it and keeps
the partial Response; ``on_interrupt`` decides whether the cell then fails
with KeyboardInterrupt (so a notebook's queued cells stop) or ends normally.
"""

from __future__ import annotations

import atexit
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from traitlets import Bool, Enum, Float, Int, Unicode

from ..llm import KV_CACHE_TYPES, load
from ..llm.errors import EngineError, LLMError
from ..llm.profiles import CPU_EXTRA_BUFFERS, FLASH_ATTENTION
from ..widgets.answer import FORMATS
from .cells import request_kwargs, request_options, stream_into
from .completion import completion_matcher
from .display import make_view
from .handles import HandleRegistry
from .parser import (
    Grammar,
    HelpShown,
    argument,
    arguments,
    cell_grammar,
    check_name,
    grammar_of,
    int_arg,
    one_line,
    overview,
    parse_llm,
    subcommand,
)
from .prompt import PromptError, interpolate, last_error
from .tables import bench_outputs, bench_table, handle_info, handle_kind, is_handle, kv_table

__all__ = ["LLMMagics", "Extension", "library_errors", "SUBCOMMANDS", "COMMANDS", "CELL_GRAMMARS", "BENCH_PROMPT"]

# %llm bench without --prompt: one short prompt, so a quick A/B needs no arguments.
BENCH_PROMPT = "Write one sentence about why the sky is blue."


# %llm optimize's options: with_optimizer's keyword arguments, each --key-with-dashes N.
_OPTIMIZER = ("threads", "prefill_threads", "batch_tokens", "micro_batch_tokens",
              "prefix_cache_entries", "prefix_cache_tokens", "speculative_tokens")


# Options several subcommands share, as reusable decorators.
_NEW_HANDLE = argument("--as", dest="name", metavar="NAME", required=True, help="variable name for the new handle")
_SOURCE = argument("src", metavar="SRC", help="the source handle")
_TARGET = argument("target", metavar="NAME", nargs="?", help="the handle (default: the default handle, see %%llm use)")


def _derives(sub: str, method: str, option: str, *, description: str) -> Any:
    """The handler of ``%llm SUB SRC --as NAME --OPTION N``: ``NAME = SRC.METHOD(N)``, with its grammar."""
    flag = f"--{option.replace('_', '-')}"

    @subcommand(sub, usage=f"%llm {sub} SRC --as NAME {flag} N", description=description,
                python=f"NAME = SRC.{method}(N)")
    @_SOURCE
    @_NEW_HANDLE
    @argument(flag, type=int_arg, metavar="N", required=True)
    def handler(self: "LLMMagics", args: Any) -> None:
        self._derive(sub, args.src, args.name, method, getattr(args, option))

    return handler


@contextmanager
def library_errors(prog: str) -> Iterator[None]:
    """Turn a rejected argument (any library error but an engine failure) into a one-line UsageError."""
    try:
        yield
    except (UsageError, EngineError):
        raise
    except (LLMError, OSError) as exc:
        raise UsageError(f"{prog}: {type(exc).__name__}: {one_line(exc)}") from None


@magics_class
class LLMMagics(Magics):
    """Run local GGUF models from notebook cells; see ``%llm help``."""

    stream_interval = Float(
        0.1, min=0.0, help="Seconds between in-place updates of a streamed answer (0: update on every piece)."
    ).tag(config=True)
    max_tokens = Int(256, min=0, max=65536, help="Default --max-tokens of %%generate and %%chat.").tag(config=True)
    display = Enum(
        ("stream", "final", "none"), default_value="stream",
        help="Default display of %%generate and %%chat: stream (answer streams in, then timings), "
        "final (answer and timings at the end), none (show nothing; the Response goes to _).",
    ).tag(config=True)
    release_failed_cells = Bool(
        True, help="Close handles that only a failed cell's traceback still references (sys.last_traceback).",
    ).tag(config=True)
    format = Enum(
        FORMATS, default_value="markdown",
        help="Default --format of %%generate and %%chat: markdown (rendered as it streams), text, code or json.",
    ).tag(config=True)
    default_handle = Unicode(
        "", help="The handle that %%generate, %%chat and %llm info / kv / bench use when no NAME is given "
        "(%llm use NAME sets it; empty: see default_to_latest).",
    ).tag(config=True)
    default_to_latest = Bool(
        True, help="Without a NAME and without default_handle, use the most recently loaded or derived handle "
        "(the output names it). False: a NAME is required.",
    ).tag(config=True)
    on_interrupt = Enum(
        ("raise", "keep"), default_value="raise",
        help="Ctrl-C during %%generate / %%chat cancels the request and stores the partial Response in _ (and "
        "--as VAR); then 'raise' re-raises KeyboardInterrupt so the queued cells of Run All stop, 'keep' ends "
        "the cell normally.",
    ).tag(config=True)

    def __init__(self, shell: Any, handles: HandleRegistry) -> None:
        super().__init__(shell=shell)  # also appends self to shell.configurables (for %config)
        self.handles = handles

    # -- %llm -----------------------------------------------------------------------
    @line_magic
    def llm(self, line: str = "") -> Any:
        try:
            sub, args = parse_llm(line, COMMANDS)
        except HelpShown:
            return None
        return _HANDLERS[sub](self, args)

    @property
    def ns(self) -> dict[str, Any]:
        return self.shell.user_ns

    def _handle(self, name: str, prog: str) -> Any:
        """The handle bound to ``name``, or a UsageError naming the live ones."""
        value = self.ns.get(name)
        if value is None or not is_handle(value):
            names = self.handles.names()
            live = f"; handles: {', '.join(names)}" if names else "; load one with %llm load PATH --as NAME"
            what = f"{name!r} is a {type(value).__name__}, not a model handle" if value is not None else (
                f"no handle named {name!r}")
            raise UsageError(f"{prog}: {what}{live}")
        return value

    def _default_name(self, prog: str, missing: str = "NAME") -> str:
        """The default handle's name: ``default_handle``, else (with ``default_to_latest``) the latest."""
        if self.default_handle:
            value = self.ns.get(self.default_handle)
            if not is_handle(value) or value.closed:
                state = "closed" if is_handle(value) else "gone"
                raise UsageError(f"{prog}: the default handle {self.default_handle!r} is {state}; "
                                 "name a handle, or choose another with %llm use NAME")
            return self.default_handle
        latest = self.handles.latest() if self.default_to_latest else None
        if latest is None:
            raise UsageError(f"{prog}: the following arguments are required: {missing} "
                             "(or choose a default handle with %llm use NAME)")
        return latest

    def _target(self, name: str | None, prog: str) -> tuple[Any, str]:
        """``(handle, name)`` of ``name``, or of the default handle when no name was given."""
        if name is None:
            name = self._default_name(prog)
        return self._handle(name, prog), name

    @subcommand(
        "load",
        usage="%llm load PATH --as NAME [--context N] [--device D] [--kv-cache-type T] "
        "[--flash-attention P] [--chat-template T] [--cpu-extra-buffers B] [--no-warmup]",
        description="Admit, hash, load and warm up a GGUF model, with progress bars; the line it prints times each "
        "phase. Re-running with the same NAME closes the previous NAME first.",
        python="NAME = llm.load(PATH, context=N, device=D, kv_cache_type=T, flash_attention=P, chat_template=T, "
        "cpu_extra_buffers=B, warmup=True, progress=None)",
    )
    @argument("path", metavar="PATH", help="a single-file GGUF text model")
    @_NEW_HANDLE
    @argument("--context", type=int_arg, metavar="N", help="context tokens (default 4096)")
    @argument("--device", metavar="D", help="auto, cpu, cuda, cuda:0, metal (default auto)")
    @argument("--kv-cache-type", choices=KV_CACHE_TYPES, help="KV cache type (default f16)")
    @argument("--flash-attention", choices=FLASH_ATTENTION, help="flash attention (default auto)")
    @argument("--chat-template", metavar="T", help="a built-in template name (e.g. gemma) or a Jinja string")
    @argument("--cpu-extra-buffers", choices=CPU_EXTRA_BUFFERS,
              help="AMX/repack weight buffers (default auto: probed once per CPU and build)")
    @argument("--no-warmup", dest="warmup", action="store_false",
              help="skip the warm-up decode (the first request then pays the page-in in its prefill)")
    def _llm_load(self, args: Any) -> None:
        name = check_name(args.name, "%llm load")
        kwargs = {
            key: getattr(args, key)
            for key in ("context", "device", "kv_cache_type", "flash_attention", "chat_template", "cpu_extra_buffers")
            if getattr(args, key) is not None
        }
        previous = self.ns.get(name)
        if is_handle(previous):
            self.handles.close(previous)  # first, so two copies of the weights never coexist
        del previous
        with library_errors("%llm load"):
            handle = load(os.path.expanduser(args.path), warmup=args.warmup, **kwargs)
        try:
            self.handles.bind(name, handle)
        except BaseException:
            handle.close()
            raise
        print(f"{name} = {handle!r}  ({_load_phases(handle.load_summary())})")

    def _on_handle(self, sub: str, name: str | None, show: Callable[[Any], Any]) -> Any:
        """``show(handle)`` for ``name`` (the default handle, said so, when None); a library error
        becomes a one-line UsageError."""
        handle, shown = self._target(name, f"%llm {sub}")
        if name is None:
            print(f"%llm {sub} {shown}  (the default handle)")
        with library_errors(f"%llm {sub}"):
            return show(handle)

    def _derive(self, sub: str, src_name: str, name: str, method: str, *args: Any, **kwargs: Any) -> None:
        check_name(name, f"%llm {sub}")
        src = self._handle(src_name, f"%llm {sub}")
        with library_errors(f"%llm {sub}"):  # a session or batching lease rejects builders itself
            derived = getattr(src, method)(*args, **kwargs)
        try:
            self.handles.bind(name, derived)
        except BaseException:
            derived.close()
            raise
        print(f"{name} = {derived!r}")

    @subcommand(
        "optimize",
        usage="%llm optimize SRC --as NAME [--threads N] [--prefill-threads N] [--batch-tokens N] "
        "[--micro-batch-tokens N] [--prefix-cache-entries N] [--prefix-cache-tokens N] [--speculative-tokens N]",
        description="Derive a latency-profile lease (threads, batch sizes, prefix cache, prompt lookup) "
        "on the same weights.",
        python="NAME = SRC.with_optimizer(threads=N, prefill_threads=N, batch_tokens=N, micro_batch_tokens=N, "
        "prefix_cache_entries=N, prefix_cache_tokens=N, speculative_tokens=N)",
    )
    @_SOURCE
    @_NEW_HANDLE
    @arguments(lambda p: [p.add_argument(f"--{k.replace('_', '-')}", type=int_arg, metavar="N") for k in _OPTIMIZER])
    def _llm_optimize(self, args: Any) -> None:
        settings = {k: getattr(args, k) for k in _OPTIMIZER if getattr(args, k) is not None}
        self._derive("optimize", args.src, args.name, "with_optimizer", **settings)

    @subcommand(
        "batch",
        usage="%llm batch SRC --as NAME --max-sequences N [--prefix-cache-entries N] [--prefix-cache-tokens N]",
        description="Derive a continuous-batching (throughput) lease serving up to N sequences at once; "
        "with --prefix-cache-entries, evaluated prompt prefixes (a shared system prompt) are kept and copied "
        "into later requests instead of evaluated again.",
        python="NAME = SRC.with_batching(N, prefix_cache_entries=N, prefix_cache_tokens=N)",
    )
    @_SOURCE
    @_NEW_HANDLE
    @argument("--max-sequences", type=int_arg, metavar="N", required=True)
    @argument("--prefix-cache-entries", type=int_arg, metavar="N")
    @argument("--prefix-cache-tokens", type=int_arg, metavar="N")
    def _llm_batch(self, args: Any) -> None:
        settings = {k: getattr(args, k) for k in ("prefix_cache_entries", "prefix_cache_tokens")
                    if getattr(args, k) is not None}
        self._derive("batch", args.src, args.name, "with_batching", args.max_sequences, **settings)

    @subcommand(
        "adapter",
        usage="%llm adapter SRC MANIFEST --as NAME",
        description="Derive a lease with the LoRA adapter described by MANIFEST.",
        python="NAME = SRC.with_adapter(MANIFEST)",
    )
    @_SOURCE
    @argument("manifest", metavar="MANIFEST", help="the adapter manifest file")
    @_NEW_HANDLE
    def _llm_adapter(self, args: Any) -> None:
        self._derive("adapter", args.src, args.name, "with_adapter", os.path.expanduser(args.manifest))

    _llm_pool = _derives(
        "pool", "with_context_pool", "max_idle",
        description="Derive a lease that keeps up to N (0..4) idle contexts between requests.",
    )

    @subcommand(
        "list",
        usage="%llm list",
        description="A DataFrame of the live handles: name, kind, architecture, profile, device, context, "
        "fingerprint, state.",
        python="from aner_nb.magics import handle_table; handle_table(globals())",
    )
    def _llm_list(self, args: Any) -> Any:
        return self.handles.table()

    @subcommand(
        "use",
        usage="%llm use [NAME | --none]",
        description="Make NAME the default handle: %%generate, %%chat and %llm info / kv / bench without a NAME use "
        "it, and say so in their output. Without NAME, show the default.",
        python="%config LLMMagics.default_handle = 'NAME'   # in Python, call the handle itself: NAME.generate(...)",
    )
    @argument("target", metavar="NAME", nargs="?")
    @argument("--none", dest="clear", action="store_true", help="forget the default handle")
    def _llm_use(self, args: Any) -> None:
        if args.clear and args.target is not None:
            raise UsageError("%llm use: give NAME or --none, not both")
        if args.target is not None:
            self._handle(args.target, "%llm use")
            self.default_handle = args.target
        elif args.clear:
            self.default_handle = ""
        if self.default_handle:
            print(f"default handle: {self.default_handle}")
            return
        latest = self.handles.latest() if self.default_to_latest else None
        print(f"no default handle; the latest handle answers: {latest}" if latest else
              "no default handle: name one in each cell, or %llm use NAME")

    @subcommand(
        "info",
        usage="%llm info [NAME]",
        description="Metadata, load summary, memory summary and KV estimate of one handle, as a DataFrame.",
        python="from aner_nb.magics import handle_info; handle_info(NAME)  "
        "# NAME.memory_summary(), NAME.load_summary()",
    )
    @_TARGET
    def _llm_info(self, args: Any) -> Any:
        return self._on_handle("info", args.target, lambda h: handle_info(h, model=self.handles.parent_of(h)))

    @subcommand(
        "kv",
        usage="%llm kv [NAME] [--context N] [--kv-cache-type T] [--slots N]",
        description="KV-cache bytes for N resident contexts of this model (every KV type unless --kv-cache-type).",
        python="from aner_nb.magics import kv_table; kv_table(NAME, context=N, kv_cache_type=T, slots=S)  "
        "# llm.kv_estimate(context, layers, kv_heads, head_dim_k, head_dim_v, T) * S",
    )
    @_TARGET
    @argument("--context", type=int_arg, metavar="N", help="context tokens (default: the handle's)")
    @argument("--kv-cache-type", choices=KV_CACHE_TYPES, help="one KV type (default: all of them)")
    @argument("--slots", type=int_arg, metavar="N", default=1,
              help="resident contexts of this size: active requests + idle pool + sessions (default 1)")
    def _llm_kv(self, args: Any) -> Any:
        return self._on_handle(
            "kv", args.target, lambda h: kv_table(h, context=args.context, kv_cache_type=args.kv_cache_type,
                                                  slots=args.slots)
        )

    @subcommand(
        "close",
        usage="%llm close NAME [NAME ...] | --all",
        description="Close handles (and the %%chat sessions opened on them); weights are freed when no lease "
        "uses them.",
        python="NAME.close()",
    )
    @argument("targets", metavar="NAME", nargs="*")
    @argument("--all", action="store_true", help="close every handle the extension tracks")
    def _llm_close(self, args: Any) -> None:
        if args.all == bool(args.targets):
            raise UsageError("%llm close: name the handles to close, or give --all (not both)")
        if args.all:
            print(f"closed {self.handles.close_all()} handle(s)")
            return
        targets = [self._handle(name, "%llm close") for name in args.targets]  # a typo closes nothing
        for handle in targets:
            self.handles.close(handle)
        print(f"closed {', '.join(args.targets)}")

    @subcommand(
        "serve",
        usage="%llm serve NAME [--port P]",
        description="Serve a handle over HTTP on 127.0.0.1 (POST /chat, POST /v1/chat/completions, GET /v1/models, "
        "/health, /metrics) from a background thread; the handle stays alive until %llm stop.",
        python="server = api.app(title).llm(path='/chat', model=NAME).bind(port=P).start()   # from aner_nb import api",
    )
    @argument("target", metavar="NAME")
    @argument("--port", type=int_arg, metavar="P", default=11435, help="port on 127.0.0.1 (default 11435; 0: any free)")
    def _llm_serve(self, args: Any) -> Any:
        handle = self._handle(args.target, "%llm serve")
        if handle.kind == "session":
            raise UsageError(f"%llm serve: {args.target!r} is a chat session; serve the lease it was opened on")
        running = self.handles.servers().get(args.target)
        if running is not None:
            raise UsageError(f"%llm serve: {args.target} is already served at {running.url}; %llm stop {args.target} first")
        from .. import api

        with library_errors("%llm serve"):
            server = api.app(f"aner_nb {args.target}").llm(path="/chat", model=handle).bind(port=args.port).start()
        self.handles.add_server(args.target, handle, server)
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
        served = list(self.handles.servers())
        if args.target is not None and args.target not in served:
            listed = f"; served: {', '.join(served)}" if served else "; nothing is served"
            raise UsageError(f"%llm stop: {args.target!r} is not served{listed}")
        stopped = self.handles.stop_servers(args.target)
        print(f"stopped serving {', '.join(stopped)}" if stopped else "no server was running")

    @subcommand(
        "bench",
        usage="%llm bench [A] B [--prompt TEXT ...] [--max-tokens N] [--rounds N] [--warmup N] [--as VAR]",
        description="Paired benchmark of two handles: the same prompts on both, ABBA order, warm-up rounds dropped, "
        "a progress bar over the requests. Shows medians with min/max and the ratio to A (first_token_ms, "
        "decode_tokens_per_s, total_ms) and, per prompt, whether B's output is identical to A's; the BenchResult "
        "goes to VAR and _. With one name, A is the default handle.",
        python="from aner_nb import bench; from aner_nb.magics import bench_table, bench_outputs; "
        "VAR = bench.run_sides([bench.lease_side('A', A), bench.lease_side('B', B)], "
        "[bench.Case('p1', TEXT, max_tokens=N)], rounds=N, warmup=N, baseline='A', manifest_=bench.manifest(B), "
        "progress=None); "
        "bench_table(VAR); bench_outputs(VAR)",
    )
    @argument("a", metavar="A", help="the baseline handle (a lease)")
    @argument("b", metavar="B", nargs="?", help="the handle compared with A (a lease)")
    @argument("--prompt", dest="prompts", action="append", metavar="TEXT",
              help="a prompt (repeatable; {var} is replaced by the variable's value; "
              "default: one short built-in prompt)")
    @argument("--max-tokens", type=int_arg, metavar="N", default=64, help="tokens per request (default 64)")
    @argument("--rounds", type=int_arg, metavar="N", default=3, help="measured rounds (default 3)")
    @argument("--warmup", type=int_arg, metavar="N", default=1, help="warm-up rounds, dropped (default 1)")
    @argument("--as", dest="var", metavar="VAR", help="also store the BenchResult in this variable")
    def _llm_bench(self, args: Any) -> None:
        prog = "%llm bench"
        if args.b is None:  # one name: it is B, compared with the default handle
            args.a, args.b = self._default_name(prog, "B"), args.a
            print(f"{prog} {args.a} {args.b}  ({args.a} is the default handle)")
        if args.a == args.b:
            raise UsageError(f"{prog}: A and B are both {args.a!r}; name two different handles")
        for flag, value, least in (("--rounds", args.rounds, 1), ("--warmup", args.warmup, 0),
                                   ("--max-tokens", args.max_tokens, 1)):
            if value < least:
                raise UsageError(f"{prog}: {flag} must be >= {least}, got {value}")
        if args.var is not None:
            check_name(args.var, prog, "--as")
        prompts = args.prompts if args.prompts else [BENCH_PROMPT]  # {var} was expanded by IPython already
        if any(not p.strip() for p in prompts):
            raise UsageError(f"{prog}: --prompt must not be empty")
        leases = []
        for name in (args.a, args.b):
            handle = self._handle(name, prog)
            if handle.kind == "session":
                raise UsageError(f"{prog}: {name!r} is a {handle_kind(handle)}; bench compares leases")
            if handle.closed:
                raise UsageError(f"{prog}: {name!r} is closed")
            leases.append(handle)
        from .. import bench

        cases = [bench.Case(f"p{i}", text, max_tokens=args.max_tokens) for i, text in enumerate(prompts, 1)]
        sides = [bench.lease_side(args.a, leases[0]), bench.lease_side(args.b, leases[1])]
        # llama.cpp decodes one-token steps on n_threads and every batch on n_threads_batch: a
        # comparison is fair only at equal counts, so both are printed and a difference is named.
        threads = {name: bench.lease_settings(lease) for name, lease in zip((args.a, args.b), leases)}
        counts = {name: (t.get("n_threads"), t.get("n_threads_batch")) for name, t in threads.items()}
        print("threads (decode/batch): " + ", ".join(f"{n} {d}/{b}" for n, (d, b) in counts.items()))
        if len(set(counts.values())) > 1:
            print(f"{prog}: the two leases run with different threads; the ratios compare thread counts too "
                  "(derive both with with_optimizer(threads=T, prefill_threads=T))")
        with library_errors(prog):
            result = bench.run_sides(sides, cases, rounds=args.rounds, warmup=args.warmup, baseline=args.a,
                                     manifest_=bench.manifest(leases[1], baseline_settings=threads[args.a]),
                                     progress=None)
        del leases, sides
        from IPython.display import display

        display(bench_table(result))
        display(bench_outputs(result))
        if args.var is not None:
            self.ns[args.var] = result
        try:
            self.shell.displayhook.update_user_ns(result)  # _ like a displayed result
        except Exception:
            self.ns["_"] = result

    @subcommand(
        "help",
        usage="%llm help [SUBCOMMAND]",
        description="Show this overview, or one subcommand's options.",
        python="help(aner_nb.llm)",
    )
    @argument("topic", metavar="SUBCOMMAND", nargs="?")
    def _llm_help(self, args: Any) -> None:
        topic = args.topic
        if topic is None:
            print(OVERVIEW)
        elif topic in COMMANDS:
            print(COMMANDS[topic].format_help())
        elif topic.lstrip("%") in CELL_GRAMMARS:
            print(CELL_GRAMMARS[topic.lstrip("%")].format_help())
        else:
            topics = ", ".join([*COMMANDS, *CELL_GRAMMARS])
            raise UsageError(f"%llm help: unknown topic {topic!r}; use one of: {topics}")

    # -- %%generate / %%chat --------------------------------------------------------
    @cell_magic
    @cell_grammar(
        "generate",
        usage="%%generate NAME [--raw] [--max-tokens N] [--temperature T] [--seed S] [--stop STR] [--top-k K] "
        "[--top-p P] [--min-p P] [--repeat-penalty X] [--json-schema VAR|JSON] [--grammar VAR] ... [--as VAR] "
        "[--format F] [--stream | --no-stream | --quiet]",
        description="The cell body is the prompt: {var} is replaced by the variable's value (unknown names stay as "
        "written, {{var}} is a literal {var}), {In[n]} / {Out[n]} by cell n's input / output, {Err} by the last "
        "exception with its traceback. NAME may be left out: the default handle answers (%llm use). The answer "
        "streams into one display, as Markdown unless --format says otherwise, that ends with the timings panel "
        "and names the handle; the Response goes to VAR and to _. Ctrl-C cancels and keeps the partial Response; "
        "in a notebook the cell then fails with KeyboardInterrupt so queued cells stop (%config "
        "LLMMagics.on_interrupt). The handle stays usable.",
        python="s = NAME.stream(prompt, raw=False, max_tokens=N, temperature=T, seed=S, stop=[STR], top_k=K, ...); "
        "for piece in s: print(piece, end=''); VAR = s.response   # or VAR = NAME.generate(prompt, ...)",
    )
    @_TARGET
    @argument("--raw", action="store_true",
              help="continue the cell text as written, without the chat template (base models)")
    @arguments(request_options)
    def generate(self, line: str, cell: str) -> None:
        try:
            args = self.generate.grammar.parse_line(line)
        except HelpShown:
            return None
        handle, args.target = self._target(args.target, "%%generate")
        if handle.kind == "session":
            raise UsageError(f"%%generate: {args.target!r} is a chat session; use %%chat LEASE --session {args.target}")
        if args.var is not None:
            check_name(args.var, "%%generate", "--as")
        prompt = self._prompt(cell, "%%generate")
        self._answer("%%generate", lambda **kw: handle.stream(prompt, raw=args.raw, **kw), args, args.target)

    @cell_magic
    @cell_grammar(
        "chat",
        usage="%%chat NAME [--session VAR] [--system TEXT] [--new] [--max-tokens N] [--temperature T] [--seed S] "
        "[--stop STR] [--as VAR] [--format F] [--stream | --no-stream | --quiet]",
        description="Send the cell body as the next user turn of a persistent session (default VAR: NAME_chat), "
        "which keeps its history in its own context across cells. --new starts over. NAME may be left out: the "
        "default handle answers; the body is filled in and the answer shown as in %%generate.",
        python="VAR = NAME.session(system=TEXT); r = VAR.send(body, max_tokens=N)   # or VAR.stream(body, ...)",
    )
    @_TARGET
    @argument("--session", metavar="VAR", help="variable holding the session (default NAME_chat)")
    @argument("--system", metavar="TEXT", help="system prompt of a new session")
    @argument("--new", action="store_true", help="close the existing session and start a new one")
    @arguments(request_options)
    def chat(self, line: str, cell: str) -> None:
        try:
            args = self.chat.grammar.parse_line(line)
        except HelpShown:
            return None
        target, args.target = self._target(args.target, "%%chat")
        if args.var is not None:
            check_name(args.var, "%%chat", "--as")
        prompt = self._prompt(cell, "%%chat")
        if target.kind == "session":  # %%chat SESSION: talk to that session directly
            session = target
        else:
            session = self._session(target, args)
        self._answer("%%chat", lambda **kw: session.stream(prompt, **kw), args, args.target)

    def _session(self, lease: Any, args: Any) -> Any:
        """The session ``--session VAR`` (default NAME_chat) on ``lease``: reused, or opened now."""
        var = check_name(args.session or f"{args.target}_chat", "%%chat", "--session")
        session = self.ns.get(var)
        if session is not None and not (is_handle(session) and session.kind == "session"):
            raise UsageError(f"%%chat: {var!r} is a {type(session).__name__}, not a chat session; choose another --session")
        parent = self.handles.parent_of(session) if session is not None else None
        reuse = session is not None and not session.closed and not args.new and parent in (None, lease)
        if reuse and args.system is not None:
            first = session.messages[0] if session.messages else {}
            if first.get("role") != "system" or first.get("content") != args.system:
                raise UsageError(f"%%chat: session {var!r} has another system prompt; add --new to start over")
        if reuse:
            return session
        if session is not None and not session.closed:
            session.close()
        if not lease.supports("session"):
            raise UsageError(f"%%chat: {args.target!r} ({handle_kind(lease)}) has no chat sessions; use %%generate")
        with library_errors("%%chat"):
            session = lease.session(system=args.system)
        self.handles.bind(var, session, parent=lease)
        return session

    def _prompt(self, cell: str, prog: str) -> str:
        try:
            prompt = interpolate(cell.rstrip().lstrip("\r\n"), self.ns, error=last_error)
        except PromptError as exc:
            raise UsageError(f"{prog}: {one_line(exc)}") from None
        if not prompt.strip():
            raise UsageError(f"{prog}: the cell body is the prompt, and it is empty")
        return prompt

    def _terminal(self) -> bool:
        module = sys.modules.get("IPython.terminal.interactiveshell")
        return module is not None and isinstance(self.shell, module.TerminalInteractiveShell)

    def _answer(self, prog: str, start: Callable[..., Any], args: Any, source: str) -> None:
        """Stream one request from ``source`` into its view; the Response goes to --as VAR and _.

        Ctrl-C cancels the request; its partial Response is shown and stored like a finished one,
        then (``on_interrupt == "raise"``) KeyboardInterrupt is raised again so queued cells stop.
        """
        options = request_kwargs(args, self.ns, prog, self.max_tokens)
        with library_errors(prog):
            stream = start(**options)
        view = make_view(args.display or self.display, interval=self.stream_interval, terminal=self._terminal(),
                         format=args.format or self.format, source=source)
        response, cancelled = stream_into(view, stream)
        del stream
        if response is not None:
            if args.var is not None:
                self.ns[args.var] = response
            try:
                self.shell.displayhook.update_user_ns(response)  # _ (and _N, Out[N]) like a displayed result
            except Exception:
                self.ns["_"] = response
        if cancelled and self.on_interrupt == "raise":
            kept = "; the partial Response is in _" + (f" and {args.var}" if args.var else "") if response else ""
            raise KeyboardInterrupt(f"{prog} cancelled{kept}")


# The grammars declared on LLMMagics' methods, in definition order, with their handlers.
_DECLARED = [(grammar, func) for func in vars(LLMMagics).values() if (grammar := grammar_of(func)) is not None]
_HANDLERS = {grammar.name: func for grammar, func in _DECLARED if grammar.prog.startswith("%llm ")}
COMMANDS: dict[str, Grammar] = {g.name: g for g, _ in _DECLARED if g.prog.startswith("%llm ")}
CELL_GRAMMARS: dict[str, Grammar] = {g.name: g for g, _ in _DECLARED if g.prog.startswith("%%")}
SUBCOMMANDS = tuple(COMMANDS)  # in the order %llm help lists them
OVERVIEW = overview([*COMMANDS.values(), *CELL_GRAMMARS.values()])  # %llm help, and %llm?
LLMMagics.llm.__doc__ = OVERVIEW

class Extension:
    """Everything ``%load_ext aner_nb`` adds to one shell, and its symmetric removal."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.handles = HandleRegistry(lambda: shell.user_ns, shell)
        self.magics = LLMMagics(shell, self.handles)
        self.matcher = completion_matcher(self.handles.names, COMMANDS, CELL_GRAMMARS)

    def load(self) -> None:
        self.shell.register_magics(self.magics)
        self.shell.events.register("post_run_cell", self.post_run_cell)
        completer = getattr(self.shell, "Completer", None)
        if self.matcher is not None and completer is not None:
            completer.custom_matchers.append(self.matcher)
        atexit.register(self.at_exit)
        self.handles.sync()  # adopt handles that already exist

    def post_run_cell(self, result: Any = None) -> None:
        self.handles.after_cell(result, release_failed=self.magics.release_failed_cells)

    def at_exit(self) -> None:
        """Kernel exit: close every tracked handle before the interpreter tears modules down."""
        try:
            self.handles.close_all()
        except Exception:  # pragma: no cover - never fail interpreter shutdown
            pass

    def unload(self) -> int:
        """Remove every hook, magic, matcher and configurable we added; close tracked handles."""
        shell = self.shell
        try:
            shell.events.unregister("post_run_cell", self.post_run_cell)
        except ValueError:
            pass
        manager = shell.magics_manager
        for kind, table in self.magics.magics.items():
            for name, func in table.items():
                if manager.magics[kind].get(name) == func:
                    del manager.magics[kind][name]
        for key in [k for k, v in manager.registry.items() if v is self.magics]:
            del manager.registry[key]
        while self.magics in shell.configurables:
            shell.configurables.remove(self.magics)
        completer = getattr(shell, "Completer", None)
        if completer is not None and self.matcher in completer.custom_matchers:
            completer.custom_matchers.remove(self.matcher)
        atexit.unregister(self.at_exit)
        return self.handles.close_all()


def _load_phases(summary: Any) -> str:
    """The load line's timings: the total, then each phase (the first hash pass ran alongside the load)."""

    def sec(ns: int) -> str:
        return f"{ns / 1e9:.2f} s"

    warm = f"warm-up {sec(summary.warmup_duration)}" if summary.warmup_duration >= 0 else "warm-up skipped"
    return (f"loaded and SHA-256 verified in {sec(summary.total_duration)}: hash {sec(summary.hash_duration)} "
            f"alongside load {sec(summary.load_duration)}, verify {sec(summary.verify_duration)}, {warm}")
