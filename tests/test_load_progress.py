"""Loading as a user watches it: progress bars for the hash passes, the native load and benchmark
rounds; the warm-up decode as its own timed phase; Ctrl-C during the native load.

Bars are ``tqdm.auto``: text on stderr here (no Jupyter kernel), widgets in a notebook
(``tests/test_notebook_kernel.py``). ``progress=None`` leaves a text bar to tqdm, which
shows none when stderr is not a terminal (pytest's capture is not).
"""

from __future__ import annotations

import hashlib

import pytest

from aner_nb import bench, llm
from aner_nb.llm import _engine, errors
from aner_nb.llm import loader as loader_module
from aner_nb.llm.progress import NullBar, progress_bar

CTX = 256


def test_a_warm_load_times_its_warm_up_and_frees_the_context(llama_path, decode_sizes):
    with llm.load(llama_path, context=CTX) as model:
        summary = model.load_summary()
        assert decode_sizes == [1]  # one 1-token decode at load time
        assert summary.warmup_duration > 0
        assert summary.total_duration >= summary.load_duration + summary.verify_duration + summary.warmup_duration
        assert model._weights.native.live_contexts() == 0  # the warm-up context is gone
        assert model.memory_summary().live_contexts == 0
        first = model.generate("the cat sat", max_tokens=4)
        # The first request's prefill is the request's own: measured, and no longer the load's page-in.
        assert first.timings.prompt_eval_duration > 0 and first.timings.evaluated_prompt_tokens > 0
        assert decode_sizes[0] == 1 and len(decode_sizes) > 1


def test_warmup_false_skips_the_decode_and_reports_minus_one(llama_path, decode_sizes):
    with llm.load(llama_path, context=CTX, warmup=False) as model:
        assert model.load_summary().warmup_duration == -1 and decode_sizes == []
        assert model.generate("hello", max_tokens=2).timings.prompt_eval_duration > 0
    with pytest.raises(errors.ConfigurationError, match="warmup must be True or False"):
        llm.load(llama_path, context=CTX, warmup="no")


def test_a_failed_warm_up_frees_the_weights(llama_path, monkeypatch):
    made = []
    real_model = _engine.NativeModel

    def recorded(*args, **kwargs):
        made.append(real_model(*args, **kwargs))
        return made[-1]

    def broken(self, batch):
        raise errors.EngineError("decode failed")

    monkeypatch.setattr(_engine, "NativeModel", recorded)
    monkeypatch.setattr(_engine.NativeContext, "decode", broken)
    with pytest.raises(errors.EngineError, match="decode failed"):
        llm.load(llama_path, context=CTX)
    assert made and not made[0].alive


def test_progress_true_shows_hash_load_and_verify_bars(llama_path, capsys):
    with llm.load(llama_path, context=CTX, progress=True):
        pass
    err = capsys.readouterr().err
    name = llama_path.name
    assert err.count(f"sha256 {name}") >= 2  # the first pass and the verification pass
    assert f"load {name}: 100%" in err  # llama.cpp's progress callback drove the load bar to the end
    with llm.load(llama_path, context=CTX, progress=False):
        pass
    with llm.load(llama_path, context=CTX):  # None: stderr is not a terminal here, so no bar
        pass
    assert capsys.readouterr().err == ""


def test_ctrl_c_during_the_native_load_aborts_it(llama_path, monkeypatch):
    class InterruptedLoadBar(NullBar):
        def update(self, n=1):
            raise KeyboardInterrupt  # what a kernel interrupt does inside llama.cpp's progress callback

    def bars(progress, *, total, desc, **options):
        return InterruptedLoadBar() if desc.startswith("load ") else NullBar()

    monkeypatch.setattr(loader_module, "progress_bar", bars)
    with pytest.raises(KeyboardInterrupt):
        llm.load(llama_path, context=CTX)
    monkeypatch.undo()
    with llm.load(llama_path, context=CTX) as model:  # nothing was left half loaded
        assert model.generate("again", max_tokens=2).usage.completion_tokens >= 1


def test_sha256_file_advances_a_bar_it_is_given(llama_path):
    class Bar(NullBar):
        def __init__(self):
            self.n, self.closed = 0, False

        def update(self, n=1):
            self.n += n

        def close(self):
            self.closed = True

    bar = Bar()
    data = llama_path.read_bytes()
    assert llm.sha256_file(llama_path, progress=bar, chunk_size=4096) == hashlib.sha256(data).hexdigest()
    assert bar.n == len(data) and not bar.closed  # the caller's bar: advanced, left open
    assert isinstance(progress_bar(False, total=1, desc="x"), NullBar)


def test_bench_rounds_show_a_bar_only_when_asked(llama_path, capsys):
    with llm.load(llama_path, context=CTX) as model:
        side = bench.lease_side("plain", model)
        bench.run_sides([side], [bench.Case("q", "hi", 2)], rounds=2, warmup=1, progress=True)
        err = capsys.readouterr().err
        assert "bench: 100%" in err and "3/3" in err  # warm-up round included
        bench.run_sides([side], [bench.Case("q", "hi", 2)], rounds=1, warmup=0)  # default: no bar
        assert capsys.readouterr().err == ""
