"""Prompt lookup inside continuous batching: aggregate throughput with and without it, and one client alone.

Workloads, every request of a run arriving at once (one thread per client, greedy, ``--max-tokens``):

- ``copy``: N clients, each quoting its own ledger (``_workloads.evidence`` with another seed);
- ``open``: N clients, each writing on its own topic (``_workloads.TOPICS``);
- ``mixed``: half the clients copy, half write.

Sides, alternated ABBA over ``--rounds`` after one warm-up round: ``batched``
(``with_batching(N)``) and ``batched+lookup`` (``with_batching(N, speculative_tokens=K)``);
reported: aggregate completion tokens per wall second until the last request completes,
and whether every output equals the plain batched one (else the first divergence is judged
with ``aner_nb.bench.divergence``). ``--alone``: one copy request on the N-sequence lease with
and without lookup, against the latency profile (``with_optimizer(speculative_tokens=K)``) and
an ordinary lease: the batching lease should keep at least 90% of the latency profile's speedup.

Every side runs with ``n_threads = n_threads_batch = --threads``; a fresh lease per round and
side, so no side's corpus sees an earlier round of the same prompts.

Run: ``python benchmarks/bench_batch_lookup.py [--model gemma|smollm2|PATH] [--clients 4]
[--speculative-tokens 16] [--rounds 3] [--alone]``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from _models import GEMMA, add_model_option, header, manifest_fields, resolve
from _workloads import TOPICS, evidence
from bench_lookup import spread

from aner_nb import bench


def copy_prompt(seed: int) -> str:
    return ("Quote the ledger below line by line, keeping every name, place and sum, then summarize it "
            f"using its original names and terms.\n\n{evidence(8, seed=seed)}")


def workload(kind: str, clients: int) -> list[str]:
    copies = [copy_prompt(1888 + i) for i in range(clients)]
    opens = [f"Write a few paragraphs answering: {TOPICS[i % len(TOPICS)]}" for i in range(clients)]
    if kind == "copy":
        return copies
    if kind == "open":
        return opens
    return [copies[i] if i % 2 == 0 else opens[i] for i in range(clients)]


def run_concurrently(lease, prompts: list[str], max_tokens: int) -> tuple[float, list]:
    out: list = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        barrier.wait()
        out[i] = lease.generate(prompts[i], max_tokens=max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser, GEMMA)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--speculative-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--workloads", nargs="+", default=["copy", "open", "mixed"])
    parser.add_argument("--alone", action="store_true", help="also measure one client alone")
    args = parser.parse_args()
    with bench.exclusive("bench_batch_lookup"):
        run(args)


def run(args: argparse.Namespace) -> None:
    choice = resolve(args.model)
    T, K, N = args.threads, args.speculative_tokens, args.clients
    base = choice.load(context=args.context, flash_attention="off")
    print(header(choice, base), flush=True)
    env = bench.manifest(base, benchmark="batch_lookup", **manifest_fields(choice, base))
    print(f"threads={T} prefill_threads={T} (every side); {N} sequences, context {args.context}; speculative_tokens={K}; "
          f"greedy, {args.max_tokens} tokens")
    print(f"{env['cpu']}; {env['system_info']}", flush=True)
    source = base.with_optimizer(threads=T, prefill_threads=T)
    judge = source

    def batched(k: int):
        return source.with_batching(N, speculative_tokens=k)

    for kind in args.workloads:
        prompts = workload(kind, N)
        sides = {"batched": 0, "batched+lookup": K}
        rates: dict[str, list[float]] = {n: [] for n in sides}
        outputs: dict[str, list] = {}
        accepted = proposed = 0
        for r in range(1 + args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
                with batched(sides[name]) as lease:
                    wall, responses = run_concurrently(lease, prompts, args.max_tokens)
                if r:
                    rates[name].append(sum(len(x.tokens) for x in responses) / wall)
                    outputs.setdefault(name, [x.tokens for x in responses])
                    if sides[name]:
                        accepted += sum(max(x.timings.speculative_accepted_tokens, 0) for x in responses)
                        proposed += sum(max(x.timings.speculative_proposed_tokens, 0) for x in responses)
        ratio = statistics.median(rates["batched+lookup"]) / statistics.median(rates["batched"])
        print(f"\n== {kind}, {N} clients ==")
        for name in sides:
            print(f"{name:16} aggregate tok/s {spread(rates[name])}")
        print(f"batched+lookup / batched: {ratio:.2f}x   accepted {accepted}/{proposed}")
        for i, (a, b) in enumerate(zip(outputs["batched"], outputs["batched+lookup"])):
            if a != b:
                d = bench.divergence(judge, prompts[i], a, b, shape=bench.BatchShape.verification(K))
                print(f"  client {i}: differs at {d.position}: gap {d.gap:.3f}, movement {d.perturbation:.3f}, "
                      f"later {d.later_position}, near tie {d.near_tie}")
        print(f"outputs equal: {sum(a == b for a, b in zip(outputs['batched'], outputs['batched+lookup']))}/{N}")

    if args.alone:
        prompt = [copy_prompt(1888)]
        leases = {
            "ordinary": lambda: source.with_optimizer(threads=T, prefill_threads=T),
            "latency+lookup": lambda: source.with_optimizer(threads=T, prefill_threads=T, speculative_tokens=K),
            "batched": lambda: batched(0),
            "batched+lookup": lambda: batched(K),
        }
        speed: dict[str, list[float]] = {n: [] for n in leases}
        for r in range(1 + args.rounds):
            for name in (list(leases) if r % 2 == 0 else list(reversed(leases))):
                with leases[name]() as lease:
                    response = lease.generate(prompt[0], max_tokens=args.max_tokens)
                if r:
                    speed[name].append(response.tokens_per_second())
        med = {n: statistics.median(v) for n, v in speed.items()}
        print(f"\n== one copy client alone on a {N}-sequence lease (decode tok/s) ==")
        for name in leases:
            print(f"{name:16} {spread(speed[name])}")
        latency_gain = med["latency+lookup"] / med["ordinary"]
        batch_gain = med["batched+lookup"] / med["batched"]
        kept = (batch_gain - 1) / (latency_gain - 1) if latency_gain > 1 else float("nan")
        print(f"latency speedup {latency_gain:.2f}x, batching speedup {batch_gain:.2f}x: ratio {batch_gain / latency_gain:.2f}, "
              f"{kept:.0%} of the latency gain (speedup - 1) kept")
    source.close()
    base.close()


if __name__ == "__main__":
    main()
