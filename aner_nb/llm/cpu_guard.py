"""Use llama.cpp's CPU extra buffer types (AMX tiles, weight repacking) only where they execute.

At load llama.cpp may move quantized weights into "extra" CPU buffer types
whose kernels use AMX tile instructions or wider SIMD layouts. A CPU can
advertise AMX (CPUID, and the kernel grants the XTILEDATA permission) and
still fault on the first ``tilezero`` under some hypervisors; the process dies
by SIGILL at the first decode. A build compiled for instructions the CPU lacks
(``-march=native`` on another machine) dies the same way.

So ``cpu_extra_buffers="auto"`` (the default) asks a child process first: it
loads a tiny quantized model (``probe_model``) with extra buffers and decodes
once, and if that child dies, again without them. The verdict is cached on
disk per CPU signature and library build (a rebuild or another CPU probes
again). ``"on"`` and ``"off"`` skip the probe. The decision itself
(:func:`decide`) is a pure function of the children's outcomes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from .cache import cache_dir
from .errors import UnsupportedCPUError
from .probe_model import PROBE_MODEL_VERSION, write_probe_model

__all__ = [
    "ENV_VAR",
    "ProbeOutcome",
    "ExtraBuffers",
    "decide",
    "cpu_signature",
    "cpu_flags",
    "build_signature",
    "verdict_path",
    "probe_command",
    "run_probe_child",
    "resolve_extra_buffers",
]

log = logging.getLogger("aner_nb.llm")

ENV_VAR = "ANER_NB_CPU_EXTRA_BUFFERS"
PROBE_TIMEOUT_S = 180.0
_CPUINFO_KEYS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")


@dataclass(frozen=True)
class ProbeOutcome:
    """How one probe child ended. ``returncode < 0`` means killed by signal ``-returncode``."""

    extra_buffers: bool
    returncode: int
    seconds: float
    system_info: str = ""  # llama.cpp's system info, as the child printed it before decoding
    detail: str = ""  # the child's last stderr line, or "timeout"

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def timed_out(self) -> bool:
        return self.detail == "timeout"

    def describe(self) -> str:
        if self.ok:
            return "decoded"
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"died by {name}"
        return f"exited with status {self.returncode}" + (f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class ExtraBuffers:
    """Whether this load uses the CPU extra buffer types, and why."""

    use: bool
    reason: str
    cached: bool = False  # the verdict came from the on-disk cache


def decide(outcomes: Sequence[ProbeOutcome]) -> tuple[bool | None, str]:
    """``(use_extra_buffers, reason)`` from the probe children; ``None``: neither way works.

    The first outcome is the child with extra buffers; the second, if any,
    the one without. Pure: no processes, no files.
    """
    if not outcomes:
        raise ValueError("decide() needs at least one probe outcome")
    with_extra = outcomes[0]
    if with_extra.ok:
        return True, "probe: load and decode with CPU extra buffer types succeeded"
    if len(outcomes) > 1 and outcomes[1].ok:
        return False, (
            f"probe: the child using CPU extra buffer types (AMX/repack) {with_extra.describe()}; "
            "this process uses plain CPU buffers instead"
        )
    tried = "; ".join(
        f"{'with' if o.extra_buffers else 'without'} extra buffers: {o.describe()}" for o in outcomes
    )
    return None, f"probe: the llama.cpp build cannot run on this CPU ({tried})"


def _read_cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    fields = {}
    for line in first.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_signature() -> tuple[str, str]:
    """``(digest, description)`` of this CPU: vendor, family/model/stepping and feature flags."""
    info = _read_cpuinfo()
    parts = [f"{k}={info.get(k, '')}" for k in _CPUINFO_KEYS] if info else [platform.machine(), platform.processor()]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    name = info.get("model name") or platform.processor() or platform.machine()
    return digest, f"{name} ({os.cpu_count()} logical CPUs)"


def cpu_flags() -> tuple[str, ...]:
    """The CPU's feature flags as the kernel lists them (``/proc/cpuinfo``), sorted; () where unreadable."""
    return tuple(sorted(set(_read_cpuinfo().get("flags", "").split())))


def _engine_library_dir() -> Path | None:
    """llama-cpp-python's folder of shared libraries, found without importing (loading) them."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


@functools.lru_cache(maxsize=None)
def _hash_libraries(lib_dir: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, _size, _mtime in stamp:
        h.update(name.encode())
        with open(os.path.join(lib_dir, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def build_signature() -> str:
    """A digest of the llama-cpp-python version and the bytes of its shared libraries."""
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    lib_dir = _engine_library_dir()
    libs: tuple[tuple[str, int, int], ...] = ()
    if lib_dir is not None and lib_dir.is_dir():
        entries = sorted(p for p in lib_dir.iterdir() if p.is_file() and not p.is_symlink())
        libs = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in entries)
    # Keyed by size and mtime too, so a reinstalled build in the same folder is hashed anew.
    return f"{version}-{_hash_libraries(str(lib_dir), libs)}"


def verdict_path(cpu: str, build: str) -> Path:
    return cache_dir() / "cpu-probe" / f"{cpu}-{build}.json"


def _probe_model_path() -> Path:
    path = cache_dir() / "cpu-probe" / f"probe-model-v{PROBE_MODEL_VERSION}.gguf"
    return path if path.is_file() else write_probe_model(path)


def probe_command(extra_buffers: bool, model: Path) -> list[str]:
    """The child's command line (tests substitute a child that dies by a chosen signal)."""
    return [sys.executable, "-m", "aner_nb.llm._probe_child", str(model), "on" if extra_buffers else "off"]


def run_probe_child(extra_buffers: bool, model: Path, *, timeout: float = PROBE_TIMEOUT_S) -> ProbeOutcome:
    """Run one probe child and report how it ended; never raises for a child's death."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # the child imports this same aner_nb
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            probe_command(extra_buffers, model), env=env, capture_output=True, text=True,
            timeout=timeout, stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return ProbeOutcome(extra_buffers, -int(signal.SIGKILL), time.perf_counter() - t0, detail="timeout")
    seconds = time.perf_counter() - t0
    info = ""
    for line in proc.stdout.splitlines():
        if line.startswith("system_info="):
            info = line.partition("=")[2].strip()
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    return ProbeOutcome(extra_buffers, proc.returncode, seconds, info, lines[-1][-300:] if lines else "")


def _read_verdict(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("use"), bool) else None


def _write_verdict(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2), encoding="utf-8")
    os.replace(tmp, path)


def resolve_extra_buffers(
    setting: str = "auto", *, runner: Callable[[bool, Path], ProbeOutcome] = run_probe_child
) -> ExtraBuffers:
    """Decide whether a load uses CPU extra buffers; probes in a child once per CPU and build.

    ``setting`` is a checked ``LoadSettings.cpu_extra_buffers`` (``load()``
    resolves the environment variable). Raises :class:`UnsupportedCPUError`
    when the build cannot run on this CPU at all, instead of letting this
    process die.
    """
    if setting != "auto":
        return ExtraBuffers(setting == "on", f"forced by cpu_extra_buffers={setting!r}")
    cpu, cpu_name = cpu_signature()
    build = build_signature()
    path = verdict_path(cpu, build)
    cached = _read_verdict(path)
    if cached is not None:
        if cached.get("unusable"):
            raise UnsupportedCPUError(_unusable_message(cached["reason"], cached.get("system_info", "")))
        return ExtraBuffers(cached["use"], cached["reason"], cached=True)
    model = _probe_model_path()
    outcomes = [runner(True, model)]
    if not outcomes[0].ok:
        outcomes.append(runner(False, model))
    use, reason = decide(outcomes)
    info = next((o.system_info for o in outcomes if o.system_info), "")
    record = {
        "use": bool(use), "unusable": use is None, "reason": reason, "cpu": cpu_name, "cpu_signature": cpu,
        "build": build, "system_info": info, "probed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "outcomes": [asdict(o) for o in outcomes],
    }
    if not any(o.timed_out for o in outcomes):  # a timeout says nothing lasting about the CPU
        _write_verdict(path, record)
    if use is None:
        raise UnsupportedCPUError(_unusable_message(reason, info))
    if not use:
        log.warning("aner_nb: %s (cpu_extra_buffers='auto'; verdict cached in %s)", reason, path)
    return ExtraBuffers(use, reason)


def _unusable_message(reason: str, info: str) -> str:
    return (
        f"{reason}. The installed llama-cpp-python was probably compiled for another CPU "
        f"(build features: {info or 'unknown'}); reinstall it with portable flags, see docs/install.md"
    )
