"""Outsider text must encode as UTF-8 before anything tokenizes or renders it.

A JSON body's ``"\\ud800"`` escape (or bytes decoded with ``surrogateescape``)
gives a Python string with a lone surrogate, which no encoder accepts: deep in
the tokenizer that was an untyped ``UnicodeEncodeError`` (an HTTP 500). This
walks a request's text (a prompt, messages, tools, stops), iteratively, and
names the first string that cannot be encoded by its path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import InvalidRequestError

__all__ = ["check_text", "lone_surrogate"]


def lone_surrogate(text: str) -> int | None:
    """The index of the first character of ``text`` that UTF-8 cannot encode (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_text(value: Any, param: str) -> None:
    """Refuse ``value`` (a string, or mappings and sequences holding strings, keys included) when any string in it
    is not valid Unicode; ``InvalidRequestError`` with ``param`` the path (``messages[2].content``)."""
    todo: list[tuple[Any, str]] = [(value, param)]
    while todo:
        item, path = todo.pop()
        if isinstance(item, str):
            at = lone_surrogate(item)
            if at is not None:
                raise InvalidRequestError(
                    f"{path} is not valid Unicode: it holds a lone surrogate ({item[at]!r}) at index {at}; "
                    "text must encode as UTF-8", param=path)
        elif isinstance(item, Mapping):
            for key, sub in reversed(list(item.items())):
                if isinstance(key, str) and lone_surrogate(key) is not None:
                    todo.append((key, f"{path} key"))
                todo.append((sub, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key!r}]"))
        elif isinstance(item, (list, tuple)):
            todo.extend((sub, f"{path}[{i}]") for i, sub in reversed(list(enumerate(item))))
