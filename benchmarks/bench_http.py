"""The HTTP service under concurrent clients: continuous batching over HTTP vs one request at a time.

One ``aner-nb serve`` process (a batching lease with ``max(--clients)``
sequences) is started on a loopback port; the clients run in this process,
so client work never competes with the server for its interpreter lock.
Every request is an OpenAI-style streaming ``POST /v1/chat/completions``
(greedy, ``--max-tokens`` output tokens), so each one yields a first-token
latency and a completion latency.

For each client count C in ``--clients`` (default 4 and 8), the same C x
``--requests`` requests run on two sides, alternated ABBA over ``--rounds``
after one warm-up of each:

- ``one-at-a-time``: one client sends them back to back;
- ``concurrent``: C clients (threads, one HTTP connection each) send
  ``--requests`` each, back to back (a closed loop).

Reported per client count and side: aggregate completion tokens per wall
second (median, min, max over rounds; concurrent/one-at-a-time ratio of
medians), request latency and first-token latency percentiles (p50, p90,
p99, max over every request of every round), and the most sequences any
request shared a scheduler step with (``batch_peak_sequences`` from the
final usage chunk's timings; every request asks for that chunk with
``stream_options: {"include_usage": true}``, and a stream without it fails
the run instead of counting 0 tokens).

``--model`` (default ``smollm2``, SmolLM2-135M-Instruct; ``gemma`` or a GGUF path: see
``_models.py``): nothing measured here depends on sliding-window attention or the vocabulary.
The sections of ``RESULTS.md`` measured before the option existed ran on Gemma 3 270M.

Run (as for ``benchmarks/RESULTS.md``):
``python benchmarks/bench_http.py [--rounds 3] [--clients 4 8] [--requests 4] [--max-tokens 128]
[--json out.json] [--markdown section.md]``.
Smoke (tiny settings, any GGUF with a chat template):
``python benchmarks/bench_http.py --model tiny.gguf --rounds 1 --clients 2 --requests 2 --max-tokens 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from _models import SMOLLM2, add_model_option, header, manifest_fields, resolve
from _workloads import TOPICS

from aner_nb import bench

PROMPTS = TOPICS  # the serving benchmarks' questions (_workloads.py), cycled over clients and requests


@dataclass(frozen=True)
class Outcome:
    """One request: latencies from its own send, its completion tokens and its batch peak."""

    first_token_ms: float
    latency_ms: float
    tokens: int
    peak_sequences: int


def one_request(client: httpx.Client, prompt: str, max_tokens: int) -> Outcome:
    # OpenAI streaming sends the usage (and this service its timings) only in a last chunk asked for
    # with stream_options.include_usage; without it there is nothing to count tokens or peaks from.
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    usage: dict = {}
    timings: dict = {}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("choices"):
                if first is None and event["choices"][0]["delta"].get("content"):
                    first = time.perf_counter()
            elif "usage" in event:
                usage, timings = event["usage"], event.get("timings", {})
    t1 = time.perf_counter()
    if "completion_tokens" not in usage or "batch_peak_sequences" not in timings:
        # A missing usage chunk would otherwise be recorded as 0 tokens and peak -1.
        raise RuntimeError(f"the stream ended without a usage chunk with timings (usage={usage}, timings={timings})")
    return Outcome(
        first_token_ms=((first or t1) - t0) * 1e3,
        latency_ms=(t1 - t0) * 1e3,
        tokens=int(usage["completion_tokens"]),
        peak_sequences=int(timings["batch_peak_sequences"]),
    )


def run_side(url: str, clients: int, per_client: int, max_tokens: int) -> tuple[float, list[Outcome]]:
    """Wall seconds and outcomes of ``clients`` closed-loop clients sending ``per_client`` requests each."""
    outcomes: list[Outcome] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def worker(index: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as client:
            barrier.wait()
            for j in range(per_client):
                prompt = PROMPTS[(index * per_client + j) % len(PROMPTS)]
                try:
                    outcome = one_request(client, prompt, max_tokens)
                except BaseException as exc:  # noqa: BLE001 - reported after the run
                    with lock:
                        errors.append(exc)
                    return
                with lock:
                    outcomes.append(outcome)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed; first: {errors[0]}")
    return wall, outcomes


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pct(p: float) -> float:
        if not ordered:
            return float("nan")
        k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
        return ordered[k]

    return {"p50": pct(50), "p90": pct(90), "p99": pct(99), "max": ordered[-1] if ordered else float("nan")}


def measure(url: str, clients: int, args: argparse.Namespace) -> dict:
    total = clients * args.requests
    sides = {
        "one-at-a-time": lambda: run_side(url, 1, total, args.max_tokens),
        "concurrent": lambda: run_side(url, clients, args.requests, args.max_tokens),
    }
    for run in sides.values():  # warm-up, not recorded
        run()
    rates: dict[str, list[float]] = {name: [] for name in sides}
    outcomes: dict[str, list[Outcome]] = {name: [] for name in sides}
    for r in range(args.rounds):  # AB, BA, AB, ...: each side once per round, ABBA across rounds
        for name in ("one-at-a-time", "concurrent") if r % 2 == 0 else ("concurrent", "one-at-a-time"):
            wall, got = sides[name]()
            rates[name].append(sum(o.tokens for o in got) / wall)
            outcomes[name].extend(got)
    result = {"clients": clients, "requests": total, "max_tokens": args.max_tokens, "sides": {}}
    for name in sides:
        rs, os_ = rates[name], outcomes[name]
        result["sides"][name] = {
            "tokens_per_s": {"median": statistics.median(rs), "min": min(rs), "max": max(rs)},
            "latency_ms": percentiles([o.latency_ms for o in os_]),
            "first_token_ms": percentiles([o.first_token_ms for o in os_]),
            "peak_sequences": max(o.peak_sequences for o in os_),
            "completion_tokens": sum(o.tokens for o in os_),
        }
    one = result["sides"]["one-at-a-time"]["tokens_per_s"]["median"]
    result["ratio"] = result["sides"]["concurrent"]["tokens_per_s"]["median"] / one if one else float("nan")
    return result


def report(result: dict) -> str:
    lines = [f"{result['clients']} clients, {result['requests']} requests x {result['max_tokens']} tokens "
             f"(concurrent / one-at-a-time throughput: {result['ratio']:.2f}x)"]
    for name, side in result["sides"].items():
        tps, lat, ftl = side["tokens_per_s"], side["latency_ms"], side["first_token_ms"]
        lines.append(
            f"  {name:>14}: {tps['median']:8.1f} tok/s (min {tps['min']:.1f}, max {tps['max']:.1f}); "
            f"latency p50 {lat['p50']:.0f} p90 {lat['p90']:.0f} p99 {lat['p99']:.0f} max {lat['max']:.0f} ms; "
            f"first token p50 {ftl['p50']:.0f} p90 {ftl['p90']:.0f} ms; peak sequences {side['peak_sequences']}"
        )
    return "\n".join(lines)


def markdown(results: list[dict], manifest: dict) -> str:
    model = manifest.get("served_model", {})
    out = [
        "## HTTP service: concurrent clients vs one at a time (`benchmarks/bench_http.py`)",
        "",
        f"Model `{model.get('id', '?')}` ({model.get('system_fingerprint', '?')}), server "
        f"`aner-nb serve --max-sequences {manifest['max_sequences']} --context {manifest['context']}"
        f"{' --threads ' + str(manifest['threads']) if manifest.get('threads') else ''}`, "
        f"{manifest['rounds']} round(s) (ABBA), {manifest['max_tokens']} greedy tokens per request, streaming "
        f"`/v1/chat/completions` over loopback; {manifest['date']}.",
        "",
        "| clients | side | tok/s median (min-max) | ratio | latency p50 / p90 / p99 ms | first token p50 / p90 ms "
        "| peak seqs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, side in r["sides"].items():
            tps, lat, ftl = side["tokens_per_s"], side["latency_ms"], side["first_token_ms"]
            ratio = f"{r['ratio']:.2f}x" if name == "concurrent" else ""
            out.append(
                f"| {r['clients']} | {name} | {tps['median']:.1f} ({tps['min']:.1f}-{tps['max']:.1f}) | {ratio} | "
                f"{lat['p50']:.0f} / {lat['p90']:.0f} / {lat['p99']:.0f} | {ftl['p50']:.0f} / {ftl['p90']:.0f} | "
                f"{side['peak_sequences']} |"
            )
    return "\n".join(out) + "\n"


def start_server(args: argparse.Namespace, max_sequences: int, *, stderr: Any = None,
                 env: dict[str, str] | None = None, cwd: str | None = None) -> tuple[subprocess.Popen, str]:
    """``aner-nb serve args.model`` on a free port (``args``: context, max_tokens, threads, chat_template);
    returns the process and its URL once it accepts connections. Also used by ``soak.py`` and
    ``bench_http_revisions.py`` (which serves another revision's package: ``python -m`` imports it from
    ``cwd``, and ``env`` puts it first on ``PYTHONPATH`` too)."""
    command = [sys.executable, "-m", "aner_nb", "serve", str(args.model), "--host", "127.0.0.1", "--port", "0",
               "--max-sequences", str(max_sequences), "--context", str(args.context),
               "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
    if getattr(args, "chat_template", None):
        command += ["--chat-template", args.chat_template]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=cwd)
    line = proc.stdout.readline() if proc.stdout else ""
    match = re.search(r" at (http://\S+)", line)
    if not match:
        proc.kill()
        proc.wait(timeout=30)
        raise SystemExit(f"the server did not start: {line!r}")
    # Drain the rest of stdout so a chatty server never blocks on a full pipe.
    threading.Thread(target=lambda: proc.stdout and proc.stdout.read(), daemon=True).start()
    return proc, match.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser, SMOLLM2)
    parser.add_argument("--chat-template", default=None, help="for a GGUF path (smollm2: embedded; gemma: gemma)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--requests", type=int, default=4, help="requests per client per run (default 4)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=0,
                        help="server context (default: 512 cells per sequence)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="engine threads for one-row and batched steps alike (default: all CPUs but one, "
                        "which the event loop and the clients need; llama.cpp's threads spin while waiting)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None, help="write a RESULTS.md section to this file")
    args = parser.parse_args()
    choice = resolve(args.model, args.chat_template)
    args.model, args.chat_template = choice.path, choice.chat_template
    max_sequences = max(args.clients)
    args.context = args.context or 512 * max_sequences

    proc, url = start_server(args, max_sequences)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            model = client.get("/v1/models").json()["data"][0]
            probe = client.post("/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).json()
        print(header(choice, fingerprint=probe.get("system_fingerprint")), flush=True)
        manifest = bench.manifest(
            None, served_model={"id": model["id"], "system_fingerprint": probe.get("system_fingerprint")},
            server=url, max_sequences=max_sequences, context=args.context, threads=args.threads,
            rounds=args.rounds, requests_per_client=args.requests, max_tokens=args.max_tokens,
            **manifest_fields(choice),
        )
        results = []
        for clients in args.clients:
            result = measure(url, clients, args)
            results.append(result)
            print(report(result), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"manifest": manifest, "results": results}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results, manifest))


if __name__ == "__main__":
    from aner_nb.bench import exclusive

    with exclusive("bench_http"):  # one benchmark at a time: two would measure each other
        main()
