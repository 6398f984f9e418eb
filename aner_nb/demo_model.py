"""The real demo models (re-exported from :mod:`aner_nb.llm.packaged`, where they are declared)."""

from __future__ import annotations

from .llm import packaged
from .llm.packaged import *  # noqa: F401,F403 - the public names, declared once in llm/packaged.py

__all__ = list(packaged.__all__)
