"""Where aner_nb keeps files it derives on this machine (assembled demo model, CPU probe verdicts)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """``$ANER_NB_CACHE``, else ``~/.cache/aner_nb``."""
    return Path(os.environ.get("ANER_NB_CACHE") or Path.home() / ".cache" / "aner_nb")
