"""A thread that stops decoding frees its OpenMP workers (``_engine.release_compute_threads``).

llama.cpp's CPU backend (built with OpenMP here) runs each graph on a team of
the calling thread's workers, kept for its next graph. While the workers of
idle teams outnumber the CPUs, libgomp stops every worker from spinning, and a
batching scheduler's decodes ran at 0.75-0.85x on 2 vCPUs (RESULTS.md, "OpenMP
teams"). These tests count the process's OS threads: a decoding thread has one
worker more (n_threads = 2) while it decodes, and none once it stopped.
"""

from __future__ import annotations

import time

import psutil
import pytest

from aner_nb import llm
from aner_nb.llm import _engine


@pytest.fixture(scope="module")
def openmp():
    if not _engine._openmp_pause_fn():
        pytest.skip("this engine build runs no OpenMP runtime: its decodes keep no team to free")


def _os_threads() -> int:
    return psutil.Process().num_threads()


def test_a_request_frees_the_workers_of_the_thread_that_decoded_it(llama_path, openmp):
    with llm.load(llama_path, context=256) as model, model.with_optimizer(threads=2, prefill_threads=2) as lease:
        lease.generate("warm up", max_tokens=2)  # every lazily started Python thread exists now
        before = _os_threads()
        during: list[int] = []
        lease.generate("hello there", max_tokens=6, on_text=lambda _: during.append(_os_threads()))
        after = _os_threads()
    assert during and max(during) == before + 1  # the team's one worker, between this thread's decodes
    assert after == before  # and gone once the request ended


def _settles_at(count: int) -> bool:
    """Whether the process comes down to ``count`` OS threads within 10 s (a scheduler ends its cycle first)."""
    deadline = time.monotonic() + 10
    while _os_threads() != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return _os_threads() == count


def test_an_idle_batching_scheduler_frees_its_workers(llama_path, openmp):
    with llm.load(llama_path, context=512) as model, model.with_optimizer(threads=2, prefill_threads=2) as source:
        source.generate("warm up", max_tokens=2)  # this thread's lazily started Python threads exist now
        idle = _os_threads() + 1  # and a batching lease adds its scheduler thread
        with source.with_batching(2) as lease:
            lease.generate("warm up", max_tokens=2)
            assert _settles_at(idle)
            during: list[int] = []
            lease.generate("hello there", max_tokens=6, on_text=lambda _: during.append(_os_threads()))
            assert during and max(during) == idle + 1  # the scheduler thread's worker while it decoded
            assert _settles_at(idle)  # freed when the lease went idle, the scheduler thread kept


def test_release_is_a_no_op_on_a_thread_that_never_decoded(openmp):
    before = _os_threads()
    assert _engine.release_compute_threads() is True
    assert _os_threads() == before


def test_a_thread_that_frees_a_context_frees_its_workers_too(llama_path, openmp):
    from aner_nb.llm._engine import ContextParams
    from aner_nb.llm.row_costs import measure_row_costs

    # A speculative lease measures its row costs on the thread that builds it, on a context it frees
    # (NativeContext.free); its requests may then decode on a scheduler thread, which an idle team here
    # would slow down.
    params = ContextParams(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2, n_threads_batch=2)
    with llm.load(llama_path, context=256) as model:
        _engine.release_compute_threads()  # this thread holds no team now, whatever ran before
        before = _os_threads()
        points = measure_row_costs(model._weights.native, params, 3, rounds=1)
        assert [k for k, _ in points] == [1, 2, 3]
        assert _os_threads() == before
