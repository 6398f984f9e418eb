"""Notebook layer: ``%llm``, ``%%generate`` and ``%%chat`` with self-cleaning handles.

``%load_ext aner_nb`` calls :func:`load_ipython_extension`; ``%unload_ext
aner_nb`` undoes exactly what it added and closes the handles it tracks.
The table functions are plain Python (``handle_table(globals())``,
``handle_info(model)``, ``kv_table(model)``, ``bench_table(result)``), so every magic has a one- or
two-call Python equivalent; ``%llm help`` lists them.
"""

from __future__ import annotations

from typing import Any

from .prompt import interpolate, last_error
from .tables import bench_outputs, bench_table, handle_info, handle_table, is_handle, kv_table

__all__ = [
    "load_ipython_extension",
    "unload_ipython_extension",
    "extension_for",
    "handle_table",
    "handle_info",
    "kv_table",
    "bench_table",
    "bench_outputs",
    "is_handle",
    "interpolate",
    "last_error",
]

_EXTENSIONS: dict[int, Any] = {}  # id(shell) -> Extension


def load_ipython_extension(shell: Any) -> None:
    """Register the magics, the post-cell hook, the completer and the atexit hook on ``shell``."""
    if id(shell) in _EXTENSIONS:
        return
    from .magics import Extension

    extension = Extension(shell)
    extension.load()
    _EXTENSIONS[id(shell)] = extension


def unload_ipython_extension(shell: Any) -> None:
    """Remove everything :func:`load_ipython_extension` added and close the tracked handles."""
    extension = _EXTENSIONS.pop(id(shell), None)
    if extension is not None:
        extension.unload()


def extension_for(shell: Any) -> Any:
    """The loaded extension of ``shell`` (its ``handles`` registry and ``magics``), or None."""
    return _EXTENSIONS.get(id(shell))
