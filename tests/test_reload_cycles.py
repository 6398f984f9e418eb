"""1,000 cycles of ``%llm load`` then ``%reset -f`` in one kernel: nothing native survives, nothing grows.

Issue 18's bound: after a warm-up of 100 cycles, the process's RSS, open
file descriptors and threads grow by less than 5%, and no native owner
(model, context, adapter, batch, sampler of ``aner_nb.llm._engine``) is alive
after any reset. Samples every 100 cycles, each taken right after a reset
without forcing a garbage collection: the registry must release the weights
when ``%reset`` drops the name, not whenever the cycle collector runs.
The engine runs one thread (``ANER_NB_THREADS=1``): each load's warm-up
decode then never waits on threads spinning for CPUs that other processes
hold, which roughly halves a cycle on a busy machine.
The figures are in docs/reliability.md.
"""

from __future__ import annotations

import gc
import time

import psutil
from IPython.utils.capture import capture_output

from aner_nb.llm import _engine

CYCLES = 1000
EVERY = 100
WARMUP = 100
MAX_GROWTH = 0.05


def _live_native_owners() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, _engine._Owner) and o.alive)


def _sample(proc: psutil.Process, ext, cycle: int) -> dict:
    with proc.oneshot():
        rss, fds, threads = proc.memory_info().rss, proc.num_fds(), proc.num_threads()
    return {"cycle": cycle, "rss": rss, "fds": fds, "threads": threads, "owners": _live_native_owners(),
            "handles": len(ext.handles)}


def test_a_thousand_load_reset_cycles_leak_nothing(ip, llama_path, monkeypatch):
    from aner_nb import magics as magics_pkg

    monkeypatch.setenv(_engine.THREADS_ENV, "1")

    ext = magics_pkg.extension_for(ip)
    proc = psutil.Process()
    samples = [_sample(proc, ext, 0)]
    t0 = time.perf_counter()
    with capture_output():  # each load prints one line
        for cycle in range(1, CYCLES + 1):
            loaded = ip.run_cell(f"%llm load {llama_path} --as m --context 256")
            assert loaded.success, loaded.error_before_exec or loaded.error_in_exec
            if cycle == 1:
                assert _live_native_owners() > 0  # the count sees a loaded model
            reset = ip.run_cell("%reset -f")
            assert reset.success, reset.error_before_exec or reset.error_in_exec
            if cycle % EVERY == 0:
                samples.append(_sample(proc, ext, cycle))
    elapsed = time.perf_counter() - t0
    print(f"{CYCLES} cycles in {elapsed:.1f} s; samples: {samples}")

    assert all(s["owners"] == 0 and s["handles"] == 0 for s in samples), samples
    warm = [s for s in samples if s["cycle"] <= WARMUP]
    tail = samples[-2:]  # cycles 900 and 1000
    for key in ("rss", "fds", "threads"):
        base, final = max(s[key] for s in warm), max(s[key] for s in tail)
        assert (final - base) / base < MAX_GROWTH, (key, base, final, samples)
