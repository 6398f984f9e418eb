"""Cell prompts: what ``{var}``, ``{In[n]}``, ``{Out[n]}``, ``{Err}`` and ``{Err[n]}`` put into a cell's text.

- ``{name}``: ``str(namespace[name])``; an unknown name stays as written, and
  ``{{name}}`` is a literal ``{name}``.
- ``{In[n]}`` / ``{Out[n]}``: the source of input cell ``n`` / the value cell
  ``n`` returned (IPython's ``In`` list and ``Out`` dict; ``{In[-2]}`` is the
  cell before this one).
- ``{Err}``: the last exception with its traceback, as IPython recorded it
  (``sys.last_exc`` / ``sys.last_value``), so "explain this error: {Err}" works.
- ``{Err[n]}``: the exception cell ``n`` raised, with its traceback (``{Err[-1]}``
  is the most recent one recorded). The extension records each failed cell's
  exception as text after the cell (:class:`ErrorLog`, the last
  :data:`ERROR_LOG_SIZE` of them), never the exception itself: its frames
  would keep the cell's handles alive.

Only these shapes are looked up (no attribute access or expressions), so the
braces of JSON or code in a prompt are left alone. A reference to a cell or
an error that does not exist raises :class:`PromptError` instead of sending
the braces to the model; ``{{In[3]}}``, ``{{Err}}`` and ``{{Err[3]}}`` are literals.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections import OrderedDict
from typing import Any, Callable, Mapping

__all__ = ["PromptError", "interpolate", "last_error", "format_error", "ErrorLog", "ERROR_LOG_SIZE"]

ERROR_LOG_SIZE = 100  # failed cells whose exception {Err[n]} can still name

_REF = re.compile(
    r"\{\{(?P<literal>[A-Za-z_][A-Za-z0-9_]*(?:\[-?\d+\])?)\}\}"
    r"|\{(?P<cache>In|Out|Err)\[(?P<index>-?\d+)\]\}"
    r"|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)\}"
)


class PromptError(LookupError):
    """A ``{In[n]}``, ``{Out[n]}``, ``{Err}`` or ``{Err[n]}`` that names nothing."""


class ErrorLog:
    """The exceptions of failed cells as text, by execution count; the last ``size`` of them."""

    def __init__(self, size: int = ERROR_LOG_SIZE) -> None:
        self.size = size
        self._texts: OrderedDict[int, str] = OrderedDict()

    def record(self, count: int | None, error: BaseException | None) -> None:
        """Keep ``error`` (formatted now) as cell ``count``'s; nothing for a cell without a count or error."""
        if count is None or not isinstance(error, BaseException):
            return
        self._texts.pop(count, None)
        self._texts[count] = format_error(error)
        while len(self._texts) > self.size:
            self._texts.popitem(last=False)

    def get(self, n: int) -> str | None:
        """Cell ``n``'s exception text; a negative ``n`` counts back from the most recent one recorded."""
        if n < 0:
            texts = list(self._texts.values())
            return texts[n] if -n <= len(texts) else None
        return self._texts.get(n)

    def __len__(self) -> int:
        return len(self._texts)


def interpolate(
    template: str, namespace: Mapping[str, Any], *, error: "str | Callable[[], str | None] | None" = None,
    errors: "ErrorLog | None" = None,
) -> str:
    """Fill ``template``'s references from ``namespace`` (a notebook's user namespace, with ``In``/``Out``).

    ``error`` is the text ``{Err}`` becomes (or a function returning it, called only when
    the template has ``{Err}``); without one, ``{Err}`` raises :class:`PromptError`.
    ``errors`` is where ``{Err[n]}`` is looked up; without it, ``{Err[n]}`` raises too.
    """

    def sub(match: "re.Match[str]") -> str:
        literal, cache, index, name = match.group("literal", "cache", "index", "name")
        if literal is not None:
            return "{" + literal + "}"
        if cache == "Err":
            return _error(errors, int(index))
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


def _error(errors: "ErrorLog | None", n: int) -> str:
    """``Err[n]`` as text."""
    text = errors.get(n) if errors is not None else None
    if text is None:
        which = f"cell {n} raised no exception" if n >= 0 else f"fewer than {-n} failed cells are recorded"
        raise PromptError(f"{{Err[{n}]}}: {which} in this session")
    return text


def last_error() -> str | None:
    """The last exception IPython showed, with its traceback (IPython's own frames left out), or None."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not isinstance(exc, BaseException):
        return None
    return format_error(exc)


def format_error(exc: BaseException) -> str:
    """An exception with its traceback, as IPython shows it (IPython's own frames left out)."""
    tb = exc.__traceback__
    ipython = _ipython_dir()
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(ipython):
        tb = tb.tb_next  # run_cell's exec frames: what IPython's own display skips too
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip("\n")


def _ipython_dir() -> str:
    import IPython

    return os.path.dirname(IPython.__file__) + os.sep
