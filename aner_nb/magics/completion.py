"""Tab completion for ``%llm``, ``%%generate`` and ``%%chat``, read from the magics' own grammars.

After ``%llm`` it offers the subcommands; after a subcommand (or on the first
line of a cell magic) it offers that grammar's ``--flags``, the choices of a
flag that has them (``--kv-cache-type``, ``--format``...), and handle names
where a handle goes: the positional slots that name a handle, and
``--session``. Nothing here is hand-listed except which positionals are
handles, so a new option completes as soon as it is declared.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable, Mapping

from .parser import Grammar

__all__ = ["completion_matcher", "candidates"]

_LLM_LINE = re.compile(r"(?:^|[\s=(])%llm\s+(.*)$")
_CELL_LINE = re.compile(r"^%%(generate|chat)\s")

# How many leading positionals of each grammar name a handle (None: all of them).
HANDLE_POSITIONALS: dict[str, int | None] = {
    "optimize": 1, "batch": 1, "adapter": 1, "pool": 1, "use": 1, "info": 1, "kv": 1, "close": None,
    "serve": 1, "stop": 1, "bench": 2, "generate": 1, "chat": 1,
}
HANDLE_OPTIONS = {"--session"}  # options whose value is a handle


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: action for action in parser._actions for opt in action.option_strings}


def _arguments(grammar: Grammar, args: list[str], names: Callable[[], list[str]]) -> list[str]:
    """Completions for the last of ``args`` (the words after the subcommand or cell magic)."""
    options = _options(grammar.parser)
    current = args[-1]
    if current.startswith("-"):
        return sorted(o for o in options if o.startswith(current) and o not in ("-h", "--help"))
    previous = options.get(args[-2]) if len(args) >= 2 else None
    if previous is not None and previous.nargs != 0:
        if previous.choices:
            return [str(c) for c in previous.choices if str(c).startswith(current)]
        if args[-2] in HANDLE_OPTIONS:
            return [n for n in names() if n.startswith(current)]
        return []
    positional, skip = 0, False
    for word in args[:-1]:
        if skip:
            skip = False
        elif word in options:
            skip = options[word].nargs != 0
        else:
            positional += 1
    slots = HANDLE_POSITIONALS.get(grammar.name, 0)
    if slots is None or positional < slots:
        return [n for n in names() if n.startswith(current)]
    return []


def candidates(
    text: str, first_line: str, cursor_line: int, names: Callable[[], list[str]],
    commands: Mapping[str, Grammar], cells: Mapping[str, Grammar],
) -> tuple[list[str], str]:
    """``(completions, fragment they replace)`` for the text before the cursor."""
    match = _LLM_LINE.search(text)
    if match:
        words = match.group(1).split(" ")
        if len(words) == 1:
            return [s for s in commands if s.startswith(words[0])], words[0]
        grammar = commands.get(words[0])
        return (_arguments(grammar, words[1:], names) if grammar else []), words[-1]
    cell = _CELL_LINE.match(first_line)
    if cursor_line == 0 and cell:
        words = text.split(" ")[1:]
        return _arguments(cells[cell.group(1)], words, names), words[-1]
    return [], ""


def completion_matcher(
    names: Callable[[], list[str]], commands: Mapping[str, Grammar], cells: Mapping[str, Grammar]
) -> Any:
    """An IPython Matcher-API-v2 completer over these grammars, or None on IPython < 8.6."""
    try:
        from IPython.core.completer import SimpleCompletion, completion_matcher as register
    except ImportError:  # pragma: no cover - IPython < 8.6 has no v2 matchers
        return None

    @register(identifier="aner_nb.handles", priority=1, api_version=2)
    def matcher(context: Any) -> Any:
        found, fragment = candidates(context.text_until_cursor, context.full_text.split("\n")[0],
                                     context.cursor_line, names, commands, cells)
        completions = [SimpleCompletion(n, type="llm flag" if n.startswith("-") else "llm") for n in found]
        result: dict[str, Any] = {"completions": completions, "matched_fragment": fragment}
        if completions:
            result["suppress"] = True
        return result

    return matcher
