"""What one ``llama_decode`` step costs per decode row: the ceiling of any batching scheduler.

A batching step feeds one token for each of k sequences and reads k logits
rows; serial serving decodes one row per step. However well a scheduler
works, its throughput over serial decoding cannot exceed ``k * D(1) / D(k)``
where ``D(k)`` is the cost of a k-row step. This benchmark measures ``D(k)``
on the demo model directly on the engine (no scheduler, no Python between
the rows), on one context shaped like a batching lease's (one KV stream per
sequence, ``kv_unified=False``), with:

- ``all``: logits for every row (what batching needs);
- ``one``: logits for one row only (isolates the output layer: the
  difference is the cost of the other rows' 262k-vocabulary products);
- ``pad``: for odd k >= 3, one extra row with logits in an empty sequence
  next to the others (what the scheduler does where the CPU kernel pairs
  batch columns, see ``aner_nb.llm._engine.pairs_batch_columns``). The
  sequence ids of a step are consecutive: llama.cpp runs a multi-stream
  batch as one micro-batch only then.

Every configuration is measured in every round (rounds interleave them so
machine noise hits all alike); each round takes ``--steps`` steps after one
warm-up step at a fixed context length (the rows are removed after each step).
Reported: median, min and max step time, per-row time, and the ceiling
``k * D(1) / D(k)`` as a ratio of medians.

``--model`` (see ``_models.py``) defaults to ``gemma`` (Gemma 3 270M): the ``one`` rows isolate
the output layer, whose cost is the point on a 262,144-token vocabulary (about 60% of its
parameters); the sections of ``RESULTS.md`` measured it. ``--model smollm2`` measures the same
ceiling on SmolLM2-135M-Instruct (49,152-token vocabulary).

Run: ``python benchmarks/bench_decode_rows.py [--model gemma|smollm2|PATH] [--rows 1 2 3 4 8] [--rounds 6]
[--threads 2]``.

Comparing two llama.cpp builds (``--build NAME=DIR`` twice, the baseline
first; DIR holds a wheel installed with ``pip install --target DIR WHEEL
--no-deps`` and goes first on a child's ``PYTHONPATH``, so each side runs its
own shared libraries with this checkout's aner_nb): after a warm-up child
each, every round starts one child per build in ABBA order. A child measures
the ``all`` configurations only (``--child-rounds`` interleaved rounds of
``--steps`` steps; tokens/s at k rows is ``k / D(k)``) at the same
``n_threads = n_threads_batch`` on both sides, then decodes greedily, on the
same kind of context, one sequence alone and max(rows) sequences together
(distinct prompts), ``--greedy-tokens`` tokens each. Reported: each build's
system info and threads as llama.cpp reports them, medians (min-max) over
rounds, ratios of medians and medians of per-round ratios, and whether the
greedy tokens are equal (else the first divergence: float summation order may
differ between builds)::

    python benchmarks/bench_decode_rows.py --rows 1 2 4 8 --threads 2 --rounds 4 \
        --build default=/tmp/default_site --build nollamafile=/tmp/nollamafile_site
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _models import GEMMA, add_model_option, header, manifest_fields, resolve

from aner_nb.llm._engine import Batch, ContextParams, NativeContext, NativeModel, pairs_batch_columns, system_info
from aner_nb.llm.artifact import inspect_model, sha256_file

PROMPT = "Tell me a story about the sea, the harbour and the ships that come and go. " * 2
ROOT = Path(__file__).resolve().parents[1]
SUBJECTS = ("the sea", "a dragon who is afraid of fire", "a robot learning to paint", "the last train home",
            "a city under the ice", "two rival bakers", "a map with no roads", "the moon's lost key")


def greedy_rows(model: NativeModel, ctx: NativeContext, batch: Batch, rows: int, n: int) -> list[list[int]]:
    """Greedy tokens of ``rows`` sequences (1..rows, distinct prompts) decoded together, one token
    per sequence per step, ``n`` steps, on an emptied context."""
    ctx.clear()
    prompts = [model.tokenize(f"Tell me a story about {SUBJECTS[seq % len(SUBJECTS)]}. Once upon a time,",
                              add_special=True) for seq in range(rows)]
    out: list[list[int]] = []
    for seq, prompt in enumerate(prompts, start=1):
        batch.clear()
        i = batch.add_run(prompt, 0, seq, logits_last=True)
        ctx.decode(batch)
        out.append([ctx.greedy(i)])
    pos = [len(p) for p in prompts]
    for _ in range(n - 1):
        batch.clear()
        for seq in range(1, rows + 1):
            batch.add(out[seq - 1][-1], pos[seq - 1], seq, logits=True)
            pos[seq - 1] += 1
        ctx.decode(batch)
        for seq in range(1, rows + 1):
            out[seq - 1].append(ctx.greedy(seq - 1))
    return out


def measure(path: str, rows: list[int], rounds: int, steps: int, threads: int, *, all_only: bool = False,
            greedy_tokens: int = 0) -> dict:
    """Step times in ms per ``(k, mode)`` over ``rounds`` interleaved rounds, and (``greedy_tokens``)
    the greedy tokens of one sequence alone and of max(rows) sequences together."""
    model = NativeModel(path)
    # Sequence 0 stays empty for the padding row; a k-row step uses sequences 1..k. Ids are
    # consecutive, so llama.cpp runs each step as one micro-batch (as the scheduler arranges).
    n_seq = max(rows) + 1
    ctx = NativeContext(model, ContextParams(
        n_ctx=512 * n_seq, n_batch=512, n_ubatch=128, n_seq_max=n_seq, n_threads=threads,
        n_threads_batch=threads, kv_unified=False, flash_attention="auto",
    ))
    batch = Batch(512, 1)
    prompt = model.tokenize(PROMPT, add_special=True)
    for seq in range(1, n_seq):
        batch.clear()
        batch.add_run(prompt, 0, seq, logits_last=True)
        ctx.decode(batch)
    pos = len(prompt)

    configs = [(k, "all") for k in rows]
    if not all_only:
        configs += [(k, "one") for k in rows if k > 1] + [(k, "pad") for k in rows if k >= 3 and k % 2]
    times: dict[tuple[int, str], list[float]] = {c: [] for c in configs}
    token = 1000
    for _ in range(rounds):
        for k, mode in configs:
            for step in range(steps + 1):
                batch.clear()
                if mode == "pad":
                    batch.add(token, 0, 0, logits=True)
                for seq in range(1, k + 1):
                    batch.add(token, pos, seq, logits=mode != "one" or seq == 1)
                t = time.perf_counter()
                ctx.decode(batch)
                if step:  # the first step of each configuration warms caches
                    times[(k, mode)].append((time.perf_counter() - t) * 1000)
                for seq in range(n_seq):
                    ctx.seq_rm(seq, pos if seq else 0, -1)
                token += 1

    result = {"times": times, "settings": ctx.engine_settings(), "system_info": system_info().strip()}
    if greedy_tokens:
        result["greedy_one"] = greedy_rows(model, ctx, batch, 1, greedy_tokens)[0]
        result["greedy_batched"] = greedy_rows(model, ctx, batch, max(rows), greedy_tokens)
    batch.free()
    ctx.free()
    model.free()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=None,
                        help="rows per step (default 1 2 3 4 5 6 8; 1 2 4 8 with --build)")
    parser.add_argument("--rounds", type=int, default=None, help="default 6; ABBA rounds with --build: 4")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--build", action="append", metavar="NAME=DIR",
                        help="compare two builds (give exactly two, the baseline first)")
    parser.add_argument("--child-rounds", type=int, default=3, help="with --build: rounds inside each child")
    parser.add_argument("--greedy-tokens", type=int, default=48, help="with --build: greedy tokens compared")
    parser.add_argument("--json", default=None, help="with --build: write all results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_model_option(parser, GEMMA, "the cost of a 262k-vocabulary output layer")
    args = parser.parse_args()
    if args.child:
        child(args)
    elif args.build:
        if len(args.build) != 2 or not all("=" in b for b in args.build):
            parser.error("give exactly two --build NAME=DIR")
        from aner_nb.bench import exclusive

        with exclusive("bench_decode_rows"):  # one benchmark at a time: two would measure each other
            compare(args)
    else:
        from aner_nb.bench import exclusive

        with exclusive("bench_decode_rows"):
            single(args)


def single(args: argparse.Namespace) -> None:
    rows = args.rows or [1, 2, 3, 4, 5, 6, 8]
    choice = resolve(args.model)
    path = choice.path
    facts = inspect_model(path)
    print(header(choice, fingerprint=sha256_file(path)), flush=True)
    times = measure(path, rows, args.rounds or 6, args.steps, args.threads)["times"]
    configs = list(times)
    print(f"model {os.path.basename(path)} sha256 {sha256_file(path)[:12]}, "
          f"output weights {facts.output_type}, threads {args.threads}, "
          f"column pairing {pairs_batch_columns(facts.output_type)}")
    print(f"build: {system_info().strip()}")
    d1 = statistics.median(times[(1, "all")])
    print(f"{'rows':>4} {'logits':>6} {'median ms':>10} {'min':>7} {'max':>7} {'ms/row':>7} {'ceiling k*D1/Dk':>16}")
    for k, mode in configs:
        v = times[(k, mode)]
        med = statistics.median(v)
        ceiling = f"{k * d1 / med:.2f}x" if mode != "one" else "-"
        print(f"{k:>4} {mode:>6} {med:>10.1f} {min(v):>7.1f} {max(v):>7.1f} {med / k:>7.1f} {ceiling:>16}")


def child(args: argparse.Namespace) -> None:
    """One build's measurement in a child process (its llama_cpp comes first on PYTHONPATH)."""
    import llama_cpp

    rows = args.rows or [1, 2, 4, 8]
    r = measure(resolve(args.model).path, rows, args.child_rounds, args.steps, args.threads, all_only=True,
                greedy_tokens=args.greedy_tokens)
    print(json.dumps({
        "tok_s": {k: k * 1000 / statistics.median(r["times"][(k, "all")]) for k in rows},
        "step_ms": {k: statistics.median(r["times"][(k, "all")]) for k in rows},
        "settings": r["settings"], "system_info": r["system_info"], "llama_cpp": llama_cpp.__file__,
        "greedy_one": r.get("greedy_one"), "greedy_batched": r.get("greedy_batched"),
    }))


def run_child(site: str, args: argparse.Namespace, rows: list[int], child_rounds: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, str(ROOT)]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--rows", *map(str, rows),
           "--child-rounds", str(child_rounds), "--steps", str(args.steps), "--threads", str(args.threads),
           "--greedy-tokens", str(args.greedy_tokens), "--model", resolve(args.model).path]
    out = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["tok_s"] = {int(k): v for k, v in result["tok_s"].items()}
    if not result["llama_cpp"].startswith(str(Path(site).resolve())) and not result["llama_cpp"].startswith(site):
        raise SystemExit(f"the child for {site} imported llama_cpp from {result['llama_cpp']}, not from the build")
    return result


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token that differs (or where one list ends early), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(results: dict[str, list[dict]], names: list[str]) -> list[str]:
    """Lines saying whether the greedy tokens agree within each build (every child) and across builds."""
    lines = []
    for key, label in (("greedy_one", "one sequence"), ("greedy_batched", "rows together")):
        ref = {name: results[name][0][key] for name in names}
        for name in names:
            same = all(r[key] == ref[name] for r in results[name])
            lines.append(f"greedy {label}, {name}: {'the same in every child' if same else 'DIFFERS between children'}")
        seqs_a, seqs_b = ref[names[0]], ref[names[1]]
        if key == "greedy_one":
            seqs_a, seqs_b = [seqs_a], [seqs_b]
        diverged = [(s, first_divergence(x, y)) for s, (x, y) in enumerate(zip(seqs_a, seqs_b))]
        diverged = [(s, i) for s, i in diverged if i is not None]
        n = len(seqs_a[0])
        if not diverged:
            lines.append(f"greedy {label}: {names[0]} and {names[1]} equal ({len(seqs_a)} x {n} tokens)")
        for s, i in diverged:
            lines.append(f"greedy {label}: sequence {s + 1} diverges at token {i} of {n}: "
                         f"{names[0]} {seqs_a[s][i:i + 4]} vs {names[1]} {seqs_b[s][i:i + 4]}")
    return lines


def compare(args: argparse.Namespace) -> None:
    from aner_nb.bench import environment

    rows = args.rows or [1, 2, 4, 8]
    choice = resolve(args.model)
    fingerprint = sha256_file(choice.path)
    print(header(choice, fingerprint=fingerprint), flush=True)
    sides = [tuple(b.split("=", 1)) for b in args.build]
    names = [name for name, _ in sides]
    env_start = environment()
    for _name, site in sides:  # warm-up child each (page cache, first-run costs)
        run_child(site, args, rows, 1)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds or 4):
        for name, site in (sides if r % 2 == 0 else sides[::-1]):
            results[name].append(run_child(site, args, rows, args.child_rounds))
    env_end = environment()
    a, b = names
    print(f"model {os.path.basename(choice.path)}; rows {rows}; {args.rounds or 4} ABBA rounds after a "
          f"warm-up child each; per child {args.child_rounds} rounds x {args.steps} steps; "
          f"CPU {env_start.get('cpu', '?')}; load average {env_start['load_average']} -> {env_end['load_average']}")
    for name in names:
        first = results[name][0]
        print(f"{name}: threads n_threads={first['settings']['n_threads']} "
              f"n_threads_batch={first['settings']['n_threads_batch']}; {first['system_info']}")
    summary = {}
    print(f"{'rows':>4} {a + ' tok/s':>24} {b + ' tok/s':>24} {b + '/' + a:>10} {'paired':>8} {'paired min-max':>15}")
    for k in rows:
        va, vb = [x["tok_s"][k] for x in results[a]], [x["tok_s"][k] for x in results[b]]
        paired = [y / x for x, y in zip(va, vb)]
        summary[k] = {a: {"median": statistics.median(va), "min": min(va), "max": max(va)},
                      b: {"median": statistics.median(vb), "min": min(vb), "max": max(vb)},
                      "ratio_of_medians": statistics.median(vb) / statistics.median(va),
                      "paired_ratio_median": statistics.median(paired), "paired": paired}
        s = summary[k]
        cell = {n: f"{s[n]['median']:.1f} ({s[n]['min']:.1f}-{s[n]['max']:.1f})" for n in names}
        print(f"{k:>4} {cell[a]:>24} {cell[b]:>24} {s['ratio_of_medians']:>10.3f} {s['paired_ratio_median']:>8.3f} "
              f"{min(paired):>7.3f}-{max(paired):.3f}")
    outputs = compare_outputs(results, names)
    for line in outputs:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"environment_start": env_start, "environment_end": env_end,
                                               **manifest_fields(choice, fingerprint=fingerprint),
                                               "summary": summary, "outputs": outputs, "results": results},
                                              indent=2))


if __name__ == "__main__":
    main()
