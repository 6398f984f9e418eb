"""What this process runs on: the CPU, the engine build, and the thread defaults a lease resolves to.

:func:`system_info` is the public form of what a benchmark manifest records
next to its figures (``aner_nb.bench.environment``) and what a user checks
when a figure looks wrong: which instruction sets llama.cpp was compiled with
(not the same as the CPU's), whether it can offload to an accelerator, and
how many threads ``threads=0`` means here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from . import _engine, cpu_guard

__all__ = ["SystemInfo", "system_info"]


@dataclass(frozen=True)
class SystemInfo:
    """The machine and engine build of this process (see :func:`system_info`)."""

    native_available: bool  # llama-cpp-python imports and its shared library initialises
    llama_cpp_python: str  # the installed version, or "not installed"
    build_info: str  # llama.cpp's system info string (llama_print_system_info); "" when unavailable
    build_flags: tuple[str, ...]  # the flags set to 1 in build_info ("AVX2", "LLAMAFILE", ...), sorted
    gpu_offload: bool  # the build can offload layers to an accelerator
    accelerator: str | None  # "cuda", "metal", another backend, or None for a CPU-only build
    cpu: str  # model name and logical CPU count
    cpu_signature: str  # the digest the CPU probe's verdicts are cached under
    cpu_flags: tuple[str, ...]  # the CPU's own feature flags (/proc/cpuinfo), sorted; () where unreadable
    cpu_count_logical: int
    cpu_count_physical: int | None  # None where the platform does not tell
    default_threads: tuple[int, int]  # (decode, prefill) threads for threads=0, $ANER_NB_THREADS applied


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def system_info() -> SystemInfo:
    """Describe this process's machine and engine build (imports the engine when it is installed).

    Raises ``ConfigurationError`` when ``$ANER_NB_THREADS`` is malformed, as a load would.
    """
    import psutil  # noqa: PLC0415 - only this call needs it

    available = _engine.native_available()
    info = _engine.system_info() if available else ""
    signature, cpu = cpu_guard.cpu_signature()
    return SystemInfo(
        native_available=available,
        llama_cpp_python=_package_version("llama-cpp-python"),
        build_info=info,
        build_flags=tuple(sorted(_engine.build_flags(info))) if info else (),
        gpu_offload=available and _engine.supports_gpu_offload(),
        accelerator=_engine.accelerator_kind() if available else None,
        cpu=cpu,
        cpu_signature=signature,
        cpu_flags=cpu_guard.cpu_flags(),
        cpu_count_logical=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        cpu_count_physical=psutil.cpu_count(logical=False),
        default_threads=_engine.default_threads(),
    )
