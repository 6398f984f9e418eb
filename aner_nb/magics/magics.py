"""``LLMMagics``: the ``%llm`` line magic and the ``%%generate`` / ``%%chat`` cell magics, assembled.

Thin on purpose: parse the arguments, call the library (or the pure
functions of ``tables``), show the result (``display``). The handlers live
by topic, as IPython's own ``IPython/core/magics/`` does: ``loading`` (load,
the builders, list, use, close), ``generation`` (``%%generate``, ``%%chat``,
``%llm chat``), ``serving`` (serve, stop) and ``inspection`` (models, info,
kv, bench), mixins of ``base.MagicsBase``. ``LLMMagics`` combines them with
IPython's ``Magics``, holds the one set of ``%config LLMMagics.*`` traits,
and lists the ``%llm`` subcommands in its own body: that order is the order
``%llm help`` shows them. As with IPython's ``magic_arguments``, each
subcommand's grammar sits on its handler (``@subcommand(...)`` and its
``@argument`` options). Handle lifetime is the registry's job
(``handles``), HTTP servers are kept by ``servers``, cell prompts are
filled in by ``prompt``, tab completion reads the grammars
(``completion``); ``Extension`` wires everything into one shell and takes
it out again symmetrically.

A cell or ``%llm info`` / ``kv`` / ``bench`` / ``chat`` without a NAME asks
the default handle (``LLMMagics.default_handle``, set by ``%llm use``; with
``default_to_latest``, else the most recently loaded or derived one) and
says which handle that was. Ctrl-C in a request cell cancels it and keeps
the partial Response; ``on_interrupt`` decides whether the cell then fails
with KeyboardInterrupt (so a notebook's queued cells stop) or ends normally.
"""

from __future__ import annotations

import atexit
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from traitlets import Bool, Enum, Float, Int, Unicode

from ..llm.options import REGISTRY
from ..widgets.answer import FORMATS
from .base import library_errors
from .completion import completion_matcher
from .display import TIMINGS
from .generation import GenerationMagics
from .handles import HandleRegistry
from .inspection import BENCH_PROMPT, InspectionMagics
from .loading import LoadingMagics
from .naming import NameClaims
from .parser import Grammar, HelpShown, argument, grammar_of, overview, parse_llm, subcommand
from .prompt import ErrorLog
from .servers import ServerRegistry
from .serving import ServingMagics

__all__ = ["LLMMagics", "Extension", "library_errors", "SUBCOMMANDS", "COMMANDS", "CELL_GRAMMARS", "BENCH_PROMPT"]

# The request flags' declaration (aner_nb.llm.options): --max-tokens' configured default keeps its bounds.
_MAX_TOKENS = REGISTRY["max_tokens"]


@magics_class
class LLMMagics(LoadingMagics, GenerationMagics, ServingMagics, InspectionMagics, Magics):
    """Run local GGUF models from notebook cells; see ``%llm help``."""

    stream_interval = Float(
        0.1, min=0.0, help="Seconds between in-place updates of a streamed answer (0: update on every piece)."
    ).tag(config=True)
    max_tokens = Int(_MAX_TOKENS.default, min=int(_MAX_TOKENS.low), max=int(_MAX_TOKENS.high),
                     help="Default --max-tokens of %%generate, %%chat and %llm chat.").tag(config=True)
    display = Enum(
        ("stream", "final", "none"), default_value="stream",
        help="Default display of %%generate and %%chat: stream (answer streams in, then timings), "
        "final (answer and timings at the end), none (show nothing; the Response goes to _).",
    ).tag(config=True)
    timings = Enum(
        TIMINGS, default_value="full",
        help="What follows an answer of %%generate and %%chat: full (the timings panel), compact (one line: "
        "first token ms, tok/s, tokens, cached input tokens) or off (nothing).",
    ).tag(config=True)
    release_failed_cells = Bool(
        True, help="Close handles that only a failed cell's traceback still references (sys.last_traceback).",
    ).tag(config=True)
    format = Enum(
        FORMATS, default_value="markdown",
        help="Default --format of %%generate and %%chat: markdown (rendered as it streams), text, code or json.",
    ).tag(config=True)
    default_handle = Unicode(
        "", help="The handle that %%generate, %%chat and %llm info / kv / bench / chat use when no NAME is given "
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

    def __init__(self, shell: Any, handles: HandleRegistry, servers: ServerRegistry | None = None,
                 errors: ErrorLog | None = None) -> None:
        super().__init__(shell=shell)  # also appends self to shell.configurables (for %config)
        self.handles = handles
        self.servers = servers if servers is not None else ServerRegistry()
        self.errors = errors if errors is not None else ErrorLog()
        self.claims = NameClaims()

    # -- %llm -----------------------------------------------------------------------
    @line_magic
    def llm(self, line: str = "") -> Any:
        try:
            sub, args = parse_llm(line, COMMANDS)
        except HelpShown:
            return None
        return _HANDLERS[sub](self, args)

    # The subcommands, in the order %llm help lists them (each declared in its topic module).
    _llm_models = InspectionMagics._llm_models
    _llm_load = LoadingMagics._llm_load
    _llm_optimize = LoadingMagics._llm_optimize
    _llm_batch = LoadingMagics._llm_batch
    _llm_adapter = LoadingMagics._llm_adapter
    _llm_pool = LoadingMagics._llm_pool
    _llm_list = LoadingMagics._llm_list
    _llm_use = LoadingMagics._llm_use
    _llm_chat = GenerationMagics._llm_chat
    _llm_save = GenerationMagics._llm_save
    _llm_info = InspectionMagics._llm_info
    _llm_kv = InspectionMagics._llm_kv
    _llm_embed = InspectionMagics._llm_embed
    _llm_close = LoadingMagics._llm_close
    _llm_serve = ServingMagics._llm_serve
    _llm_stop = ServingMagics._llm_stop
    _llm_bench = InspectionMagics._llm_bench

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

    # -- %%generate / %%chat: the cell magics (declared in generation) ------------------
    generate = cell_magic(GenerationMagics.generate)
    chat = cell_magic(GenerationMagics.chat)


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
        self.servers = ServerRegistry()
        self.handles.on_close(self.servers.release)  # a handle's server stops before it closes
        self.errors = ErrorLog()
        self.magics = LLMMagics(shell, self.handles, self.servers, self.errors)
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
        if result is not None:  # {Err[n]}: the cell's exception, kept as text
            error = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
            self.errors.record(getattr(result, "execution_count", None), error)
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
