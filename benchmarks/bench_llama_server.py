"""Reference: llama.cpp's own server on the workloads of ``bench_batching.py``, on this machine.

``bench_batching.py`` compares aner_nb's batching lease with serial serving.
This script puts the same requests (same prompt token ids, same output
budgets, greedy) to a ``llama-server`` binary built from the llama.cpp that
llama-cpp-python vendors, so the two engines' batching gains can be compared
on the same machine and the same day:

- ``serial``: the requests one after another (a client waits for every request ahead);
- ``parallel``: every request at once, one client thread each, ``--parallel N`` slots.

One server per client count (``-np N``, ``-c`` = context, threads as given,
prompt cache off), ABBA rounds after one warm-up of each side. The
shared-prefix workload runs in ``bench_batching.py --workloads shared
--llama-server PATH`` instead (prompt cache on, ``stream_completion``), so
that both engines are measured in one run. Reported:
completed tokens per wall second (median, min, max), the ratio of medians and
the median of per-round ratios, and how many parallel outputs equal the serial ones.

llama-server is not part of the Python package; build it once from the sdist::

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    cmake -S /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/lcpbuild -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build /tmp/lcpbuild --target llama-server -j

``--model`` (default ``smollm2``, as ``bench_batching.py``; ``gemma`` or a GGUF path: see
``_models.py``): the comparison does not depend on the model's attention layout or vocabulary.

Run: ``python benchmarks/bench_llama_server.py --server /tmp/lcpbuild/bin/llama-server [--rounds 3]
[--clients 4] [--workloads uniform mixed]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import SMOLLM2, add_model_option, header, resolve  # noqa: E402
from _workloads import workload  # noqa: E402 - the same requests as the batching benchmark


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    binary: str, model: str, slots: int, context: int, threads: int, *, cache_prompt: bool = False,
    batch: tuple[int, int] | None = None, extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, str]:
    """A llama-server on a free port: ``-np slots``, ``-c context``, ``-t``/``-tb threads``; prompt cache
    off unless ``cache_prompt``; ``batch`` = (``-b``, ``-ub``) when given; ``extra`` flags appended."""
    port = free_port()
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-c", str(context),
           "-t", str(threads), "-tb", str(threads), "--cache-prompt" if cache_prompt else "--no-cache-prompt",
           "--no-webui", "-fa", "auto"]
    if batch is not None:
        cmd += ["-b", str(batch[0]), "-ub", str(batch[1])]
    cmd += list(extra)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama-server did not become healthy in 120 s")


def complete(client: httpx.Client, url: str, tokens: list[int], n_predict: int) -> list[int]:
    body = {"prompt": tokens, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": False,
            "stream": False, "return_tokens": True}
    r = client.post(f"{url}/completion", json=body, timeout=600)
    r.raise_for_status()
    return list(r.json()["tokens"])


def stream_completion(
    client: httpx.Client, url: str, tokens: "list[int] | str", n_predict: int, timings: dict | None = None
) -> tuple[float, list[int]]:
    """One streamed /completion with the prompt cache on: (seconds to the first token, the tokens).

    ``tokens`` is the prompt's ids, or its text (the server tokenizes it).

    ``timings``, when given, receives the server's timings of the request (``cache_n``, ``prompt_n``, ...)."""
    body = {"prompt": tokens, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": True,
            "stream": True, "return_tokens": True}
    t0 = time.perf_counter()
    first, out = None, []
    with client.stream("POST", f"{url}/completion", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            got = event.get("tokens") or []
            if got and first is None:
                first = time.perf_counter() - t0
            out += got
            if event.get("stop"):
                if timings is not None:
                    timings.update(event.get("timings") or {})
                break
    return (time.perf_counter() - t0 if first is None else first), out


def serial_run(url: str, requests) -> tuple[float, list[list[int]]]:
    with httpx.Client() as client:
        t0 = time.perf_counter()
        outs = [complete(client, url, toks, n) for toks, n in requests]
        return time.perf_counter() - t0, outs


def parallel_run(url: str, requests) -> tuple[float, list[list[int]]]:
    outs: list = [None] * len(requests)
    barrier = threading.Barrier(len(requests) + 1)

    def client(i: int) -> None:
        with httpx.Client() as c:
            barrier.wait()
            outs[i] = complete(c, url, *requests[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True, help="path to a llama-server binary")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, nargs="+", default=[4])
    parser.add_argument("--workloads", nargs="+", default=["uniform", "mixed"], choices=["uniform", "mixed"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    add_model_option(parser, SMOLLM2)
    args = parser.parse_args()

    choice = resolve(args.model)
    path = choice.path
    with choice.load(context=args.context) as lease:
        print(header(choice, lease), flush=True)
        tokenized = {(kind, n): [(lease.prompt_tokens(r.prompt), r.max_tokens) for r in workload(kind, n, args.max_tokens)]
                     for kind in args.workloads for n in args.clients}
    for n in args.clients:
        proc, url = start_server(args.server, path, n, args.context, args.threads)
        try:
            for kind in args.workloads:
                requests = tokenized[(kind, n)]
                _, reference = serial_run(url, requests)
                parallel_run(url, requests)
                tput: dict[str, list[float]] = {"serial": [], "parallel": []}
                paired, identical = [], 0
                for r in range(args.rounds):
                    for side in (("serial", "parallel") if r % 2 == 0 else ("parallel", "serial")):
                        wall, outs = serial_run(url, requests) if side == "serial" else parallel_run(url, requests)
                        tput[side].append(sum(len(o) for o in outs) / wall)
                        if side == "parallel":
                            identical += sum(o == ref for o, ref in zip(outs, reference))
                    paired.append(tput["parallel"][-1] / tput["serial"][-1])
                ms, mp = statistics.median(tput["serial"]), statistics.median(tput["parallel"])
                print(f"llama-server {kind}, {n} clients, -np {n}, threads {args.threads}: "
                      f"serial {ms:.1f} tok/s ({min(tput['serial']):.1f}-{max(tput['serial']):.1f}), "
                      f"parallel {mp:.1f} tok/s ({min(tput['parallel']):.1f}-{max(tput['parallel']):.1f}), "
                      f"ratio of medians {mp / ms:.2f}x, per-round median {statistics.median(paired):.2f}x "
                      f"({min(paired):.2f}-{max(paired):.2f}), identical {identical}/{n * args.rounds}", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    from aner_nb.bench import exclusive

    with exclusive("bench_llama_server"):  # one benchmark at a time: two would measure each other
        main()
