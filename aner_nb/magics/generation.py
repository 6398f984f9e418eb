"""``%%generate``, ``%%chat`` and ``%llm chat``: asking a model from a cell.

The cell body is the prompt, filled in by :mod:`aner_nb.magics.prompt`
(``{var}``, ``{In[n]}``, ``{Out[n]}``, ``{Err}``, ``{Err[n]}``); the answer
streams into one display (:mod:`aner_nb.magics.display`) that ends as
``LLMMagics.timings`` says. ``%llm chat`` shows a chat box widget
(:func:`aner_nb.widgets.chat_box`) on a session of the lease.

These are plain methods here: ``LLMMagics`` registers ``generate`` and
``chat`` as its cell magics.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from IPython.core.error import UsageError

from ..llm.errors import StateMismatchError
from ..llm.output import OutputSplitter
from ..widgets.chat import ChatBox, chat_box
from .base import TARGET, MagicsBase, library_errors
from .cells import request_flags, request_options, request_settings, request_usage, stream_into
from .display import make_view
from .parser import HelpShown, argument, arguments, cell_grammar, check_name, one_line, subcommand
from .prompt import PromptError, interpolate, last_error
from .tables import handle_kind, is_handle

__all__ = ["GenerationMagics"]


class GenerationMagics(MagicsBase):
    """The request cells and the chat box; ``LLMMagics`` supplies the display traits."""

    max_tokens: int
    display: str
    format: str
    timings: str
    stream_interval: float
    on_interrupt: str

    @subcommand(
        "chat",
        usage=f"%llm chat [NAME] [--system TEXT] {request_usage()} [--as VAR]",
        description="Show a chat box on NAME: a transcript, an input, Send and Stop, answers streaming from a "
        "worker thread. It opens a session of its own (kept in its context across turns); the request flags "
        "apply to every turn. The box goes to VAR (default NAME_box); re-running the cell closes the old box, "
        "and %llm close NAME closes the box's session too. The saved notebook keeps the transcript.",
        python="from aner_nb import widgets; VAR = widgets.chat_box(NAME, system=TEXT, max_tokens=N).show()",
    )
    @TARGET
    @argument("--system", metavar="TEXT", help="system prompt of the box's session")
    @arguments(request_flags)
    @argument("--as", dest="var", metavar="VAR", help="variable for the box (default NAME_box)")
    def _llm_chat(self, args: Any) -> None:
        prog = "%llm chat"
        lease, args.target = self._target(args.target, prog)
        var = check_name(args.var or f"{args.target}_box", prog, "--as")
        old = self.ns.get(var)
        if old is not None and not isinstance(old, ChatBox):
            raise UsageError(f"{prog}: {var!r} is a {type(old).__name__}, not a chat box; choose another --as")
        if lease.kind == "session" and args.system is not None:
            raise UsageError(f"{prog}: {args.target!r} is a session with its own history; --system needs a lease")
        if lease.kind != "session" and not lease.supports("session"):
            raise UsageError(f"{prog}: {args.target!r} ({handle_kind(lease)}) has no chat sessions")
        with library_errors(prog):
            settings = request_settings(args, self.ns, prog, self.max_tokens)
            if old is not None:
                old.close()  # a re-run cell: the old box's session goes first
            box = chat_box(lease, system=args.system, settings=settings)
        if lease.kind != "session":
            self.handles.track(box.session, parent=lease)  # so %llm close NAME closes it
        self.ns[var] = box
        box.show()

    @subcommand(
        "save",
        usage="%llm save NAME PATH [--session VAR]",
        description="Save a %%chat conversation (its history and KV) to PATH, atomically: NAME is a session, or "
        "the lease whose session is in NAME_chat (or --session VAR). Resume it later, in a new kernel too, with "
        "%%chat NAME --resume PATH; the file only resumes on the same model, adapter, engine build and KV settings.",
        python="VAR.save(PATH)",
    )
    @argument("target", metavar="NAME", help="a chat session, or the lease whose %%chat session to save")
    @argument("path", metavar="PATH", help="the file to write")
    @argument("--session", metavar="VAR", help="variable holding the session (default NAME_chat)")
    def _llm_save(self, args: Any) -> None:
        prog = "%llm save"
        handle = self._handle(args.target, prog)
        if handle.kind == "session":
            if args.session is not None:
                raise UsageError(f"{prog}: {args.target!r} is a session itself; --session names a lease's session")
            session = handle
        else:
            var = check_name(args.session or f"{args.target}_chat", prog, "--session")
            session = self.ns.get(var)
            if not (is_handle(session) and session.kind == "session"):
                raise UsageError(f"{prog}: no chat session in {var!r}; start one with %%chat {args.target}")
        with library_errors(prog):
            path = session.save(args.path)
        turns = sum(1 for m in session.messages if m["role"] == "user")
        print(f"saved {turns} turn(s), {session.cached_tokens} tokens of KV, to {path}")

    # -- %%generate / %%chat (registered as cell magics by LLMMagics) -------------------
    @cell_grammar(
        "generate",
        usage=f"%%generate NAME [--raw] [--over DATA --into COLUMN] {request_usage()} [--as VAR] [--format F] "
        "[--stream | --no-stream | --quiet]",
        description="The cell body is the prompt: {var} is replaced by the variable's value (unknown names stay as "
        "written, {{var}} is a literal {var}), {In[n]} / {Out[n]} by cell n's input / output, {Err} by the last "
        "exception with its traceback, {Err[n]} by the one cell n raised. NAME may be left out: the default "
        "handle answers (%llm use). The answer streams into one display, as Markdown unless --format says "
        "otherwise, that ends with the timings panel (%config LLMMagics.timings) and names the handle; the "
        "Response goes to VAR and to _. Ctrl-C cancels and keeps the partial Response; in a notebook the cell "
        "then fails with KeyboardInterrupt so queued cells stop (%config LLMMagics.on_interrupt). The handle "
        "stays usable. With --over DATA (a DataFrame or Series variable) the cell is a row template instead: "
        "{column} is the row's value, every row is answered (NAME.map), the answers go into DATA's column "
        "--into (default answer) and the whole result frame (error column included) to VAR and _.",
        python="s = NAME.stream(prompt, raw=False, max_tokens=N, temperature=T, seed=S, stop=[STR], top_k=K, ...); "
        "for piece in s: print(piece, end=''); VAR = s.response   # or VAR = NAME.generate(prompt, ...)",
    )
    @TARGET
    @argument("--raw", action="store_true",
              help="continue the cell text as written, without the chat template (base models)")
    @argument("--over", metavar="DATA", help="a DataFrame or Series variable: answer the cell for every row")
    @argument("--into", metavar="COLUMN", help="with --over: the column of DATA that gets the answers (default answer)")
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
        if args.over is not None or args.into is not None:
            return self._over_rows(handle, cell, args)
        prompt = self._prompt(cell, "%%generate")
        self._answer("%%generate", lambda **kw: handle.stream(prompt, raw=args.raw, **kw), args, args.target)

    def _over_rows(self, handle: Any, cell: str, args: Any) -> None:
        """``--over DATA --into COLUMN``: the cell is ``map``'s row template; answers go into DATA[COLUMN]."""
        import pandas as pd

        prog = "%%generate"
        if args.over is None:
            raise UsageError(f"{prog}: --into needs --over DATA (the DataFrame whose rows are answered)")
        if args.raw:
            raise UsageError(f"{prog}: --over answers each row with the chat template; --raw cannot be combined")
        data = self.ns.get(check_name(args.over, prog, "--over"))
        if not isinstance(data, (pd.DataFrame, pd.Series)):
            what = "nothing" if data is None else f"a {type(data).__name__}"
            raise UsageError(f"{prog}: --over {args.over} is {what}; it must name a DataFrame or Series")
        if isinstance(data, pd.Series) and args.into is not None:
            raise UsageError(f"{prog}: --into writes a column of a DataFrame; --over {args.over} is a Series")
        template = cell.rstrip().lstrip("\r\n")
        with library_errors(prog):
            settings = request_settings(args, self.ns, prog, self.max_tokens)
            out = handle.map(data, template, settings=settings)
        if isinstance(data, pd.DataFrame):
            data[args.into or "answer"] = out["answer"]
        stats = out.attrs["aner_nb.map"]
        where = f" into {args.over}[{(args.into or 'answer')!r}]" if isinstance(data, pd.DataFrame) else ""
        print(f"{stats.rows} rows{where}: {stats.generated} generated, {stats.from_checkpoint} from the checkpoint, "
              f"{stats.failed} failed (see the error column)" + (", interrupted" if stats.interrupted else ""))
        self._result(out, args.var)

    @cell_grammar(
        "chat",
        usage=f"%%chat NAME [--session VAR] [--system TEXT] [--new | --resume PATH] {request_usage()} [--as VAR] "
        "[--format F] [--stream | --no-stream | --quiet]",
        description="Send the cell body as the next user turn of a persistent session (default VAR: NAME_chat), "
        "which keeps its history in its own context across cells. --new starts over; --resume PATH starts from a "
        "conversation saved with %llm save (a file of another model, adapter, build or KV setting is an error, "
        "never a silent fresh start). NAME may be left out: the "
        "default handle answers; the body is filled in and the answer shown as in %%generate.",
        python="VAR = NAME.session(system=TEXT); r = VAR.send(body, max_tokens=N)   # or VAR.stream(body, ...)",
    )
    @TARGET
    @argument("--session", metavar="VAR", help="variable holding the session (default NAME_chat)")
    @argument("--system", metavar="TEXT", help="system prompt of a new session")
    @argument("--new", action="store_true", help="close the existing session and start a new one")
    @argument("--resume", metavar="PATH", help="close the existing session and resume the one saved in PATH")
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
        if args.resume is not None and (args.new or args.system is not None):
            raise UsageError("%%chat: --resume PATH continues a saved conversation (its own system prompt); "
                             "it cannot be combined with --new or --system")
        if target.kind == "session":  # %%chat SESSION: talk to that session directly
            if args.resume is not None:
                raise UsageError(f"%%chat: {args.target!r} is a session; --resume opens one on a lease")
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
        resume = getattr(args, "resume", None)
        reuse = (session is not None and not session.closed and not args.new and resume is None
                 and parent in (None, lease))
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
        if resume is not None:
            with library_errors("%%chat"):
                try:
                    session = lease.session(resume=resume)
                except StateMismatchError as exc:  # the reason first: why this file does not fit this lease
                    raise UsageError(f"%%chat: cannot resume {resume}: {exc.reason}: {one_line(exc)}") from None
            self.handles.bind(var, session, parent=lease)
            return session
        with library_errors("%%chat"):
            session = lease.session(system=args.system)
        self.handles.bind(var, session, parent=lease)
        return session

    def _prompt(self, cell: str, prog: str) -> str:
        try:
            prompt = interpolate(cell.rstrip().lstrip("\r\n"), self.ns, error=last_error, errors=self.errors)
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
        with library_errors(prog):
            settings = request_settings(args, self.ns, prog, self.max_tokens)
            stream = start(settings=settings)
        view = make_view(args.display or self.display, interval=self.stream_interval, terminal=self._terminal(),
                         format=args.format or self.format, source=source, timings=self.timings)
        fmt = getattr(stream, "output_format", None)
        if hasattr(view, "splitter") and fmt is not None and fmt.markers is not None:
            view.splitter = OutputSplitter(fmt)  # the thinking streams collapsed above the answer
        response, cancelled = stream_into(view, stream)
        del stream
        if response is not None:
            self._result(response, args.var)  # _ (and _N, Out[N]) like a displayed result
        if cancelled and self.on_interrupt == "raise":
            kept = "; the partial Response is in _" + (f" and {args.var}" if args.var else "") if response else ""
            raise KeyboardInterrupt(f"{prog} cancelled{kept}")
