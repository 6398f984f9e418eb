"""``LLMMagics``: the ``%llm`` line magic and the ``%%generate`` / ``%%chat`` cell magics.

Thin on purpose: parse the arguments (``parser``), call the library (or the
pure functions of ``tables``), show the result (``display``). Handle lifetime
is the registry's job (``handles``); ``Extension`` wires everything into one
shell and takes it out again symmetrically.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from traitlets import Bool, Enum, Float, Int

from ..llm import LLMModel, Session, load
from ..llm.errors import EngineError, LLMError
from .display import make_view
from .handles import HandleRegistry
from .parser import (
    BENCH_PROMPT,
    NOT_YET,
    SUBCOMMANDS,
    HelpShown,
    cell_parser,
    check_name,
    interpolate,
    one_line,
    overview,
    parse_chat,
    parse_generate,
    parse_llm,
    subcommand_parser,
)
from .tables import bench_outputs, bench_table, handle_info, handle_kind, is_handle, kv_table

__all__ = ["LLMMagics", "Extension", "library_errors"]


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

    def __init__(self, shell: Any, handles: HandleRegistry) -> None:
        super().__init__(shell=shell)  # also appends self to shell.configurables (for %config)
        self.handles = handles

    # -- %llm -----------------------------------------------------------------------
    @line_magic
    def llm(self, line: str = "") -> Any:
        try:
            sub, args = parse_llm(line)
        except HelpShown:
            return None
        if sub in NOT_YET:
            raise UsageError(f"%llm {sub} is not available yet")
        return getattr(self, f"_llm_{sub}")(args)

    llm.__doc__ = overview()

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
        t0 = time.perf_counter()
        with library_errors("%llm load"):
            handle = load(os.path.expanduser(args.path), **kwargs)
        try:
            self.handles.bind(name, handle)
        except BaseException:
            handle.close()
            raise
        print(f"{name} = {handle!r}  (loaded and SHA-256 verified in {time.perf_counter() - t0:.2f} s)")

    def _derive(self, sub: str, src_name: str, name: str, method: str, *args: Any, **kwargs: Any) -> None:
        if getattr(LLMModel, method, None) is None:
            raise UsageError(f"%llm {sub} is not available in this version: LLMModel.{method}() has not landed yet")
        check_name(name, f"%llm {sub}")
        src = self._handle(src_name, f"%llm {sub}")
        builder = getattr(src, method, None)
        if builder is None:
            raise UsageError(f"%llm {sub}: {src_name!r} is a {handle_kind(src)}; {method}() derives from leases only")
        with library_errors(f"%llm {sub}"):
            derived = builder(*args, **kwargs)
        try:
            self.handles.bind(name, derived)
        except BaseException:
            derived.close()
            raise
        print(f"{name} = {derived!r}")

    def _llm_optimize(self, args: Any) -> None:
        keys = ("threads", "prefill_threads", "batch_tokens", "micro_batch_tokens",
                "prefix_cache_entries", "prefix_cache_tokens", "speculative_tokens")
        settings = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
        self._derive("optimize", args.src, args.name, "with_optimizer", **settings)

    def _llm_batch(self, args: Any) -> None:
        self._derive("batch", args.src, args.name, "with_batching", args.max_sequences)

    def _llm_adapter(self, args: Any) -> None:
        self._derive("adapter", args.src, args.name, "with_adapter", os.path.expanduser(args.manifest))

    def _llm_pool(self, args: Any) -> None:
        self._derive("pool", args.src, args.name, "with_context_pool", args.max_idle)

    def _llm_list(self, args: Any) -> Any:
        return self.handles.table()

    def _llm_info(self, args: Any) -> Any:
        handle = self._handle(args.target, "%llm info")
        with library_errors("%llm info"):
            return handle_info(handle, model=self.handles.parent_of(handle))

    def _llm_kv(self, args: Any) -> Any:
        handle = self._handle(args.target, "%llm kv")
        with library_errors("%llm kv"):
            return kv_table(handle, context=args.context, kv_cache_type=args.kv_cache_type, slots=args.slots)

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

    def _llm_serve(self, args: Any) -> Any:
        handle = self._handle(args.target, "%llm serve")
        if isinstance(handle, Session):
            raise UsageError(f"%llm serve: {args.target!r} is a chat session; serve the lease it was opened on")
        running = self.handles.servers().get(args.target)
        if running is not None:
            raise UsageError(f"%llm serve: {args.target} is already served at {running.url}; %llm stop {args.target} first")
        from .. import api

        with library_errors("%llm serve"):
            server = api.app(f"aner_nb {args.target}").llm(path="/chat", model=handle).bind(port=args.port).start()
        self.handles.add_server(args.target, handle, server)
        return server

    def _llm_stop(self, args: Any) -> None:
        served = list(self.handles.servers())
        if args.target is not None and args.target not in served:
            listed = f"; served: {', '.join(served)}" if served else "; nothing is served"
            raise UsageError(f"%llm stop: {args.target!r} is not served{listed}")
        stopped = self.handles.stop_servers(args.target)
        print(f"stopped serving {', '.join(stopped)}" if stopped else "no server was running")

    def _llm_help(self, args: Any) -> None:
        topic = args.topic
        if topic is None:
            print(overview())
        elif topic in SUBCOMMANDS:
            print(subcommand_parser(topic).format_help())
        elif topic.lstrip("%") in ("generate", "chat"):
            print(cell_parser(topic.lstrip("%")).format_help())
        else:
            raise UsageError(f"%llm help: unknown topic {topic!r}; use one of: {', '.join(SUBCOMMANDS)}, generate, chat")

    def _llm_bench(self, args: Any) -> None:
        prog = "%llm bench"
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
            if isinstance(handle, Session) or not callable(getattr(handle, "generate", None)):
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
                                     manifest_=bench.manifest(leases[1], baseline_settings=threads[args.a]))
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

    # -- %%generate / %%chat --------------------------------------------------------
    @cell_magic
    def generate(self, line: str, cell: str) -> None:
        try:
            args = parse_generate(line)
        except HelpShown:
            return None
        handle = self._handle(args.target, "%%generate")
        if isinstance(handle, Session):
            raise UsageError(f"%%generate: {args.target!r} is a chat session; use %%chat LEASE --session {args.target}")
        if args.var is not None:
            check_name(args.var, "%%generate", "--as")
        prompt = self._prompt(cell, "%%generate")
        self._answer("%%generate", lambda **kw: handle.stream(prompt, **kw), args)

    generate.__doc__ = cell_parser("generate").format_help()

    @cell_magic
    def chat(self, line: str, cell: str) -> None:
        try:
            args = parse_chat(line)
        except HelpShown:
            return None
        target = self._handle(args.target, "%%chat")
        if args.var is not None:
            check_name(args.var, "%%chat", "--as")
        prompt = self._prompt(cell, "%%chat")
        if isinstance(target, Session):  # %%chat SESSION: talk to that session directly
            session = target
        else:
            session = self._session(target, args)
        self._answer("%%chat", lambda **kw: session.stream(prompt, **kw), args)

    chat.__doc__ = cell_parser("chat").format_help()

    def _session(self, lease: Any, args: Any) -> Any:
        """The session ``--session VAR`` (default NAME_chat) on ``lease``: reused, or opened now."""
        var = check_name(args.session or f"{args.target}_chat", "%%chat", "--session")
        session = self.ns.get(var)
        if session is not None and not isinstance(session, Session):
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
        if not callable(getattr(lease, "session", None)) or not lease.supports("session"):
            raise UsageError(f"%%chat: {args.target!r} ({handle_kind(lease)}) has no chat sessions; use %%generate")
        with library_errors("%%chat"):
            session = lease.session(system=args.system)
        self.handles.bind(var, session, parent=lease)
        return session

    def _prompt(self, cell: str, prog: str) -> str:
        prompt = interpolate(cell.rstrip().lstrip("\r\n"), self.ns)
        if not prompt.strip():
            raise UsageError(f"{prog}: the cell body is the prompt, and it is empty")
        return prompt

    def _terminal(self) -> bool:
        module = sys.modules.get("IPython.terminal.interactiveshell")
        return module is not None and isinstance(self.shell, module.TerminalInteractiveShell)

    def _answer(self, prog: str, start: Callable[..., Any], args: Any) -> None:
        """Stream one request into its view; Ctrl-C cancels it; the Response goes to --as VAR and _."""
        max_tokens = self.max_tokens if args.max_tokens is None else args.max_tokens
        with library_errors(prog):
            stream = start(max_tokens=max_tokens, temperature=args.temperature, seed=args.seed, stop=args.stop)
        view = make_view(args.display or self.display, interval=self.stream_interval, terminal=self._terminal())
        cancelled = False
        try:
            view.start()
            for piece in stream:
                view.add(piece)
        except KeyboardInterrupt:
            stream.cancel()  # a no-op when the interrupt already ended the stream inside its step
            cancelled = True
        except BaseException as exc:
            stream.cancel()
            view.fail(exc)
            raise
        response = stream.response
        del stream
        view.finish(response, cancelled=cancelled)
        if response is None:
            return
        if args.var is not None:
            self.ns[args.var] = response
        try:
            self.shell.displayhook.update_user_ns(response)  # _ (and _N, Out[N]) like a displayed result
        except Exception:
            self.ns["_"] = response


_matcher_pattern = re.compile(r"(?:^|[\s=(])%llm\s+(.*)$")
_HANDLE_SUBS = {"optimize", "batch", "adapter", "pool", "info", "kv", "close", "serve", "stop", "bench"}


def _completion_matcher(names: Callable[[], list[str]]) -> Any:
    """A Matcher-API-v2 completer: subcommands after ``%llm``, handle names where a handle goes."""
    try:
        from IPython.core.completer import SimpleCompletion, completion_matcher
    except ImportError:  # pragma: no cover - IPython < 8.6 has no v2 matchers
        return None

    def candidates(text: str, first_line: str, cursor_line: int) -> tuple[list[str], str]:
        match = _matcher_pattern.search(text)
        if match:
            tokens = match.group(1).split(" ")
            current = tokens[-1]
            if len(tokens) == 1:
                return [s for s in SUBCOMMANDS if s.startswith(current)], current
            sub, previous = tokens[0], tokens[-2]
            positional = not current.startswith("-") and not (previous.startswith("--") and previous != "--all")
            if sub in _HANDLE_SUBS and positional and (
                len(tokens) == 2 or sub == "close" or (sub == "bench" and len(tokens) == 3)
            ):
                return [n for n in names() if n.startswith(current)], current
            return [], current
        if cursor_line == 0 and re.match(r"^%%(generate|chat)\s", first_line):
            args = text.split(" ")[1:]
            if len(args) == 1 or (len(args) >= 2 and args[-2] == "--session"):
                return [n for n in names() if n.startswith(args[-1])], args[-1]
        return [], ""

    @completion_matcher(identifier="aner_nb.handles", priority=1, api_version=2)
    def matcher(context: Any) -> Any:
        found, fragment = candidates(context.text_until_cursor, context.full_text.split("\n")[0], context.cursor_line)
        completions = [SimpleCompletion(n, type="llm handle") for n in found]
        result: dict[str, Any] = {"completions": completions, "matched_fragment": fragment}
        if completions:
            result["suppress"] = True
        return result

    return matcher


class Extension:
    """Everything ``%load_ext aner_nb`` adds to one shell, and its symmetric removal."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.handles = HandleRegistry(lambda: shell.user_ns, shell)
        self.magics = LLMMagics(shell, self.handles)
        self.matcher = _completion_matcher(self.handles.names)

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
        if dict.get(manager.registry, type(self.magics).__name__) is self.magics:
            del manager.registry[type(self.magics).__name__]
        while self.magics in shell.configurables:
            shell.configurables.remove(self.magics)
        completer = getattr(shell, "Completer", None)
        if completer is not None and self.matcher in completer.custom_matchers:
            completer.custom_matchers.remove(self.matcher)
        atexit.unregister(self.at_exit)
        return self.handles.close_all()
