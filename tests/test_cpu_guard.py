"""The CPU guard: extra buffer types (AMX, repack) are used only after a child survived them.

No AMX machine is needed: the probe seam (``cpu_guard.probe_command``) is
pointed at real child processes that die by SIGILL or SIGSEGV, and the load
that follows must succeed in this process on the fallback, with the verdict
cached per CPU signature and library build.
"""

from __future__ import annotations

import functools
import json
import signal
import sys

import pytest

from aner_nb import llm
from aner_nb.llm import cpu_guard, errors
from aner_nb.llm.cpu_guard import ProbeOutcome, decide


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ANER_NB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_guard.ENV_VAR, raising=False)
    return tmp_path / "cache"


def fake_child(monkeypatch, tmp_path, *, on: str, off: str = "ok") -> "callable":
    """Point the probe at a child that, per mode, exits 0 ("ok") or kills itself by a signal name.

    Every start appends a line to a log file; returns a function that reads the starts.
    """
    log = tmp_path / "children.log"
    script = (
        "import os, signal, sys\n"
        "mode, action = sys.argv[1], sys.argv[2]\n"
        f"open({str(log)!r}, 'a').write(mode + '\\n')\n"
        "print('system_info=CPU : AVX2 = 1 | AMX_INT8 = 1 | fake child |', flush=True)\n"
        "if action != 'ok':\n"
        "    os.kill(os.getpid(), getattr(signal, action))\n"
    )

    def command(extra_buffers, model):
        mode = "on" if extra_buffers else "off"
        return [sys.executable, "-c", script, mode, on if extra_buffers else off]

    monkeypatch.setattr(cpu_guard, "probe_command", command)
    return lambda: log.read_text().split() if log.exists() else []


def outcome(extra, rc, detail=""):
    return ProbeOutcome(extra, rc, 0.1, "", detail)


def test_decide_is_a_pure_function_of_the_outcomes():
    assert decide([outcome(True, 0)])[0] is True
    use, reason = decide([outcome(True, -int(signal.SIGILL)), outcome(False, 0)])
    assert use is False and "SIGILL" in reason and "plain CPU buffers" in reason
    use, reason = decide([outcome(True, -int(signal.SIGSEGV)), outcome(False, -int(signal.SIGILL))])
    assert use is None and "SIGSEGV" in reason and "SIGILL" in reason
    use, reason = decide([outcome(True, 1, "EngineError: boom"), outcome(False, 0)])
    assert use is False and "status 1" in reason and "boom" in reason
    with pytest.raises(ValueError):
        decide([])


@pytest.mark.parametrize("signame", ["SIGILL", "SIGSEGV"])
def test_child_dying_by_signal_falls_back_and_the_load_succeeds(cache, monkeypatch, tmp_path, llama_path, signame):
    starts = fake_child(monkeypatch, tmp_path, on=signame)
    with llm.load(llama_path, context=128) as model:
        summary = model.load_summary()
        assert summary.cpu_extra_buffers == "off"
        assert signame in summary.cpu_extra_buffers_reason
        assert model.memory_summary().cpu_extra_buffers == "off"
        assert model.generate("the cat", max_tokens=4).usage.completion_tokens >= 1
    assert starts() == ["on", "off"]  # tried with extra buffers, then without
    (verdict,) = (cache / "cpu-probe").glob("*-*.json")
    record = json.loads(verdict.read_text())
    assert record["use"] is False and record["unusable"] is False
    assert [o["returncode"] for o in record["outcomes"]] == [-int(getattr(signal, signame)), 0]
    assert "AMX_INT8" in record["system_info"]
    # The verdict is cached: the next load starts no child and says where the verdict came from.
    with llm.load(llama_path, context=128) as again:
        assert again.load_summary().cpu_extra_buffers == "off"
        assert "cached" in again.load_summary().cpu_extra_buffers_reason
    assert starts() == ["on", "off"]


def test_verdict_cache_is_keyed_by_cpu_signature_and_build(cache, monkeypatch, tmp_path):
    starts = fake_child(monkeypatch, tmp_path, on="ok")
    assert cpu_guard.resolve_extra_buffers("auto").use is True
    assert cpu_guard.resolve_extra_buffers("auto").cached is True
    assert len(starts()) == 1
    real_cpu, real_build = cpu_guard.cpu_signature(), cpu_guard.build_signature()
    monkeypatch.setattr(cpu_guard, "cpu_signature", lambda: ("another-cpu-0001", "Another CPU"))
    assert cpu_guard.resolve_extra_buffers("auto").cached is False  # another CPU: probed again
    assert len(starts()) == 2
    monkeypatch.setattr(cpu_guard, "cpu_signature", lambda: real_cpu)
    monkeypatch.setattr(cpu_guard, "build_signature", lambda: "0.3.36-otherbuild")
    assert cpu_guard.resolve_extra_buffers("auto").cached is False  # another build: probed again
    assert len(starts()) == 3
    monkeypatch.setattr(cpu_guard, "build_signature", lambda: real_build)
    assert cpu_guard.resolve_extra_buffers("auto").cached is True
    assert len(starts()) == 3
    names = sorted(p.name for p in (cache / "cpu-probe").glob("*.json"))
    assert len(names) == 3
    assert f"{real_cpu[0]}-{real_build}.json" in names


def test_build_signature_changes_with_the_library_bytes(tmp_path, monkeypatch):
    lib = tmp_path / "llama_cpp" / "lib"
    lib.mkdir(parents=True)
    (lib / "libggml-cpu.so").write_bytes(b"avx2 kernels")
    monkeypatch.setattr(cpu_guard, "_engine_library_dir", lambda: lib)
    first = cpu_guard.build_signature()
    assert first == cpu_guard.build_signature()
    (lib / "libggml-cpu.so").write_bytes(b"avx512 kernels, rebuilt")
    assert cpu_guard.build_signature() != first


def test_a_build_that_cannot_run_raises_a_typed_error_and_this_process_lives(cache, monkeypatch, tmp_path, llama_path):
    starts = fake_child(monkeypatch, tmp_path, on="SIGILL", off="SIGILL")
    with pytest.raises(errors.UnsupportedCPUError) as info:
        llm.load(llama_path, context=128)
    message = str(info.value)
    assert "SIGILL" in message and "docs/install.md" in message and "AMX_INT8" in message
    assert starts() == ["on", "off"]
    # Cached as unusable: the next load fails at once, without a child.
    with pytest.raises(errors.UnsupportedCPUError):
        llm.load(llama_path, context=128)
    assert starts() == ["on", "off"]
    # Forcing the setting skips the probe (the user takes responsibility).
    with llm.load(llama_path, context=128, cpu_extra_buffers="off") as model:
        assert model.load_summary().cpu_extra_buffers == "off"
        assert "forced" in model.load_summary().cpu_extra_buffers_reason
    assert starts() == ["on", "off"]


def test_a_timed_out_probe_is_not_cached(cache, monkeypatch, tmp_path):
    script = "import sys, time; time.sleep(0 if sys.argv[1] == 'off' else 30)"
    monkeypatch.setattr(cpu_guard, "probe_command",
                        lambda extra, model: [sys.executable, "-c", script, "on" if extra else "off"])
    runner = functools.partial(cpu_guard.run_probe_child, timeout=2)
    decision = cpu_guard.resolve_extra_buffers("auto", runner=runner)
    assert decision.use is False and "timed out" in decision.reason
    assert not list((cache / "cpu-probe").glob("*.json"))


def test_settings_are_checked_and_the_environment_variable_is_a_default(cache, monkeypatch, llama_path):
    with pytest.raises(errors.ConfigurationError, match="cpu_extra_buffers must be one of auto, on, off, got 'yes'"):
        llm.load(llama_path, cpu_extra_buffers="yes")
    monkeypatch.setenv(cpu_guard.ENV_VAR, "maybe")
    with pytest.raises(errors.ConfigurationError, match="ANER_NB_CPU_EXTRA_BUFFERS must be one of"):
        llm.load(llama_path)
    monkeypatch.setenv(cpu_guard.ENV_VAR, "off")
    with llm.load(llama_path, context=128) as model:
        assert model.load_summary().cpu_extra_buffers == "off"
    with llm.load(llama_path, context=128, cpu_extra_buffers="on") as model:  # the argument wins
        assert model.load_summary().cpu_extra_buffers == "on"
    assert not (cache / "cpu-probe").exists()  # forced settings start no probe


def test_the_real_probe_child_runs_this_build(cache):
    """No fake: the real child loads the quantized probe model and decodes on this CPU."""
    decision = cpu_guard.resolve_extra_buffers("auto")
    (verdict,) = (cache / "cpu-probe").glob("*-*.json")
    record = json.loads(verdict.read_text())
    assert record["outcomes"][0]["extra_buffers"] is True
    assert "CPU :" in record["system_info"]  # the child printed llama.cpp's system info
    # Whatever this CPU is, the decision matches what the children did.
    assert decision.use is (record["outcomes"][0]["returncode"] == 0)
