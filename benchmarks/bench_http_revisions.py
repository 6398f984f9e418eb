"""Two revisions of the HTTP service side by side: streaming throughput of C concurrent clients on each.

One ``aner-nb serve`` process per revision, both started from this
interpreter's environment (same venv, so the same llama.cpp build) with
the revision's checkout (``git worktree add DIR REV``) as working directory
and first on ``PYTHONPATH``, so ``python -m aner_nb`` imports its package,
the same model, context, ``--threads`` (one-row and batched steps alike) and
``--max-sequences``. Both stay up for the whole run, so rounds alternate
without restarts; the idle one waits on its scheduler's condition variable.

After one warm-up run on each, ``--rounds`` rounds alternate ABBA (A B, B A,
A B, ...). A run is ``bench_http.run_side``: C clients (threads, one HTTP
connection each) sending ``--requests`` streaming ``/v1/chat/completions``
each (greedy, ``--max-tokens``, usage chunk asked for), back to back.
Reported: completion tokens per wall second per revision (median, min, max),
the ratio of medians B/A and the per-round paired ratios (each B run over the
A run of the same round), request and first-token latency percentiles, and
the server's CPU time (all threads, from ``/proc``) per completion token,
which a loaded machine disturbs less than wall time.

Run (from the repository root; the old revision checked out beside it)::

    git worktree add /tmp/old_rev 98ed7e9
    python benchmarks/bench_http_revisions.py --a /tmp/old_rev --b . [--model PATH] [--clients 4]
        [--rounds 8] [--requests 2] [--max-tokens 64] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
from pathlib import Path

import bench_http

from aner_nb import bench


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cpu_flags() -> list[str]:
    """The CPU's vector extensions as the kernel reports them (the build's own list is in the manifest)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "sse4", "fma", "f16c", "amx")))


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) the process has used so far; NaN where /proc is missing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def revision_env(checkout: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(checkout).resolve()), *filter(None, [env.get("PYTHONPATH")])])
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="checkout of the baseline revision (its aner_nb is served)")
    parser.add_argument("--b", required=True, help="checkout of the revision under test")
    parser.add_argument("--model", default=None, help="GGUF to serve (default: the demo model, SmolLM2-135M-Instruct)")
    parser.add_argument("--chat-template", default=None)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="requests per client per run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=0, help="server context (default: 512 cells per sequence)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.model is None:
        from aner_nb.demo_model import demo_model_path

        args.model = str(demo_model_path())
    args.context = args.context or 512 * args.clients

    sides = {"A": args.a, "B": args.b}
    servers = {}
    try:
        for name, checkout in sides.items():
            servers[name] = bench_http.start_server(args, args.clients, env=revision_env(checkout),
                                                    cwd=str(Path(checkout).resolve()))
        manifest = bench.manifest(
            None, model_path=args.model, model_sha256=sha256_of(args.model), revisions=sides,
            cpu_flags=cpu_flags(), threads=args.threads, context=args.context, max_sequences=args.clients,
            clients=args.clients, rounds=args.rounds, requests_per_client=args.requests, max_tokens=args.max_tokens,
        )
        print(json.dumps({k: manifest[k] for k in ("date", "cpu", "cpu_count_logical", "system_info", "cpu_flags",
                                                   "load_average", "model_path", "model_sha256", "threads", "context",
                                                   "revisions")}, indent=1), flush=True)

        def run(name: str) -> tuple[float, list, float]:
            proc, url = servers[name]
            cpu0 = cpu_seconds(proc.pid)
            wall, got = bench_http.run_side(url, args.clients, args.requests, args.max_tokens)
            return wall, got, cpu_seconds(proc.pid) - cpu0

        for name in sides:  # warm-up, not recorded
            run(name)
        rates: dict[str, list[float]] = {name: [] for name in sides}
        cpu_ms: dict[str, list[float]] = {name: [] for name in sides}  # server CPU per completion token
        outcomes: dict[str, list] = {name: [] for name in sides}
        for r in range(args.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                wall, got, cpu = run(name)
                tokens = sum(o.tokens for o in got)
                rates[name].append(tokens / wall)
                cpu_ms[name].append(cpu * 1e3 / tokens)
                outcomes[name].extend(got)
                print(f"round {r} {name}: {rates[name][-1]:.1f} tok/s, server CPU {cpu_ms[name][-1]:.2f} ms/token",
                      flush=True)
        load_after = bench.manifest(None)["load_average"]
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    paired = [b / a for a, b in zip(rates["A"], rates["B"])]
    result = {"manifest": manifest, "load_average_after": load_after, "rates": rates, "cpu_ms_per_token": cpu_ms,
              "paired_ratios": paired,
              "ratio_of_medians": statistics.median(rates["B"]) / statistics.median(rates["A"]),
              "median_paired_ratio": statistics.median(paired)}
    for name in sides:
        os_ = outcomes[name]
        result[name] = {
            "tokens_per_s": {"median": statistics.median(rates[name]), "min": min(rates[name]),
                             "max": max(rates[name])},
            "latency_ms": bench_http.percentiles([o.latency_ms for o in os_]),
            "first_token_ms": bench_http.percentiles([o.first_token_ms for o in os_]),
            "peak_sequences": max(o.peak_sequences for o in os_),
            "cpu_ms_per_token": {"median": statistics.median(cpu_ms[name]), "min": min(cpu_ms[name]),
                                 "max": max(cpu_ms[name])},
        }
        tps, lat, ftl = result[name]["tokens_per_s"], result[name]["latency_ms"], result[name]["first_token_ms"]
        print(f"{name} ({sides[name]}): {tps['median']:.1f} tok/s (min {tps['min']:.1f}, max {tps['max']:.1f}); "
              f"latency p50 {lat['p50']:.0f} p90 {lat['p90']:.0f} ms; first token p50 {ftl['p50']:.0f} "
              f"p90 {ftl['p90']:.0f} ms; peak sequences {result[name]['peak_sequences']}; server CPU "
              f"{result[name]['cpu_ms_per_token']['median']:.2f} ms/token (min "
              f"{result[name]['cpu_ms_per_token']['min']:.2f}, max {result[name]['cpu_ms_per_token']['max']:.2f})")
    print(f"B/A: ratio of medians {result['ratio_of_medians']:.3f}; paired ratios "
          f"{', '.join(f'{p:.3f}' for p in paired)} (median {result['median_paired_ratio']:.3f}, "
          f"min {min(paired):.3f}, max {max(paired):.3f}); load average before {manifest['load_average']}, "
          f"after {load_after}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    from aner_nb.bench import exclusive

    with exclusive("bench_http_revisions"):  # one benchmark at a time: two would measure each other
        main()
