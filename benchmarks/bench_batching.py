"""Continuous batching on the demo model: throughput and latency against serial serving.

``--model`` (default ``smollm2``, SmolLM2-135M-Instruct; ``gemma`` or a GGUF path: see
``_models.py``): nothing measured here depends on sliding-window attention or the
vocabulary. The sections of ``RESULTS.md`` measured before the option existed ran on Gemma 3 270M.

Workloads (every request of a run arrives at once, one per client):

- ``uniform``: N clients, short prompts, ``--max-tokens`` (128) output tokens each;
- ``mixed``: N clients, prompt lengths (1x..4x a base prompt) and output budgets
  (1/4..1 of ``--max-tokens``) both varying 4x, uncorrelated.

Two sides, alternated ABBA over ``--rounds`` after one warm-up run of each:

- ``serial``: the same requests served one after another by an ordinary lease
  (a client waits for every request ahead of it);
- ``batched``: ``with_batching(N)``, each client a thread streaming its request.

Both sides run every ``llama_decode`` with the same thread count
(``--threads``, default all CPUs): llama.cpp uses ``n_threads`` for one-token
batches and ``n_threads_batch`` for larger ones, which with the engine
defaults would hand the batched side twice the threads.

Reported per workload and client count: aggregate completed tokens per wall
second (all completion tokens over the time until the last request
completed; median, min, max over rounds and the batched/serial ratio of
medians), per-request first-token latency (arrival to first streamed piece)
and arrival-to-completion latency (median and max over all requests of all
rounds), scheduler steps, and how many batched outputs equal the serial ones
token for token. Each difference is explained with
``aner_nb.bench.divergence``: at the first differing token, the plain-greedy
logit gap between the serial and the batched token, the batched token's rank,
and whether the gap is within twice the logit movement a multi-sequence step
causes (a near tie).

Targets: 4 uniform clients >= 1.75x the serial throughput, 4 mixed clients >= 1.25x.

``shared`` (``--workloads shared``, see :func:`measure_shared`): N clients
share one system prompt of about ``--system-tokens`` (1,500) tokens and
each asks ``--questions`` (2) different short questions one after another
(a closed loop: the next question is sent when the answer has arrived).
Every round uses a new system prompt (a different ledger), so every side
starts each run with nothing cached for it, as when a new application
starts sending its prompt. Sides, rotated ABC/CBA over the rounds after one
warm-up run each:

- ``plain``: ``with_batching(N)`` (every request evaluates the whole prompt);
- ``shared``: ``with_batching(N, prefix_cache_entries=2)``;
- ``server`` (with ``--llama-server PATH``): llama.cpp's server, ``-np N``,
  ``--cache-prompt``, same context per sequence, same ``-t``/``-tb`` threads,
  same ``-b``/``-ub`` batch sizes, streamed ``/completion`` requests carrying
  the same prompt token ids.

Reported: aggregate completion tokens per wall second, the median
first-token latency of all requests (client send to first token), the
plain/shared first-token ratio (target >= 5x) and the shared/server
throughput ratio (target >= 1.2x at 4 and 8 clients), prompt tokens taken
from shared prefixes, and how many outputs equal the plain side's.

Run: ``python benchmarks/bench_batching.py [--rounds 3] [--clients 4 8] [--max-tokens 128]
[--json out.json] [--markdown section.md]``.
Smoke: ``python benchmarks/bench_batching.py --rounds 1 --clients 2 --max-tokens 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass

from _models import SMOLLM2, add_model_option, header, manifest_fields, resolve
from _workloads import TOPICS, Request, shared_workload, workload

from aner_nb import bench

_now = time.perf_counter_ns

@dataclass(frozen=True)
class Outcome:
    """One request of one run: latencies from the common arrival time, and its tokens."""

    first_token_ms: float
    completion_ms: float
    tokens: tuple[int, ...]


def stream_one(lease, req: Request, t0: int) -> Outcome:
    s = lease.stream(req.prompt, max_tokens=req.max_tokens)
    first = None
    for _ in s:
        if first is None:
            first = _now()
    end = _now()
    first = end if first is None else first
    return Outcome((first - t0) / 1e6, (end - t0) / 1e6, s.response.tokens)


def serial_run(lease, requests: list[Request]) -> tuple[float, list[Outcome]]:
    """One request after another; all arrived at t0."""
    t0 = _now()
    outcomes = [stream_one(lease, r, t0) for r in requests]
    return (_now() - t0) / 1e6, outcomes


def batched_run(serving, requests: list[Request]) -> tuple[float, list[Outcome]]:
    """Every client streams its request on its own thread; all arrive at t0."""
    outcomes: list = [None] * len(requests)
    barrier = threading.Barrier(len(requests) + 1)
    t0_box: list[int] = []

    def client(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = stream_one(serving, requests[i], t0_box[0])
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcomes[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    t0_box.append(_now())
    barrier.wait()
    for t in threads:
        t.join()
    wall = (_now() - t0_box[0]) / 1e6
    for o in outcomes:
        if isinstance(o, BaseException):
            raise o
    return wall, outcomes


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def measure(serial, kind: str, clients: int, args) -> dict:
    requests = workload(kind, clients, args.max_tokens)
    serving = serial.with_batching(clients)
    serving_pairing = serving._scheduler.pair_columns
    try:
        _, reference = serial_run(serial, requests)  # warm-up, and the serial outputs
        batched_run(serving, requests)  # warm-up
        steps0 = serving.stats().steps
        tput = {"serial": [], "batched": []}
        first = {"serial": [], "batched": []}
        done = {"serial": [], "batched": []}
        identical, compared, differing = 0, 0, {}
        paired: list[float] = []
        for r in range(args.rounds):
            order = ("serial", "batched") if r % 2 == 0 else ("batched", "serial")
            for side in order:
                wall, outcomes = serial_run(serial, requests) if side == "serial" else batched_run(serving, requests)
                tokens = sum(len(o.tokens) for o in outcomes)
                tput[side].append(tokens * 1000.0 / wall)
                first[side] += [o.first_token_ms for o in outcomes]
                done[side] += [o.completion_ms for o in outcomes]
                if side == "batched":
                    for req, ref, o in zip(requests, reference, outcomes):
                        compared += 1
                        if o.tokens == ref.tokens:
                            identical += 1
                        else:
                            differing.setdefault(req.name, (req, ref.tokens, o.tokens))
            paired.append(tput["batched"][-1] / tput["serial"][-1])  # both sides of one round: same machine state
        stats = serving.stats()
    finally:
        serving.close()
    diagnostics = []
    for name, (req, a, b) in differing.items():
        d = bench.divergence(serial, req.prompt, a, b, shape=bench.BatchShape.sequences(clients))
        diagnostics.append({"request": name, **d.as_dict()})
    result = {
        "workload": kind,
        "clients": clients,
        "requests": [asdict(r) | {"prompt_tokens": len(serial.prompt_tokens(r.prompt))} for r in requests],
        "throughput_tok_s": {side: summarize(v) for side, v in tput.items()},
        "ratio": statistics.median(tput["batched"]) / statistics.median(tput["serial"]),
        "paired_ratio": summarize(paired),
        "first_token_ms": {side: summarize(v) for side, v in first.items()},
        "completion_ms": {side: summarize(v) for side, v in done.items()},
        "identical_outputs": identical,
        "compared_outputs": compared,
        "divergences": diagnostics,
        "scheduler_steps_per_run": (stats.steps - steps0) / max(args.rounds, 1),
        "compactions": stats.compactions,
        "padding_rows": stats.padding_rows,
        "column_pairing": serving_pairing,
    }
    return result


TARGETS = {("uniform", 4): 1.75, ("mixed", 4): 1.25}

SHARED_ENTRIES = 2


def _closed_loop(clients: int, ask) -> tuple[float, list]:
    """Each client thread calls ``ask(client)`` (it returns that client's outcomes); all start together."""
    outcomes: list = [None] * clients
    barrier = threading.Barrier(clients + 1)

    def run(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = ask(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = _now()
    for t in threads:
        t.join()
    wall = (_now() - t0) / 1e9
    for o in outcomes:
        if isinstance(o, BaseException):
            raise o
    return wall, [x for per_client in outcomes for x in per_client]


def _lease_side(lease, conversations, max_tokens: int):
    def ask(i: int) -> list[tuple[float, tuple[int, ...], int]]:
        out = []
        for messages in conversations[i]:
            t0 = _now()
            s = lease.stream(messages, max_tokens=max_tokens)
            first = None
            for _ in s:
                if first is None:
                    first = _now()
            end = _now()
            r = s.response
            out.append((((first or end) - t0) / 1e6, r.tokens, r.timings.cached_input_tokens))
        return out

    return _closed_loop(len(conversations), ask)


def _server_side(url: str, tokenized, max_tokens: int):
    import httpx
    from bench_llama_server import stream_completion

    def ask(i: int) -> list[tuple[float, tuple[int, ...], int]]:
        with httpx.Client() as client:
            out = []
            for tokens in tokenized[i]:
                ttft, got = stream_completion(client, url, tokens, max_tokens)
                out.append((ttft * 1000.0, tuple(got), -1))
            return out

    return _closed_loop(len(tokenized), ask)


def measure_shared(serial, clients: int, args) -> dict:
    """The shared-prefix workload at ``clients`` (see the module docstring)."""
    sides = ["plain", "shared"] + (["server"] if args.llama_server else [])
    plain = serial.with_batching(clients)
    shared = serial.with_batching(clients, prefix_cache_entries=SHARED_ENTRIES)
    proc = url = None
    if args.llama_server:
        from bench_llama_server import start_server

        # Same cells per sequence as the leases (context // clients each), threads and batch sizes.
        proc, url = start_server(args.llama_server, serial.path, clients, plain.sequence_context * clients,
                                 args.threads, cache_prompt=True, batch=(args.batch_tokens, args.batch_tokens))
    tput = {s: [] for s in sides}
    first = {s: [] for s in sides}
    cached = {s: [] for s in sides}
    identical = {s: 0 for s in sides}
    compared = 0
    paired_tput, paired_first = [], []

    def run(side: str, seed: int):
        conversations = shared_workload(serial, clients, args.questions, args.system_tokens, seed)
        if side == "server":
            tokenized = [[serial.prompt_tokens(m) for m in per_client] for per_client in conversations]
            return _server_side(url, tokenized, args.max_tokens)
        return _lease_side(plain if side == "plain" else shared, conversations, args.max_tokens)

    try:
        for side in sides:  # warm-up, its own system prompt
            run(side, seed=7)
        for r in range(args.rounds):
            seed = 1000 + r  # a new system prompt each round: nothing cached for it on any side
            order = sides if r % 2 == 0 else list(reversed(sides))
            outs = {}
            for side in order:
                wall, outcomes = run(side, seed)
                outs[side] = outcomes
                tput[side].append(sum(len(o[1]) for o in outcomes) / wall)
                first[side] += [o[0] for o in outcomes]
                cached[side] += [o[2] for o in outcomes]
            for side in sides:
                identical[side] += sum(a[1] == b[1] for a, b in zip(outs["plain"], outs[side]))
            compared += len(outs["plain"])
            round_first = {s: statistics.median(o[0] for o in outs[s]) for s in sides}
            paired_first.append(round_first["plain"] / round_first["shared"])
            if "server" in sides:
                paired_tput.append(tput["shared"][-1] / tput["server"][-1])
        stats = shared.stats()
    finally:
        plain.close()
        shared.close()
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    med_first = {s: statistics.median(v) for s, v in first.items()}
    med_tput = {s: statistics.median(v) for s, v in tput.items()}
    return {
        "workload": "shared",
        "clients": clients,
        "questions_per_client": args.questions,
        "system_tokens": len(serial.prompt_tokens(shared_workload(serial, 1, 1, args.system_tokens, 1000)[0][0]))
        - len(serial.prompt_tokens([{"role": "user", "content": TOPICS[0]}])),
        "throughput_tok_s": {s: summarize(v) for s, v in tput.items()},
        "first_token_ms": {s: summarize(v) for s, v in first.items()},
        "first_token_ratio_plain_over_shared": med_first["plain"] / med_first["shared"],
        "paired_first_token_ratio": summarize(paired_first),
        "throughput_ratio_shared_over_server": (med_tput["shared"] / med_tput["server"]) if "server" in sides else None,
        "paired_throughput_ratio": summarize(paired_tput) if paired_tput else None,
        "cached_input_tokens_shared": summarize(cached["shared"]),
        "identical_to_plain": identical,
        "compared_outputs": compared,
        "prefix_cache": {"hits": stats.prefix_cache_hits, "reused_tokens": stats.prefix_cache_reused_tokens,
                         "waits": stats.prefix_cache_waits, "entries": stats.prefix_cache_entries},
    }


def report_shared(result: dict) -> str:
    n, t, f = result["clients"], result["throughput_tok_s"], result["first_token_ms"]
    lines = [f"shared prefix, {n} clients x {result['questions_per_client']} questions, system prompt "
             f"~{result['system_tokens']} tokens"]
    for side in t:
        lines.append(f"  {side:<7} {t[side]['median']:8.1f} tok/s (min {t[side]['min']:.1f}, max {t[side]['max']:.1f})  "
                     f"first token median {f[side]['median']:8.1f} ms (min {f[side]['min']:.1f}, max {f[side]['max']:.1f})  "
                     f"outputs equal to plain {result['identical_to_plain'][side]}/{result['compared_outputs']}")
    p = result["paired_first_token_ratio"]
    lines.append(f"  first token plain/shared: {result['first_token_ratio_plain_over_shared']:.2f}x (target >= 5x); "
                 f"per-round {p['median']:.2f}x ({p['min']:.2f}-{p['max']:.2f})")
    if result["throughput_ratio_shared_over_server"] is not None:
        q = result["paired_throughput_ratio"]
        lines.append(f"  throughput shared/server: {result['throughput_ratio_shared_over_server']:.2f}x (target >= 1.2x); "
                     f"per-round {q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f})")
    c = result["cached_input_tokens_shared"]
    lines.append(f"  shared side: cached input tokens per request median {c['median']:.0f} (min {c['min']:.0f}); "
                 f"scheduler {result['prefix_cache']}")
    return "\n".join(lines)


def report(result: dict) -> str:
    kind, n = result["workload"], result["clients"]
    lines = [f"{kind}, {n} clients ({len(result['requests'])} requests per run, "
             f"{sum(r['max_tokens'] for r in result['requests'])} output tokens max)"]
    for side in ("serial", "batched"):
        t, f, c = result["throughput_tok_s"][side], result["first_token_ms"][side], result["completion_ms"][side]
        lines.append(
            f"  {side:<8} {t['median']:8.1f} tok/s (min {t['min']:.1f}, max {t['max']:.1f}, n={t['n']})  "
            f"first token median {f['median']:8.1f} ms max {f['max']:8.1f}  "
            f"completion median {c['median']:8.1f} ms max {c['max']:8.1f}"
        )
    target = TARGETS.get((kind, n))
    verdict = "" if target is None else f" (target >= {target:.2f}x: {'met' if result['ratio'] >= target else 'NOT met'})"
    p = result["paired_ratio"]
    lines.append(f"  throughput batched/serial (medians): {result['ratio']:.2f}x{verdict}; per-round ratios "
                 f"median {p['median']:.2f}x (min {p['min']:.2f}, max {p['max']:.2f})")
    lines.append(
        f"  identical outputs: {result['identical_outputs']}/{result['compared_outputs']}; "
        f"scheduler steps per run {result['scheduler_steps_per_run']:.0f}; compactions {result['compactions']}; "
        f"padding rows {result['padding_rows']} (column pairing {result['column_pairing']})"
    )
    for d in result["divergences"]:
        lines.append(
            f"    {d['request']}: first difference at token {d['position']} "
            f"(serial {d['token_a']}, batched {d['token_b']} ranked {d['rank_b']}), "
            f"logit gap {d['gap']:.4g}, {d['shape']} perturbation {d['perturbation']:.3g}, near tie: {d['near_tie']}"
        )
    return "\n".join(lines)


def markdown(results: list[dict], manifest: dict) -> str:
    m = manifest.get("model", {})
    out = [
        "## Continuous batching (`benchmarks/bench_batching.py`)",
        "",
        f"Model {m.get('name')} (sha256 {str(m.get('fingerprint'))[:12]}), device {m.get('device')}, "
        f"context {m.get('context')}, threads {manifest.get('threads')} on both sides, "
        f"{manifest.get('rounds')} rounds ABBA after one warm-up, measured {manifest.get('date')}.",
        "",
        "| workload | clients | serial tok/s (min-max) | batched tok/s (min-max) | ratio of medians | per-round ratio "
        "median (min-max) | target | first token ms serial / batched (median, max) "
        "| completion ms serial / batched (median, max) | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["workload"] == "shared":
            continue  # reported in its own table below
        t, f, c = r["throughput_tok_s"], r["first_token_ms"], r["completion_ms"]
        target = TARGETS.get((r["workload"], r["clients"]))
        out.append(
            f"| {r['workload']} | {r['clients']} | {t['serial']['median']:.1f} ({t['serial']['min']:.1f}-{t['serial']['max']:.1f}) "
            f"| {t['batched']['median']:.1f} ({t['batched']['min']:.1f}-{t['batched']['max']:.1f}) "
            f"| {r['ratio']:.2f}x | {r['paired_ratio']['median']:.2f}x ({r['paired_ratio']['min']:.2f}-{r['paired_ratio']['max']:.2f}) "
            f"| {'-' if target is None else f'>= {target:.2f}x'} "
            f"| {f['serial']['median']:.0f}, {f['serial']['max']:.0f} / {f['batched']['median']:.0f}, {f['batched']['max']:.0f} "
            f"| {c['serial']['median']:.0f}, {c['serial']['max']:.0f} / {c['batched']['median']:.0f}, {c['batched']['max']:.0f} "
            f"| {r['identical_outputs']}/{r['compared_outputs']} |"
        )
    shared = [r for r in results if r["workload"] == "shared"]
    if shared:
        out += [
            "",
            "| clients x questions | side | tok/s median (min-max) | first token ms median (min-max) | equal to plain |",
            "|---|---|---|---|---|",
        ]
        for r in shared:
            for side, t in r["throughput_tok_s"].items():
                f = r["first_token_ms"][side]
                out.append(f"| {r['clients']} x {r['questions_per_client']} | {side} | {t['median']:.1f} "
                           f"({t['min']:.1f}-{t['max']:.1f}) | {f['median']:.0f} ({f['min']:.0f}-{f['max']:.0f}) "
                           f"| {r['identical_to_plain'][side]}/{r['compared_outputs']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--workloads", nargs="+", default=["uniform", "mixed"], choices=["uniform", "mixed", "shared"])
    parser.add_argument("--questions", type=int, default=2, help="shared: questions each client asks in turn")
    parser.add_argument("--system-tokens", type=int, default=1500, help="shared: system prompt length")
    parser.add_argument("--batch-tokens", type=int, default=512,
                        help="batch and micro-batch tokens of every side (llama-server -b/-ub too)")
    parser.add_argument("--llama-server", default=None, help="shared: also measure this llama-server binary")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--flash-attention", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None, help="write a RESULTS.md section to this file")
    add_model_option(parser, SMOLLM2)
    args = parser.parse_args()

    choice = resolve(args.model)
    base = choice.load(context=args.context, flash_attention=args.flash_attention)
    print(header(choice, base), flush=True)
    serial = base.with_optimizer(threads=args.threads, prefill_threads=args.threads,
                                 batch_tokens=args.batch_tokens, micro_batch_tokens=args.batch_tokens)
    manifest = bench.manifest(serial, threads=args.threads, rounds=args.rounds, max_tokens=args.max_tokens,
                              flash_attention=args.flash_attention, batch_tokens=args.batch_tokens,
                              **manifest_fields(choice, base))
    results = []
    for kind in args.workloads:
        for clients in args.clients:
            if kind == "shared":
                result = measure_shared(serial, clients, args)
                print(report_shared(result), flush=True)
            else:
                result = measure(serial, kind, clients, args)
                print(report(result), flush=True)
            results.append(result)
    serial.close()
    base.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"manifest": manifest, "results": results}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results, manifest))


if __name__ == "__main__":
    from aner_nb.bench import exclusive

    with exclusive("bench_batching"):  # one benchmark at a time: two would measure each other
        main()
