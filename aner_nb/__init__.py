"""aner_nb: run local GGUF language models fast and measurably from a notebook.

``%load_ext aner_nb`` registers the notebook magics; ``from aner_nb import llm``
is the plain library underneath them.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import llm  # noqa: E402

__all__ = ["llm", "__version__"]
