"""Prompt-lookup speculation against plain decoding and against llama.cpp's server's n-gram speculators.

Six workloads (``_workloads.speculation_tasks``): copy-heavy (quote a ledger),
code edit (rename a variable in a function), summary with quotes, a two-pass
edit (the measured request repeats most of an earlier request's answer),
open-ended writing and counting (the adversarial case: ", " repeats, the
digits after it never do). Greedy, ``--max-tokens`` tokens, the same prompt
token ids on every side. Sides:

- ``off``: plain greedy decoding, ``with_optimizer(threads=T, prefill_threads=T)``;
- ``on-K``: the same with ``speculative_tokens=K`` for each ``--speculative-tokens`` K (the
  draft policy chooses each step's length from the lease's measured row costs, up to K);
- ``on-K/prompt-only`` (two-pass only): the same without the earlier request, so its lookup
  sees the measured prompt alone; ``on-K`` runs the earlier request first on the same lease,
  whose corpus then holds its answer;
- with ``--llama-server BIN``: ``server`` (plain) and ``server:TYPE:K`` for each ``--server-spec``
  (``--spec-type TYPE --spec-draft-n-max K --spec-ngram-mod-n-max K``; ``K`` = ``default``
  keeps the server's defaults), ``-np 1 -t T -tb T -fa off -c CONTEXT``, prompt cache off.

Every measurement gets a fresh lease (and a fresh server): neither side's cross-request
memory (our corpus, the server's n-gram pools) sees an earlier round of the same prompt;
the two-pass task's earlier request runs on that fresh lease or server first, on every side.
Rounds run the sides in ABBA order after one warm-up round. Decode tok/s is each side's own
figure: our timings (first token to last), the server's ``predicted_per_second``.

Run: ``python benchmarks/bench_lookup.py [--model smollm2|gemma|PATH] [--rounds 3]
[--speculative-tokens 16 64] [--llama-server /tmp/srvbuild/bin/llama-server] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Callable

import httpx

from _llama_slots import stop
from _models import SMOLLM2, add_model_option, header, manifest_fields, resolve
from _workloads import SpeculationTask, speculation_tasks
from bench_llama_server import start_server

from aner_nb import bench

DEFAULT_SERVER_SPECS = ("ngram-mod:default", "ngram-mod:16", "ngram-cache:16", "ngram-simple:16")


def our_side(base, threads: int, k: int, *, earlier: bool = True) -> Callable[[SpeculationTask, int], dict]:
    def run(task: SpeculationTask, max_tokens: int) -> dict:
        with base.with_optimizer(threads=threads, prefill_threads=threads, speculative_tokens=k) as lease:
            if task.before and earlier:
                lease.generate(task.before, max_tokens=max_tokens)
            r = lease.generate(task.prompt, max_tokens=max_tokens)
        t = r.timings
        return {"decode_tokens_per_s": r.tokens_per_second(), "tokens": tuple(r.tokens),
                "proposed": max(t.speculative_proposed_tokens, 0), "accepted": max(t.speculative_accepted_tokens, 0),
                "steps": max(t.speculative_verification_steps, 0), "decode_calls": t.decode_calls}

    return run


def server_side(binary: str, path: str, threads: int, context: int, spec: str | None, ids: Callable[[str], list[int]]):
    extra = ["-fa", "off"]
    if spec is not None:
        kind, _, k = spec.partition(":")
        extra += ["--spec-type", kind]
        if k != "default":
            extra += ["--spec-draft-n-max", k, "--spec-ngram-mod-n-max", k]

    def run(task: SpeculationTask, max_tokens: int) -> dict:
        proc, url = start_server(binary, path, 1, context, threads, extra=tuple(extra))
        try:
            with httpx.Client() as client:
                if task.before:
                    _complete(client, url, ids(task.before), max_tokens)
                body = _complete(client, url, ids(task.prompt), max_tokens)
        finally:
            stop(proc)
        t = body.get("timings") or {}
        return {"decode_tokens_per_s": float(t.get("predicted_per_second", float("nan"))),
                "tokens": tuple(body.get("tokens") or ()), "proposed": int(t.get("draft_n", 0)),
                "accepted": int(t.get("draft_n_accepted", 0)), "steps": -1, "decode_calls": -1}

    return run


def _complete(client: httpx.Client, url: str, tokens: list[int], n_predict: int) -> dict:
    body = {"prompt": tokens, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
            "stream": False, "return_tokens": True}
    r = client.post(f"{url}/completion", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser, SMOLLM2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--speculative-tokens", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--threads", type=int, default=2, help="T for every side (n_threads = n_threads_batch)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tasks", nargs="+", default=None, help="a subset of the workloads by name")
    parser.add_argument("--llama-server", default=None, help="llama-server binary for the server sides")
    parser.add_argument("--server-spec", nargs="+", default=list(DEFAULT_SERVER_SPECS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with bench.exclusive("bench_lookup"):
        run(args)


def run(args: argparse.Namespace) -> None:
    choice = resolve(args.model)
    T = args.threads
    base = choice.load(context=args.context, flash_attention="off")
    print(header(choice, base), flush=True)
    env = bench.manifest(base, benchmark="lookup", **manifest_fields(choice, base))
    print(f"threads={T} prefill_threads={T} (every side; the server gets -t {T} -tb {T}); context {args.context}; "
          f"greedy, {args.max_tokens} tokens")
    print(f"{env['cpu']}; {env['system_info']}", flush=True)
    tasks = [t for t in speculation_tasks() if args.tasks is None or t.name in args.tasks]
    ids = base.prompt_tokens

    sides: dict[str, Callable[[SpeculationTask, int], dict]] = {"off": our_side(base, T, 0)}
    for k in args.speculative_tokens:
        sides[f"on-{k}"] = our_side(base, T, k)
        sides[f"on-{k}/prompt-only"] = our_side(base, T, k, earlier=False)
    if args.llama_server:
        sides["server"] = server_side(args.llama_server, choice.path, T, args.context, None, ids)
        for spec in args.server_spec:
            sides[f"server:{spec}"] = server_side(args.llama_server, choice.path, T, args.context, spec, ids)

    judge = base.with_optimizer(threads=T, prefill_threads=T)  # plain greedy replays for the divergence rule

    def identity(name: str, tokens: tuple, reference: tuple, prompt: str) -> str:
        if tokens == reference:
            return "same"
        if not name.startswith("on-"):
            return "differs"
        k = int(name[3:].split("/")[0])
        d = bench.divergence(judge, prompt, reference, tokens, shape=bench.BatchShape.verification(k))
        verdict = "near tie" if d.near_tie else "DIFFERS"
        return f"{verdict} at {d.position} (gap {d.gap:.3f} <= 2 x {d.perturbation:.3f})" if d.near_tie else (
            f"{verdict} at {d.position} (gap {d.gap:.3f}, movement {d.perturbation:.3f}, later {d.later_position})")

    report: dict[str, Any] = {"manifest": env, "tasks": {}}
    for task in tasks:
        names = [n for n in sides if not n.endswith("/prompt-only") or task.before]
        rows: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(1 + args.rounds):
            for name in names if r % 2 == 0 else reversed(names):
                row = sides[name](task, args.max_tokens)
                if r:
                    rows[name].append(row)
        med = {n: statistics.median(x["decode_tokens_per_s"] for x in rows[n]) for n in names}
        off_tokens = rows["off"][0]["tokens"]
        server_tokens = rows["server"][0]["tokens"] if "server" in rows else None
        print(f"\n== {task.name} (prompt {len(ids(task.prompt))} tokens) ==")
        print(f"{'side':28} {'decode tok/s median (min-max)':32} {'vs off':>7} {'accepted/proposed':>18} "
              f"{'calls':>6}  output vs plain (ours: off; server sides: server)")
        best_server = max((med[n] for n in names if n.startswith("server:")), default=None)
        out: dict[str, Any] = {}
        for n in names:
            x = rows[n]
            stable = all(y["tokens"] == x[0]["tokens"] for y in x)
            verdict = identity(n, x[0]["tokens"], server_tokens if n.startswith("server") else off_tokens, task.prompt)
            same = verdict == "same"
            if not stable:
                verdict += "; rounds differ"
            acc = f"{sum(y['accepted'] for y in x)}/{sum(y['proposed'] for y in x)}"
            calls = statistics.median(y["decode_calls"] for y in x)
            print(f"{n:28} {spread([y['decode_tokens_per_s'] for y in x]):32} {med[n] / med['off']:6.2f}x "
                  f"{acc:>18} {calls:6.0f}  {verdict}")
            out[n] = {"median": med[n], "min": min(y["decode_tokens_per_s"] for y in x),
                      "max": max(y["decode_tokens_per_s"] for y in x), "vs_off": med[n] / med["off"],
                      "accepted": sum(y["accepted"] for y in x), "proposed": sum(y["proposed"] for y in x),
                      "same_output": same and stable, "identity": verdict}
        if best_server:
            for k in args.speculative_tokens:
                print(f"on-{k} / best server speculator: {med[f'on-{k}'] / best_server:.2f}x")
            print(f"our plain tokens equal the server's plain tokens: {server_tokens == off_tokens}")
        if task.before:
            for k in args.speculative_tokens:
                print(f"on-{k} (earlier request in the corpus) / on-{k}/prompt-only: "
                      f"{med[f'on-{k}'] / med[f'on-{k}/prompt-only']:.2f}x")
        report["tasks"][task.name] = out
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    judge.close()
    base.close()


if __name__ == "__main__":
    main()
