"""What a measurement needs next to its figures: the machine, the build, the settings, and exclusivity.

``environment()`` records the machine and build (CPU model and count, llama.cpp's
system info string, package versions, git revision, load average);
``lease_settings(model)`` the settings a lease really runs with (resolved
``n_threads`` / ``n_threads_batch``, batch sizes, flash attention, KV type,
context). ``exclusive()`` is a machine-wide lock: two benchmarks running at once
on a 2-core machine measure each other, so the second one refuses to start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import platform
import subprocess
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterator

__all__ = ["BenchmarkBusyError", "environment", "lease_settings", "exclusive", "git_revision", "load_average"]

_PACKAGES = ("aner-nb", "llama-cpp-python", "numpy", "gguf")


class BenchmarkBusyError(RuntimeError):
    """Another benchmark holds the machine-wide benchmark lock."""


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def git_revision() -> str:
    """``HEAD`` of the checkout aner_nb runs from, with ``-dirty`` for uncommitted changes; "" outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("-dirty" if dirty else "")


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on this platform
        return []


def environment() -> dict[str, Any]:
    """The machine and build a result was measured on, with the build's CPU features."""
    from ..llm import _engine, cpu_guard

    import psutil

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "cpu": cpu_guard.cpu_signature()[1],
        "cpu_count_logical": psutil.cpu_count(logical=True),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "llama_cpp_python": _package_version("llama-cpp-python"),
        "packages": {p: _package_version(p) for p in _PACKAGES},
        # llama.cpp's own list of the instruction sets this build compiled in (not the CPU's).
        "system_info": _engine.system_info() if _engine.native_available() else "unavailable",
        "git_revision": git_revision(),
        "load_average": load_average(),
    }


def lease_settings(model: Any) -> dict[str, Any]:
    """The engine settings a lease's contexts are created with, resolved (no ``0 = default`` left)."""
    from ..llm import Lease

    if not isinstance(model, Lease):
        return {}
    params, load = model.context_params, model.load_summary()
    return {
        "context": model.context,
        "kv_cache_type": params.kv_cache_type,
        "flash_attention": params.flash_attention,
        "cpu_extra_buffers": load.cpu_extra_buffers,
        "n_threads": params.n_threads,
        "n_threads_batch": params.n_threads_batch,
        "n_batch": params.n_batch,
        "n_ubatch": params.n_ubatch,
        "kind": model.kind,
        "profile": dataclasses.asdict(model.profile),
    }


_held = threading.local()


def _lock_path() -> Path:
    from ..llm.cache import cache_dir

    return cache_dir() / "benchmark.lock"


@contextlib.contextmanager
def exclusive(name: str = "benchmark") -> Iterator[None]:
    """Hold the machine-wide benchmark lock; re-entrant within one thread.

    Raises :class:`BenchmarkBusyError` at once (it never waits) when another
    process holds it, naming that process.
    """
    if getattr(_held, "depth", 0):
        _held.depth += 1
        try:
            yield
        finally:
            _held.depth -= 1
        return
    import fcntl

    path = _lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            raise BenchmarkBusyError(
                f"another benchmark is running ({holder}); run one benchmark at a time: "
                "two on this machine would measure each other"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{name}, pid {os.getpid()}, since {time.strftime('%H:%M:%S')}".encode(), 0)
        _held.depth = 1
        try:
            yield
        finally:
            _held.depth = 0
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
