"""What a measurement needs next to its figures: the machine, the build, the settings, and exclusivity.

``environment()`` records the machine and build (CPU model and count, llama.cpp's
system info string, package versions, git revision, load average);
``lease_settings(model)`` the settings a lease really runs with (resolved
``n_threads`` / ``n_threads_batch``, batch sizes, flash attention, KV type,
context), a frozen :class:`LeaseSettings` whose JSON form for a manifest is
:meth:`LeaseSettings.as_dict` (``dataclasses.asdict``). ``exclusive()`` is a machine-wide lock: two benchmarks running at once
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from ..llm import Profile

__all__ = [
    "BenchmarkBusyError", "environment", "LeaseSettings", "lease_settings", "exclusive", "git_revision", "load_average",
]

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
    from ..llm import system_info

    system = system_info()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "cpu": system.cpu,
        "cpu_count_logical": system.cpu_count_logical,
        "cpu_count_physical": system.cpu_count_physical,
        "default_threads": list(system.default_threads),  # what threads=0 resolves to here: (decode, prefill)
        "llama_cpp_python": system.llama_cpp_python,
        "packages": {p: _package_version(p) for p in _PACKAGES},
        # llama.cpp's own list of the instruction sets this build compiled in (not the CPU's).
        "system_info": system.build_info if system.native_available else "unavailable",
        "git_revision": git_revision(),
        "load_average": load_average(),
    }


@dataclass(frozen=True)
class LeaseSettings:
    """The engine settings a lease's contexts are created with, resolved (no ``0 = default`` left)."""

    context: int
    kv_cache_type: str
    flash_attention: str
    cpu_extra_buffers: str
    n_threads: int
    n_threads_batch: int
    n_batch: int
    n_ubatch: int
    kind: str
    profile: "Profile"

    def as_dict(self) -> dict[str, Any]:
        """The JSON form for a manifest (the profile as nested dicts)."""
        return dataclasses.asdict(self)


def lease_settings(model: Any) -> LeaseSettings | None:
    """The settings ``model`` (a lease) runs with; None for anything that is not a lease."""
    from ..llm import Lease

    if not isinstance(model, Lease):
        return None
    params, load = model.context_params, model.load_summary()
    return LeaseSettings(
        context=model.context,
        kv_cache_type=params.kv_cache_type,
        flash_attention=params.flash_attention,
        cpu_extra_buffers=load.cpu_extra_buffers,
        n_threads=params.n_threads,
        n_threads_batch=params.n_threads_batch,
        n_batch=params.n_batch,
        n_ubatch=params.n_ubatch,
        kind=model.kind,
        profile=model.profile,
    )


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
