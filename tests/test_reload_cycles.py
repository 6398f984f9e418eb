"""1,000 cycles of ``%llm load`` then ``%reset -f`` in one kernel: nothing native survives, nothing grows.

Issue 18's bound: after a warm-up of 100 cycles, the process's RSS, open
file descriptors and threads grow by less than 5%, and no native owner
(model, context, adapter, batch, sampler of ``aner_nb.llm._engine``) is alive
after any reset. Samples every 100 cycles, each taken right after a reset
without forcing a garbage collection: the registry must release the weights
when ``%reset`` drops the name, not whenever the cycle collector runs.
The engine runs one thread (``ANER_NB_THREADS=1``): each load's warm-up
decode then never waits on threads spinning for CPUs that other processes
hold, which roughly halves a cycle on a busy machine. The loop runs in its
own interpreter (one IPython shell, as a kernel holds), about 0.05 s a cycle.
The figures are in docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CYCLES = 1000
EVERY = 100
WARMUP = 100
MAX_GROWTH = 0.05

# The loop runs in a fresh interpreter holding one IPython shell with the extension loaded (the
# kernel's side of a notebook): the test process's own heap (every module of the suite) would make
# each %reset's two gc.collect() calls, most of a cycle, several times slower.
LOOP = textwrap.dedent("""
    import gc, json, sys, time
    import psutil
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output
    from aner_nb import magics
    from aner_nb.llm import _engine

    path, cycles, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "aner_nb")
    ext = magics.extension_for(ip)
    proc = psutil.Process()

    def owners():
        return sum(1 for o in gc.get_objects() if isinstance(o, _engine._Owner) and o.alive)

    def sample(cycle):
        with proc.oneshot():
            rss, fds, threads = proc.memory_info().rss, proc.num_fds(), proc.num_threads()
        return {"cycle": cycle, "rss": rss, "fds": fds, "threads": threads, "owners": owners(),
                "handles": len(ext.handles)}

    samples, seen_loaded = [sample(0)], False
    t0 = time.perf_counter()
    with capture_output():  # each load prints one line
        for cycle in range(1, cycles + 1):
            loaded = ip.run_cell(f"%llm load {path} --as m --context 256")
            if not loaded.success:
                raise SystemExit(f"load failed at cycle {cycle}: {loaded.error_before_exec or loaded.error_in_exec!r}")
            if cycle == 1:
                seen_loaded = owners() > 0  # the count sees a loaded model
            reset = ip.run_cell("%reset -f")
            if not reset.success:
                raise SystemExit(f"reset failed at cycle {cycle}: {reset.error_before_exec or reset.error_in_exec!r}")
            if cycle % every == 0:
                samples.append(sample(cycle))
    print(json.dumps({"elapsed": time.perf_counter() - t0, "seen_loaded": seen_loaded, "samples": samples}))
""")


def test_a_thousand_load_reset_cycles_leak_nothing(llama_path):
    env = {**os.environ, "ANER_NB_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", LOOP, str(llama_path), str(CYCLES), str(EVERY)],
                          capture_output=True, text=True, timeout=1800, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    samples = result["samples"]
    print(f"{CYCLES} cycles in {result['elapsed']:.1f} s; samples: {samples}")
    assert result["seen_loaded"] and [s["cycle"] for s in samples] == list(range(0, CYCLES + 1, EVERY))
    assert all(s["owners"] == 0 and s["handles"] == 0 for s in samples), samples
    warm = [s for s in samples if s["cycle"] <= WARMUP]
    tail = samples[-2:]  # cycles 900 and 1000
    for key in ("rss", "fds", "threads"):
        base, final = max(s[key] for s in warm), max(s[key] for s in tail)
        assert (final - base) / base < MAX_GROWTH, (key, base, final, samples)
