"""``llm.system_info()``: the machine and engine build as one frozen value, and the manifest built from it."""

from __future__ import annotations

import dataclasses

import pytest

from aner_nb import bench, llm
from aner_nb.llm import _engine


def test_system_info_is_a_frozen_public_value():
    assert "system_info" in llm.__all__ and "SystemInfo" in llm.__all__
    info = llm.system_info()
    assert isinstance(info, llm.SystemInfo)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.cpu = "another"  # type: ignore[misc]
    assert info.cpu and info.cpu_signature and info.cpu_count_logical >= 1
    assert info.cpu_flags == tuple(sorted(set(info.cpu_flags)))
    decode, prefill = info.default_threads
    assert 1 <= decode and 1 <= prefill


def test_system_info_reports_the_build_as_the_engine_does():
    info = llm.system_info()
    assert info.native_available == _engine.native_available()
    if not info.native_available:
        assert (info.build_info, info.build_flags, info.gpu_offload, info.accelerator) == ("", (), False, None)
        return
    assert info.build_info == _engine.system_info() and "CPU :" in info.build_info
    assert set(info.build_flags) == _engine.build_flags(info.build_info) and info.build_flags == tuple(sorted(info.build_flags))
    assert info.gpu_offload == _engine.supports_gpu_offload()


def test_build_flags_reads_the_flags_set_to_one():
    line = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 | LLAMAFILE = 1 | CUDA : ARCHS = 890 | USE_GRAPHS = 1 | "
    assert _engine.build_flags(line) == {"SSE3", "AVX2", "LLAMAFILE", "USE_GRAPHS"}


def test_default_threads_follow_the_override(monkeypatch):
    monkeypatch.setenv(_engine.THREADS_ENV, "3,5")
    assert llm.system_info().default_threads == (3, 5)
    monkeypatch.setenv(_engine.THREADS_ENV, "zero")
    with pytest.raises(llm.errors.ConfigurationError, match="ANER_NB_THREADS"):
        llm.system_info()


def test_the_benchmark_manifest_is_built_from_it(monkeypatch):
    monkeypatch.setenv(_engine.THREADS_ENV, "2")
    info, env = llm.system_info(), bench.environment()
    assert env["cpu"] == info.cpu and env["cpu_count_logical"] == info.cpu_count_logical
    assert env["default_threads"] == [2, 2] and env["llama_cpp_python"] == info.llama_cpp_python
    assert env["system_info"] == (info.build_info if info.native_available else "unavailable")
