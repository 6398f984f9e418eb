"""A batching scheduler's decodes with and without freeing idle OpenMP teams (``_engine.release_compute_threads``).

llama.cpp's CPU backend (built with OpenMP) runs each graph on workers of the thread that called
``llama_decode`` and keeps them for that thread's next graph. While the workers of every thread's team
outnumber the CPUs, libgomp stops each worker from spinning for new work, so every graph waits for a woken
thread. A notebook decodes on its main thread (an ordinary request) and a batching lease on its scheduler
thread: with both teams alive, the scheduler's decodes slowed down on 2 vCPUs.

In one process, ABBA over rounds after a warm-up: side "freed" is the library as it is (a thread frees its
team when it stops decoding); side "kept" makes the release a no-op, as before it existed. Each side runs
one ordinary request on the main thread, then the same request alone on a 1-sequence batching lease (the
scheduler thread), greedy, ``--tokens`` tokens, the same threads everywhere; reported: decode tok/s,
medians (min-max), and batched / ordinary per side.

Run: ``python benchmarks/bench_compute_threads.py [--model smollm2|gemma|PATH] [--threads 2] [--tokens 128]
[--rounds 5]``.
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import contextmanager
from typing import Iterator

from _models import SMOLLM2, add_model_option, header, resolve
from bench_bandwidth import PROMPT, spread

from aner_nb import bench
from aner_nb.llm import _engine


@contextmanager
def teams_kept() -> Iterator[None]:
    """Freeing a thread's OpenMP team is a no-op inside (as before ``release_compute_threads`` existed)."""
    saved = _engine._openmp_pause_fn()
    _engine._openmp_pause = False
    try:
        yield
    finally:
        _engine._openmp_pause = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_option(parser, SMOLLM2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not _engine._openmp_pause_fn():
        raise SystemExit("this engine build loaded no OpenMP runtime with omp_pause_resource_all: nothing to compare")
    with bench.exclusive("bench_compute_threads"):
        run(args)


def run(args: argparse.Namespace) -> None:
    choice = resolve(args.model)
    T = args.threads
    with choice.load(context=4096, flash_attention="off") as base, base.with_optimizer(threads=T, prefill_threads=T) as source:
        print(header(choice, base), flush=True)
        env = bench.manifest(base)
        print(f"threads={T} prefill_threads={T} (every side); greedy, {args.tokens} tokens; {env['cpu']}; "
              f"{env['system_info']}", flush=True)

        def side() -> tuple[float, float]:
            with source.with_optimizer(threads=T, prefill_threads=T) as lease:
                ordinary = lease.generate(PROMPT, max_tokens=args.tokens).tokens_per_second()
            with source.with_batching(1) as lease:
                batched = lease.generate(PROMPT, max_tokens=args.tokens).tokens_per_second()
            return ordinary, batched

        rows: dict[str, list[tuple[float, float]]] = {"freed": [], "kept": []}
        for r in range(1 + args.rounds):
            for name in (("freed", "kept") if r % 2 == 0 else ("kept", "freed")):
                if name == "kept":
                    with teams_kept():
                        got = side()
                else:
                    got = side()
                if r:  # round 0 warms up
                    rows[name].append(got)
    for name, got in rows.items():
        ordinary, batched = [g[0] for g in got], [g[1] for g in got]
        print(f"{name:6} ordinary {spread(ordinary)} tok/s, batched (1 sequence) {spread(batched)} tok/s; batched / "
              f"ordinary: ratio of medians {statistics.median(batched) / statistics.median(ordinary):.2f}, paired median "
              f"{statistics.median(b / o for o, b in got):.2f}")
    freed = statistics.median(g[1] for g in rows["freed"])
    kept = statistics.median(g[1] for g in rows["kept"])
    print(f"batched decode, teams freed / kept: {freed / kept:.2f}x")


if __name__ == "__main__":
    main()
