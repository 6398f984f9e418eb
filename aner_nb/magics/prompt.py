"""Cell prompts: what ``{var}``, ``{In[n]}``, ``{Out[n]}`` and ``{Err}`` put into the text a cell sends.

- ``{name}``: ``str(namespace[name])``; an unknown name stays as written, and
  ``{{name}}`` is a literal ``{name}``.
- ``{In[n]}`` / ``{Out[n]}``: the source of input cell ``n`` / the value cell
  ``n`` returned (IPython's ``In`` list and ``Out`` dict; ``{In[-2]}`` is the
  cell before this one).
- ``{Err}``: the last exception with its traceback, as IPython recorded it
  (``sys.last_exc`` / ``sys.last_value``), so "explain this error: {Err}" works.

Only these shapes are looked up (no attribute access or expressions), so the
braces of JSON or code in a prompt are left alone. A reference to a cell or
an error that does not exist raises :class:`PromptError` instead of sending
the braces to the model; ``{{In[3]}}`` and ``{{Err}}`` are literals.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Any, Callable, Mapping

__all__ = ["PromptError", "interpolate", "last_error"]

_REF = re.compile(
    r"\{\{(?P<literal>[A-Za-z_][A-Za-z0-9_]*(?:\[-?\d+\])?)\}\}"
    r"|\{(?P<cache>In|Out)\[(?P<index>-?\d+)\]\}"
    r"|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)\}"
)


class PromptError(LookupError):
    """A ``{In[n]}``, ``{Out[n]}`` or ``{Err}`` that names nothing."""


def interpolate(
    template: str, namespace: Mapping[str, Any], *, error: "str | Callable[[], str | None] | None" = None
) -> str:
    """Fill ``template``'s references from ``namespace`` (a notebook's user namespace, with ``In``/``Out``).

    ``error`` is the text ``{Err}`` becomes (or a function returning it, called only when
    the template has ``{Err}``); without one, ``{Err}`` raises :class:`PromptError`.
    """

    def sub(match: "re.Match[str]") -> str:
        literal, cache, index, name = match.group("literal", "cache", "index", "name")
        if literal is not None:
            return "{" + literal + "}"
        if cache is not None:
            return _cell(namespace, cache, int(index))
        if name == "Err":
            text = error() if callable(error) else error
            if text is None:
                raise PromptError("{Err} is the last exception, and no cell has raised one yet")
            return text
        return str(namespace[name]) if name in namespace else match.group(0)

    return _REF.sub(sub, template)


def _cell(namespace: Mapping[str, Any], cache: str, n: int) -> str:
    """``In[n]`` or ``Out[n]`` as text."""
    history = namespace.get(cache)
    try:
        return str(history[n])  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        what = "input" if cache == "In" else "output"
        raise PromptError(f"{{{cache}[{n}]}}: cell {n} has no {what} in this session") from None


def last_error() -> str | None:
    """The last exception IPython showed, with its traceback (IPython's own frames left out), or None."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not isinstance(exc, BaseException):
        return None
    tb = exc.__traceback__
    ipython = _ipython_dir()
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(ipython):
        tb = tb.tb_next  # run_cell's exec frames: what IPython's own display skips too
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip("\n")


def _ipython_dir() -> str:
    import IPython

    return os.path.dirname(IPython.__file__) + os.sep
