"""aner_nb: run local GGUF language models fast and measurably from a notebook.

``%load_ext aner_nb`` registers the notebook magics; ``from aner_nb import llm``
is the plain library underneath them.
"""

from __future__ import annotations

from . import llm
from ._version import __version__

__all__ = ["llm", "__version__", "load_ipython_extension", "unload_ipython_extension"]


def load_ipython_extension(shell: object) -> None:
    """``%load_ext aner_nb``: register %llm, %%generate and %%chat (see ``aner_nb.magics``)."""
    from .magics import load_ipython_extension as load

    load(shell)


def unload_ipython_extension(shell: object) -> None:
    """``%unload_ext aner_nb``: remove every hook and magic it added and close the tracked handles."""
    from .magics import unload_ipython_extension as unload

    unload(shell)
