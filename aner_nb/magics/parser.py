"""How the magics declare and parse their arguments, in the style of IPython's ``magic_arguments``.

Each ``%llm`` subcommand and each cell magic keeps its grammar next to its
handler (in the topic modules that :mod:`aner_nb.magics.magics` assembles): ``@subcommand`` / ``@cell_grammar``
with the usage line, a one-line description and the Python equivalent, and
one ``@argument`` per option, top to bottom in the order ``-h`` lists them.
This module turns those declarations into argparse parsers that never print
usage or exit the kernel: every error becomes an IPython ``UsageError`` with a
one-line message (shown without a traceback), and ``-h`` prints the help and
stops. Each parser's epilog is the Python-API equivalent, so ``%llm help SUB``
and ``%llm SUB -h`` always show how to do the same thing without the magic.
"""

from __future__ import annotations

import argparse
import difflib
import keyword
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from IPython.core.error import UsageError
from IPython.utils.process import arg_split

__all__ = [
    "HelpShown",
    "Grammar",
    "subcommand",
    "cell_grammar",
    "argument",
    "arguments",
    "grammar_of",
    "int_arg",
    "split_line",
    "parse_llm",
    "overview",
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


def int_arg(text: str) -> int:
    """An argparse ``type`` for integers whose error names the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    return value


Adder = Callable[[argparse.ArgumentParser], Any]


@dataclass
class Grammar:
    """One magic's grammar: ``prog`` (``%llm kv``, ``%%generate``), its usage line, what it does,
    its Python equivalent, and the functions that add its arguments to a parser."""

    name: str
    prog: str
    usage: str
    description: str
    python: str
    adders: tuple[Adder, ...] = ()
    _parser: argparse.ArgumentParser | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def parser(self) -> argparse.ArgumentParser:
        if self._parser is None:
            p = _Parser(prog=self.prog, description=self.description, usage=self.usage.replace("%", "%%"),
                        epilog=f"Python equivalent:\n  {self.python}")  # argparse %-formats usage
            for add in self.adders:
                add(p)
            self._parser = p
        return self._parser

    def parse(self, argv: list[str]) -> argparse.Namespace:
        """The options of ``argv``; raises UsageError (a bad argument) or HelpShown (``-h``)."""
        return self.parser.parse_args(argv)

    def parse_line(self, line: str) -> argparse.Namespace:
        return self.parse(split_line(line, self.prog))

    def format_help(self) -> str:
        return self.parser.format_help()


_PENDING = "_aner_arguments"  # the adders of @argument decorators, until @subcommand / @cell_grammar


def arguments(add: Adder) -> Callable[[Any], Any]:
    """Declare arguments with a function that adds them to a parser (for shared option sets)."""

    def decorate(func: Any) -> Any:
        func.__dict__.setdefault(_PENDING, []).insert(0, add)  # decorators apply bottom-up
        return func

    return decorate


def argument(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:
    """Declare one argument, as ``ArgumentParser.add_argument(*args, **kwargs)``."""
    return arguments(lambda p: p.add_argument(*args, **kwargs))


def _grammar(name: str, prog: str, usage: str, description: str, python: str) -> Callable[[Any], Any]:
    def decorate(func: Any) -> Any:
        func.grammar = Grammar(name, prog, usage, description, python, tuple(func.__dict__.pop(_PENDING, ())))
        return func

    return decorate


def subcommand(name: str, *, usage: str, description: str, python: str) -> Callable[[Any], Any]:
    """Mark a handler as ``%llm NAME``; the ``@argument`` decorators below it are its options."""
    return _grammar(name, f"%llm {name}", usage, description, python)


def cell_grammar(name: str, *, usage: str, description: str, python: str) -> Callable[[Any], Any]:
    """The grammar of the cell magic ``%%NAME``; its help becomes the magic's docstring (``%%NAME?``)."""

    def decorate(func: Any) -> Any:
        _grammar(name, f"%%{name}", usage, description, python)(func)
        func.__doc__ = func.grammar.format_help()
        return func

    return decorate


def grammar_of(func: Any) -> Grammar | None:
    """The grammar a handler was declared with, or None."""
    return getattr(func, "grammar", None)


def split_line(line: str, prog: str) -> list[str]:
    """A magic's line split as a shell would (quotes group words)."""
    try:
        return arg_split(line, posix=not sys.platform.startswith("win"), strict=True)
    except ValueError as exc:
        raise UsageError(f"{prog}: {one_line(exc)} (check the quotes)") from None


def parse_llm(line: str, commands: Mapping[str, Grammar]) -> tuple[str, argparse.Namespace]:
    """Split ``%llm`` arguments into (subcommand, options); raises UsageError or HelpShown.

    A bare ``%llm`` or ``%llm -h`` is ``help``.
    """
    argv = split_line(line, "%llm")
    if not argv or argv[0] in ("-h", "--help"):
        return "help", argparse.Namespace(topic=None)
    sub, rest = argv[0], argv[1:]
    if sub not in commands:
        close = difflib.get_close_matches(sub, list(commands), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(f"%llm: unknown subcommand {sub!r}; {hint}use one of: {', '.join(commands)}")
    return sub, commands[sub].parse(rest)


def check_name(name: str, prog: str, what: str = "--as") -> str:
    """A variable name a handle or result can be stored under."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UsageError(f"{prog}: {what} {name!r} is not a valid Python variable name")
    return name


def overview(grammars: Iterable[Grammar]) -> str:
    """The ``%llm help`` text: every magic, what it does, and its Python equivalent."""
    lines = [
        "aner_nb notebook magics (load with %load_ext aner_nb). `from aner_nb import llm` is the library under them.",
        "",
    ]
    for g in grammars:
        lines += [g.usage, f"    {g.description}", f"    Python: {g.python}", ""]
    lines += [
        "Handles live in the notebook namespace under --as NAME and are tracked weakly: `del NAME`, "
        "overwriting NAME, %reset, a failed cell, %unload_ext aner_nb and kernel exit release their memory.",
        "Without --as, %llm load and the builders name the handle after the model (or SRC_latency, SRC_batch...) "
        "and print the name.",
        "Without NAME, %%generate, %%chat and %llm info / kv / bench / chat use the default handle (%llm use NAME) "
        "and say which handle answered.",
        "Cell prompts: {var} is a variable, {In[n]} / {Out[n]} cell n's input / output, {Err} the last exception "
        "with its traceback, {Err[n]} the one cell n raised; {{var}} is literal.",
        "Settings: %config LLMMagics.stream_interval / max_tokens / display / format / timings / default_handle / "
        "default_to_latest / on_interrupt / release_failed_cells.",
        "Details of one subcommand: %llm help SUBCOMMAND (or %llm SUBCOMMAND -h).",
    ]
    return "\n".join(lines)
