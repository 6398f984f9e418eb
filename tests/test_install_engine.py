"""scripts/install_engine.py: the flag profile each CPU of this machine kind gets, and its wiring.

The CPU flag sets are the ones seen on this project's machine kind: an
AVX2-only Xeon, a Xeon guest advertising AVX-512 and AMX (which faults on
AMX tiles), and an AMD EPYC with AVX-512 and no AMX.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("install_engine", ROOT / "scripts" / "install_engine.py")
install_engine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install_engine)

AVX2_XEON = set("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 popcnt".split())
AMX_XEON = AVX2_XEON | set(
    "avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16 avx512_fp16 "
    "amx_tile amx_int8 amx_bf16".split()
)
EPYC_ZEN4 = AVX2_XEON | set("avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16".split())


def test_each_cpu_of_the_machine_kind_gets_a_profile_it_can_run():
    assert install_engine.choose_profile(AVX2_XEON, "x86_64") == "avx2"
    assert install_engine.choose_profile(AMX_XEON, "x86_64") == "avx512"
    assert install_engine.choose_profile(EPYC_ZEN4, "x86_64") == "avx512"
    assert install_engine.choose_profile(AVX2_XEON - {"avx2"}, "x86_64") == "native"
    assert install_engine.choose_profile(set(), "aarch64") == "native"


def test_no_profile_compiles_native_code_or_amx_on_x86():
    for flags in (AVX2_XEON, AMX_XEON, EPYC_ZEN4):
        profile = install_engine.choose_profile(flags, "x86_64")
        args = install_engine.cmake_args(profile, flags)
        assert "-DGGML_NATIVE=OFF" in args
        assert not any("AMX" in a for a in args), args
    # AVX-512 extras only where the CPU advertises them.
    partial = AVX2_XEON | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
    args = install_engine.cmake_args("avx512", partial)
    assert "-DGGML_AVX512=ON" in args and not any("VNNI" in a or "BF16" in a or "VBMI" in a for a in args)
    assert "-DGGML_AVX512_BF16=ON" in install_engine.cmake_args("avx512", EPYC_ZEN4)
    with pytest.raises(ValueError, match="unknown profile"):
        install_engine.cmake_args("avx9000", EPYC_ZEN4)


def test_script_version_matches_the_exact_pin():
    pin = re.search(r'"llama-cpp-python==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert install_engine.VERSION == pin


def test_readme_and_ci_install_the_engine_with_the_script_before_the_package():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in readme.splitlines() if "pytest --nbval" in line and line.startswith("python3"))
    assert test_command in ci.splitlines()
    for line in (test_command, next(line for line in readme.splitlines() if "aner_nb report" in line and line.startswith("python3"))):
        assert line.index("scripts/install_engine.py") < line.index("pip install")


def test_dry_run_names_the_profile_and_flags(tmp_path):
    env = {"ANER_NB_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "ANER_NB_ENGINE_PROFILE": "avx2"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_engine.py"), "--dry-run"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert "profile avx2" in out and "-DGGML_NATIVE=OFF" in out and "-DGGML_AVX512=ON" not in out
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_engine.py"), "--dry-run"],
                         env=dict(env, CMAKE_ARGS="-DGGML_CUDA=on"), capture_output=True, text=True, check=True).stdout
    assert "profile custom: CMAKE_ARGS=-DGGML_CUDA=on" in out
    assert not list(tmp_path.iterdir())  # a dry run builds and writes nothing


def _dry_run(tmp_path, *extra_argv):
    env = {"ANER_NB_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "ANER_NB_ENGINE_PROFILE": "avx512"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "install_engine.py"), "--dry-run", *extra_argv],
                          env=env, capture_output=True, text=True)


def test_cmake_extra_appends_options_and_gets_its_own_wheel_folder(tmp_path):
    plain = _dry_run(tmp_path)
    off = _dry_run(tmp_path, "--cmake-extra=-DGGML_LLAMAFILE=OFF -DGGML_OPENMP=OFF")
    assert plain.returncode == off.returncode == 0, off.stderr
    plain_flags = plain.stdout.split("CMAKE_ARGS=")[1].splitlines()[0]
    off_flags = off.stdout.split("CMAKE_ARGS=")[1].splitlines()[0]
    assert off_flags == plain_flags + " -DGGML_LLAMAFILE=OFF -DGGML_OPENMP=OFF"
    folder = {out.stdout.split("wheel folder ")[1].strip() for out in (plain, off)}
    assert len(folder) == 2  # another flag set, another cached wheel
    # No extra options: the digest (and so an existing cached wheel) is unchanged.
    assert _dry_run(tmp_path, "--cmake-extra=").stdout == plain.stdout
    assert install_engine.extra_cmake_args("-DA=1  -DB=OFF") == ["-DA=1", "-DB=OFF"]


def test_cmake_extra_refuses_anything_but_cache_settings(tmp_path):
    for bad in ("--cmake-extra=foo", "--cmake-extra=-DGGML_OPENMP", "--cmake-extra=-DA=1 --target all"):
        out = _dry_run(tmp_path, bad)
        assert out.returncode == 2 and "-DNAME=VALUE options only" in out.stderr, (bad, out.stderr)
    with pytest.raises(ValueError, match="'foo'"):
        install_engine.extra_cmake_args("-DA=1 foo")


def test_wheel_only_prints_the_cached_wheel_and_installs_nothing(tmp_path):
    folder = Path(_dry_run(tmp_path, "--cmake-extra=-DGGML_OPENMP=OFF").stdout.split("wheel folder ")[1].strip())
    folder.mkdir(parents=True)
    # Not a real wheel: installing it would fail, so a zero exit shows nothing was installed.
    wheel = folder / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    wheel.write_bytes(b"not a wheel")
    env = {"ANER_NB_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "ANER_NB_ENGINE_PROFILE": "avx512"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_engine.py"), "--wheel-only",
                          "--cmake-extra=-DGGML_OPENMP=OFF"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == str(wheel)
    assert wheel.read_bytes() == b"not a wheel"
