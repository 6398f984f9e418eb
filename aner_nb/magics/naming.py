"""Handle names the magics choose when ``--as`` is left out.

``%llm load models/SmolLM2-135M-Instruct-Q8_0.gguf`` binds
``smollm2_135m_instruct_q8_0``: the file stem (or the catalog name's last
part) as a lower-case Python identifier. A builder derives ``SRC_latency``,
``SRC_batch``, ``SRC_pool`` or ``SRC_<manifest stem>``. A name is taken when
the namespace holds anything there (a variable is never shadowed, a builtin
never hidden), unless it holds a handle that the same command bound under
that derived name before: re-running the cell replaces it, as re-running
``--as NAME`` does. Otherwise ``_2``, ``_3``... is appended.
"""

from __future__ import annotations

import builtins
import itertools
import keyword
import re
from typing import Any, Mapping

from .tables import is_handle

__all__ = ["identifier", "NameClaims"]

_EXTENSIONS = (".json", ".gguf")  # in this order: an adapter manifest is NAME.gguf.json


def identifier(text: str, fallback: str = "model") -> str:
    """A lower-case Python identifier from a path's or a model name's last part."""
    last = re.split(r"[/\\]", text.rstrip("/\\"))[-1]
    for ext in _EXTENSIONS:
        if last.lower().endswith(ext):
            last = last[: -len(ext)]
    name = re.sub(r"[^0-9A-Za-z]+", "_", last).strip("_").lower() or fallback
    if name[0].isdigit():
        name = f"m_{name}"
    if keyword.iskeyword(name) or hasattr(builtins, name):
        name += "_"
    return name


class NameClaims:
    """Which names were derived, and by which command (its ``key``), so a re-run reuses its name."""

    def __init__(self) -> None:
        self._keys: dict[str, Any] = {}

    def set(self, name: str, key: Any) -> None:
        """Record that ``name`` was derived by ``key`` (None: chosen by the user with ``--as``)."""
        if key is None:
            self._keys.pop(name, None)
        else:
            self._keys[name] = key

    def choose(self, base: str, key: Any, ns: Mapping[str, Any]) -> str:
        """``base``, else ``base_2``, ``base_3``...: the first name that is free in ``ns`` or that holds
        a handle ``key`` derived there before."""
        for i in itertools.count(1):
            name = base if i == 1 else f"{base}_{i}"
            if name not in ns or (is_handle(ns[name]) and self._keys.get(name) == key):
                return name
        raise AssertionError("unreachable")  # pragma: no cover
