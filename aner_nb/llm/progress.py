"""Progress bars for the library's long steps (hashing, loading), shown only where someone watches.

``progress`` means the same everywhere it is accepted (``load``, ``sha256_file``,
``bench.run_sides``): ``True`` always shows a bar, ``False`` never does, and
``None`` shows one when the session is interactive. ``tqdm.auto`` picks the
bar: an ipywidgets bar in a Jupyter kernel (shown there whatever the output
stream says, since a kernel's stderr is never a terminal) and a text bar on
stderr elsewhere, where ``None`` leaves it to tqdm (a terminal shows it; a
pipe, a log file or pytest's capture does not).

Bars are opened by the caller's thread: a bar advanced from a worker thread
(the first hash pass) is opened before the thread starts, so a notebook shows
the bars of one call in a fixed order.
"""

from __future__ import annotations

from typing import Any

__all__ = ["progress_bar", "NullBar"]


class NullBar:
    """What ``progress_bar`` returns when no bar is shown: the same methods, doing nothing."""

    n = 0

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "NullBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def progress_bar(progress: bool | None, *, total: float, desc: str, **options: Any) -> Any:
    """A ``tqdm.auto`` bar (a context manager with ``update(n)`` and ``close()``), or a :class:`NullBar`.

    ``progress``: True, False or None (interactive only; see the module docstring).
    ``options`` go to tqdm (``unit``, ``unit_scale``, ``bar_format``...). Bars are left
    in place when done (``leave=True``), so a notebook keeps the finished bar.
    """
    if progress is False:
        return NullBar()
    from tqdm.auto import tqdm  # imported on use: it looks for IPython, which a server process need not load

    return tqdm(total=total, desc=desc, disable=None if progress is None else False, leave=True, **options)
