"""Prefix cache on the demo model: time to first token, uncached vs cached, same outputs.

A ~1500-token evidence prefix is shared by 5 questions. The uncached side is
a prefix-cache lease that keeps nothing (``prefix_cache_tokens=1``, the same
context layout: every request evaluates the whole prompt); the cached side
is ``with_optimizer(prefix_cache_entries=1)``, whose pool keeps the evidence
between questions. Sides alternate in ABBA order; one warm-up round is
dropped (it also fills the cache). Target: >= 30x faster first token cached.

``--model`` (see ``_models.py``) defaults to ``smollm2`` (SmolLM2-135M-Instruct): prefix reuse
holds for any model. ``--model gemma`` (Gemma 3 270M, whose sections of ``RESULTS.md`` predate the
option) measures it where the prefix is longer than the 512-token sliding window, on the full-size
sliding-window cache a latency lease creates.

Run: ``python benchmarks/bench_prefix.py [--model smollm2|gemma|PATH] [--rounds 3] [--json out.json]``.

``--restart`` (the disk tier, ``prefix_cache_dir``): a first process asks
questions over a ~1,600-token prefix with a disk tier and exits; a fresh
process (a new kernel) then measures the first token of the same questions
(re-running the cells), cold (a lease that keeps nothing) against restored from the
disk tier (a new, empty lease per request, so nothing is live or in RAM), ABBA
after a warm-up round. The cold side is a lease of the same layout that keeps nothing (``_open_model``).
Target: >= 40x faster first token restored. A whole prompt is stored with its
last row's logits, so re-running the same cell evaluates nothing.
``--new-questions``: the fresh process asks 4 questions the first one never
asked over the same prefix instead, so every side restores the shared part and
evaluates the rest (the server restores the slot file of the fill's first
question, then gets the new prompt).

``--rotation`` (the RAM tier, ``prefix_cache_ram_bytes``): 8 different
~1,600-token prefixes in rotation on a lease with 2 live entries, cold against
the RAM tier. Target: >= 20x faster first token.

``--no-hits`` (what the tiers cost when nothing is reused): every request a new
~1,600-token prompt, on a latency lease with one live entry, tiers off against
RAM + disk tiers on (each retained prompt written through to disk, each evicted
one kept in RAM). Measured from the caller: wall time of the whole call, the
tiers' saves included. Target: requests per second with tiers >= 0.98x without.

``--miss-cost`` (what a prefix cache costs a request it cannot serve): the same
new prompts on a plain latency lease of the model loaded with the default
``flash_attention="auto"`` against a prefix-cache lease of it, which runs
attention without flash attention on a CPU (``reuse.reuse_attention``): wall
time, prompt evaluation and decode speed. No target; outputs may differ (another kernel).

``--restart --llama-server PATH`` also measures llama.cpp's own server on the
same prompts: the fill process has a server (``-np 1 --slot-save-path``,
``--swa-full`` so a sliding-window model's state is whole) answer each question
and save its slot to a file; the measuring process starts a new server (the
restart) and, per request, restores the question's file (``POST
/slots/0?action=restore``) and streams the same request, as the rendered prompt
text when the server tokenizes that to our ids (checked first), so both sides
tokenize their prompt. Its figure is restore
plus first token, as the server's client sees it; ours is the first token of a
request on a new lease whose prefix comes from the disk tier (file read, checks
and restore included; a lease with a disk tier makes its first context when it is
derived, as the server makes its slots at start, so neither side's figure holds
a context's creation).

Both sides run with equal ``n_threads`` / ``n_threads_batch`` (``--threads``,
default the logical CPUs), printed with the CPU's features, and the same
attention kernel: a lease with a prefix cache builds its contexts without flash
attention on a CPU (``aner_nb.llm.reuse.reuse_attention``: that is what makes
reuse bitwise exact), so every model here is loaded with
``flash_attention="off"`` and llama-server gets ``--flash-attn off``; an
uncached side with flash attention would run another kernel and could not be
compared token for token (its prefill speed is about the same, RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _models import SMOLLM2, add_model_option, header, manifest_fields, resolve
from _workloads import QUESTIONS, evidence_of_tokens

from aner_nb import bench

ATTENTION = "off"  # every side's kernel: the one a prefix-cache lease uses on a CPU (see the docstring)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=None, help="default 1500 (1600 with --restart/--rotation)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json", default=None)
    parser.add_argument("--restart", action="store_true", help="disk tier: fill in one process, measure in a fresh one")
    parser.add_argument("--rotation", action="store_true", help="RAM tier: 8 prefixes in rotation, 2 live entries")
    parser.add_argument("--no-hits", action="store_true", help="tiers on vs off when every prompt is new")
    parser.add_argument("--miss-cost", action="store_true",
                        help="every prompt new: a plain lease (flash attention auto) vs a prefix-cache lease (off)")
    parser.add_argument("--llama-server", default=None, help="--restart: also measure this llama-server's slot restore")
    parser.add_argument("--threads", type=int, default=0, help="n_threads = n_threads_batch for every side")
    parser.add_argument("--cache-dir", default=None, help="--restart: the disk tier's directory (default: a new temp dir)")
    parser.add_argument("--new-questions", action="store_true",
                        help="--restart: measure questions the fill process did not ask (a shared prefix, a new tail)")
    parser.add_argument("--phase", choices=("fill", "measure"), default=None, help=argparse.SUPPRESS)
    add_model_option(parser, SMOLLM2)
    args = parser.parse_args()
    args.no_hits = args.no_hits or args.miss_cost
    if args.restart or args.rotation or args.no_hits or args.phase:
        args.prefix_tokens = args.prefix_tokens or 1600
        return tiers_main(args)
    args.prefix_tokens = args.prefix_tokens or 1500

    choice = resolve(args.model)
    model = choice.load(context=4096, flash_attention=ATTENTION)
    print(header(choice, model), flush=True)
    cached = model.with_optimizer(prefix_cache_entries=1)
    uncached = model.with_optimizer(prefix_cache_entries=1, prefix_cache_tokens=1)  # same layout, keeps nothing
    text = evidence_of_tokens(model, args.prefix_tokens)
    cases = [bench.Case(f"q{i + 1}", f"{text}\n\nQuestion: {q}", args.max_tokens) for i, q in enumerate(QUESTIONS)]
    result = bench.run_sides(
        [bench.lease_side("uncached", uncached), bench.lease_side("cached", cached)], cases,
        rounds=args.rounds, warmup=1, baseline="uncached",
        manifest_=bench.manifest(cached, benchmark="prefix", **manifest_fields(choice, model)),
    )
    f = result.frame
    summary = result.summary(("first_token_ms", "prompt_eval_ms", "total_ms", "cached_input_tokens"))
    print(f"prompt tokens: {len(model.prompt_tokens(cases[0].prompt))} (prefix ~{args.prefix_tokens})\n")
    print(summary.to_string(index=False))
    speedup = 1 / result.ratio("cached", "first_token_ms")
    print(f"\nfirst-token speedup cached vs uncached (ratio of medians): {speedup:.1f}x (target >= 30x)")
    same = result.same_outputs("cached")
    print(f"identical outputs: {int(same.sum())}/{len(same)}")
    for case in same.index[~same]:
        a = f[(f.side == "uncached") & (f.case == case)].tokens.iloc[0]
        row = f[(f.side == "cached") & (f.case == case)].iloc[0]
        prompt = next(c.prompt for c in cases if c.name == case)
        shape = bench.BatchShape.prefill(cached=int(row.cached_input_tokens))  # it prefilled only the tail
        print(f"  {case}: {bench.divergence(model, prompt, a, row.tokens, shape=shape)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"manifest": result.manifest, "summary": summary.to_dict("records"),
                       "first_token_speedup": speedup, "identical": int(same.sum())}, out, indent=2, default=str)
    cached.close()
    uncached.close()
    model.close()


def _threads(args: argparse.Namespace) -> int:
    return args.threads or (os.cpu_count() or 1)


def _print_machine(threads: int) -> None:
    from aner_nb.llm import cpu_guard

    flags = [f for f in cpu_guard.cpu_flags() if f.startswith(("avx", "amx", "f16c", "fma", "sse4", "neon", "sve"))]
    print(f"threads: n_threads={threads} n_threads_batch={threads} on {os.cpu_count()} logical CPUs", flush=True)
    print(f"CPU features: {' '.join(flags) or '?'}", flush=True)


def tiers_main(args: argparse.Namespace) -> None:
    """``--restart`` (parent: fill in one child, measure in a fresh child) and ``--rotation``."""
    if args.phase == "fill":
        return _fill(args)
    if args.phase == "measure":
        return _measure_restart(args)
    if args.rotation:
        return _rotation(args)
    if args.no_hits:
        return _no_hits(args)
    directory = args.cache_dir or tempfile.mkdtemp(prefix="aner-prefix-tiers-")
    base = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--threads", str(_threads(args)),
            "--prefix-tokens", str(args.prefix_tokens), "--max-tokens", str(args.max_tokens),
            "--rounds", str(args.rounds), "--cache-dir", directory] + (["--json", args.json] if args.json else []) + (
                ["--llama-server", args.llama_server] if args.llama_server else []) + (
                ["--new-questions"] if args.new_questions else [])
    print(f"disk tier: {directory}", flush=True)
    subprocess.run(base + ["--phase", "fill"], check=True)
    subprocess.run(base + ["--phase", "measure"], check=True)  # a fresh process: a restarted kernel


def _tiered(model, threads: int, **tiers):
    return model.with_optimizer(threads=threads, prefill_threads=threads, prefix_cache_entries=tiers.pop("entries", 1),
                                **tiers)


def _fill(args: argparse.Namespace) -> None:
    choice = resolve(args.model)
    threads = _threads(args)
    with choice.load(context=4096, flash_attention=ATTENTION) as model, _tiered(model, threads, prefix_cache_dir=args.cache_dir) as lease:
        text = evidence_of_tokens(model, args.prefix_tokens)
        # The cells a notebook runs before its kernel restarts: the same questions the fresh process asks.
        # (On a sliding-window model an entry restores whole only, so the prompts must be the same.)
        for case in _restart_cases(text, args):
            r = lease.generate(case.prompt, max_tokens=args.max_tokens)
        lease._state.pool.store.flush()  # the writer thread's queue: count what is on disk
        files = [f for f in os.listdir(args.cache_dir) if f.endswith(".kv")]
        size = sum(os.path.getsize(os.path.join(args.cache_dir, f)) for f in files)
        print(f"fill process: {len(QUESTIONS) - 1} prompts of ~{r.usage.prompt_tokens} tokens; disk tier holds "
              f"{len(files)} file(s), {size:,} bytes", flush=True)
        if args.llama_server:
            import _llama_slots

            prompts = {case.name: list(model.prompt_tokens(case.prompt)) for case in _restart_cases(text, args)}
            os.makedirs(_slot_dir(args), exist_ok=True)
            _llama_slots.fill(args.llama_server, model.path, prompts, context=4096, threads=threads,
                              slot_dir=_slot_dir(args), n_predict=args.max_tokens)


def _slot_dir(args: argparse.Namespace) -> str:
    return os.path.join(args.cache_dir, "llama-server-slots")  # a subdirectory: the disk tier reads *.kv only


def _restart_cases(text: str, args: argparse.Namespace) -> list:
    """The questions both processes ask (on a sliding-window model an entry restores whole only)."""
    return [bench.Case(f"q{i + 2}", f"{text}\n\nQuestion: {q}", args.max_tokens) for i, q in enumerate(QUESTIONS[1:])]


# --new-questions: asked only by the measuring process (none is in _workloads.QUESTIONS).
NEW_QUESTIONS = [
    "Which year has the fewest entries?",
    "What did the treasurers buy most often?",
    "Summarise the ledger in one sentence.",
    "Is any entry recorded twice?",
]
# The llama-server slot file each new question's request restores first: the fill's first question's.
NEW_QUESTION_SLOT = "q2"


def _measured_cases(text: str, args: argparse.Namespace) -> list:
    if not args.new_questions:
        return _restart_cases(text, args)
    return [bench.Case(f"n{i + 1}", f"{text}\n\nQuestion: {q}", args.max_tokens) for i, q in enumerate(NEW_QUESTIONS)]


def _open_model(args: argparse.Namespace, attention: str = ATTENTION) -> tuple:
    """The model choice, threads, the loaded model (4,096 cells) and its uncached lease, header printed.

    The uncached lease has the cached side's context layout (a prefix-cache
    lease: a full sliding-window cache, the same attention kernel) but keeps
    nothing useful (``prefix_cache_tokens=1``: at most one token is held, and a
    match must be longer than the template's opening), so every request
    evaluates its whole prompt, in the same calls (its tail apart). A plain
    latency lease would not do: it keeps a window-sized sliding-window cache,
    and Gemma's attention then sums over other cells (another rounding). Its
    cost: each request creates its context (tens of ms against seconds of
    prefill; the tables report prompt evaluation apart).
    """
    choice = resolve(args.model)
    threads = _threads(args)
    model = choice.load(context=4096, flash_attention=attention)
    print(header(choice, model), flush=True)
    _print_machine(threads)
    return choice, threads, model, _tiered(model, threads, prefix_cache_tokens=1)


def _measure_restart(args: argparse.Namespace) -> None:
    choice, threads, model, cold = _open_model(args)
    text = evidence_of_tokens(model, args.prefix_tokens)
    cases = _measured_cases(text, args)
    filled = set(os.listdir(args.cache_dir))

    def restored(case: bench.Case) -> dict:
        # A new lease per request: nothing live, nothing in RAM; only the disk tier the other process filled.
        # (Its first token is timed from the call: the lease's context is made when the lease is.)
        with _tiered(model, threads, prefix_cache_dir=args.cache_dir) as lease:
            r = lease.generate(case.prompt, max_tokens=case.max_tokens, seed=case.seed, temperature=case.temperature)
        if args.new_questions:  # untimed: what this request wrote goes, so every round's question stays new
            for name in set(os.listdir(args.cache_dir)) - filled:
                os.remove(os.path.join(args.cache_dir, name))
        row = bench.response_row(r)
        row["tier"] = r.timings.prefix_cache_tier
        row["restored_tokens"] = r.timings.prefix_restored_tokens
        row["restore_ms"] = r.timings.prefix_restore_duration / 1e6
        row["bytes_read"] = r.timings.prefix_tier_bytes_read
        return row

    # Cold: the uncached lease of _open_model (every request evaluates the whole prompt). Restored: its lease (and, with a disk tier, its first context) is made before
    # the call, as a notebook derives it in an earlier cell; neither side's first token includes that.
    sides = [bench.lease_side("cold", cold), bench.Side("restored", restored)]
    server = None
    if args.llama_server:
        import _llama_slots
        import httpx

        # A new server: the restart. Same threads and cells as our side.
        server = _llama_slots.start(args.llama_server, model.path, context=4096, threads=threads,
                                    slot_dir=_slot_dir(args))
        client = httpx.Client()
        # The server gets the rendered prompt text when it tokenizes it to our ids (checked here, untimed),
        # so both sides' first tokens include tokenizing the prompt.
        server_prompts = {
            c.name: _llama_slots.text_prompt(
                client, server[1], model._weights.template.render([{"role": "user", "content": c.prompt}]),
                list(model.prompt_tokens(c.prompt)),
            )
            for c in cases
        }
        print(f"llama-server prompts sent as text: {sum(isinstance(p, str) for p in server_prompts.values())}"
              f"/{len(server_prompts)}", flush=True)

        def server_restore(case: bench.Case) -> dict:
            slot = NEW_QUESTION_SLOT if args.new_questions else case.name
            return _llama_slots.restore_and_ask(client, server[1], slot, server_prompts[case.name], case.max_tokens)

        sides.append(bench.Side("llama_server_restore", server_restore))
    try:
        result = bench.run_sides(
            sides, cases, rounds=args.rounds, warmup=1, baseline="cold",
            manifest_=bench.manifest(cold, benchmark="prefix_restart", llama_server=args.llama_server,
                                     **manifest_fields(choice, model)),
        )
    finally:
        if server is not None:
            client.close()
            _llama_slots.stop(server[0])
    _report(result, model, "restored", ("first_token_ms", "prompt_eval_ms", "cached_input_tokens"), 40, args, cases)
    if server is not None:
        _report_server(result)
    f = result.frame
    r = f[f.side == "restored"]
    print(f"restored from disk: tier codes {sorted(set(r.tier.astype(int)))} (3 = disk), restored tokens "
          f"{int(r.restored_tokens.median())}, restore {r.restore_ms.median():.1f} ms median, "
          f"{int(r.bytes_read.median()):,} bytes read")
    cold.close()
    model.close()


def _report_server(result) -> None:
    """Ours restored vs llama-server restore + request, paired by round and case."""
    f = result.frame
    ours = f[f.side == "restored"].first_token_ms
    srv = f[f.side == "llama_server_restore"]
    paired = result.paired("llama_server_restore", "first_token_ms", over="restored")
    print(f"llama-server restore + first token: median {srv.first_token_ms.median():.1f} ms "
          f"({srv.first_token_ms.min():.1f}-{srv.first_token_ms.max():.1f}); restore alone {srv.restore_ms.median():.1f} ms; "
          f"restored tokens {int(srv.restored_tokens.median())}, cache_n {int(srv.cache_n.median())}, "
          f"prompt_n {int(srv.prompt_n.median())}, its prompt evaluation {srv.prompt_ms.median():.1f} ms (ours "
          f"{f[f.side == 'restored'].prompt_eval_ms.median():.1f} ms)")
    print(f"ours restored: median {ours.median():.1f} ms ({ours.min():.1f}-{ours.max():.1f}); llama-server / ours: "
          f"ratio of medians {srv.first_token_ms.median() / ours.median():.2f}, paired median {paired.median():.2f} "
          f"({paired.min():.2f}-{paired.max():.2f}); >= 1 means ours is no slower")
    # The server's rows carry token ids, not our output hash: compare the tokens, case by case.
    cold = f[f.side == "cold"].groupby("case").tokens.first()
    same = srv.groupby("case").tokens.first().map(tuple) == cold.map(tuple)
    print(f"llama-server outputs identical to our cold run: {int(same.sum())}/{len(same)}", flush=True)


def _no_hits(args: argparse.Namespace) -> None:
    # --miss-cost: the library's default attention (auto) for the model, so the plain lease keeps it and the
    # prefix-cache lease turns it off (reuse.reuse_attention); --no-hits: both sides' attention off.
    choice, threads, model, uncached = _open_model(args, "auto" if args.miss_cost else ATTENTION)
    uncached.close()
    directory = args.cache_dir or tempfile.mkdtemp(prefix="aner-prefix-nohits-")
    if args.miss_cost:  # what a notebook user compares: a plain latency lease against a prefix-cache one
        names = ("plain", "prefix_cache")
        off, on = model.with_optimizer(threads=threads, prefill_threads=threads), _tiered(model, threads)
    else:
        names = ("tiers_off", "tiers_on")
        off = _tiered(model, threads)
        on = _tiered(model, threads, prefix_cache_ram_bytes=8 << 30, prefix_cache_dir=directory)
    calls: dict[tuple[str, str], int] = {}
    seeds = iter(range(10_000, 1_000_000))
    texts: dict[tuple[str, int], str] = {}

    def side(name: str, lease):
        def run(case: bench.Case) -> dict:
            # The k-th call of a case gets the same new prompt on both sides, never seen before by either.
            k = calls[(name, case.name)] = calls.get((name, case.name), -1) + 1
            if (case.name, k) not in texts:
                texts[(case.name, k)] = evidence_of_tokens(model, args.prefix_tokens, seed=next(seeds))
            prompt = f"{texts[(case.name, k)]}\n\nQuestion: {case.prompt}"
            t0 = time.perf_counter()
            r = lease.generate(prompt, max_tokens=case.max_tokens, seed=case.seed, temperature=case.temperature)
            wall = time.perf_counter() - t0
            row = bench.response_row(r)
            row["wall_ms"] = 1000.0 * wall
            row["requests_per_s"] = 1.0 / wall
            return row
        return bench.Side(name, run)

    cases = [bench.Case(f"q{i + 1}", q, args.max_tokens) for i, q in enumerate(QUESTIONS)]
    result = bench.run_sides(
        [side(names[0], off), side(names[1], on)], cases, rounds=args.rounds, warmup=1, baseline=names[0],
        manifest_=bench.manifest(on, benchmark="prefix_miss_cost" if args.miss_cost else "prefix_no_hits",
                                 **manifest_fields(choice, model)),
    )
    summary = result.summary(("wall_ms", "requests_per_s", "first_token_ms", "prompt_eval_ms", "decode_tokens_per_s",
                              "cached_input_tokens"))
    print(summary.to_string(index=False))
    paired = 1 / result.paired(names[1], "wall_ms")  # requests per second: the inverse of wall time
    ratio = 1 / result.ratio(names[1], "wall_ms")
    target = "" if args.miss_cost else " (target >= 0.98)"
    print(f"\nrequests per second, {names[1]} / {names[0]}: ratio of medians {ratio:.3f}, paired median "
          f"{paired.median():.3f} ({paired.min():.3f}-{paired.max():.3f}){target}")
    if args.miss_cost:
        prefill = result.ratio(names[1], "prompt_eval_ms")
        decode = result.ratio(names[1], "decode_tokens_per_s")
        print(f"prompt eval time {names[1]} / {names[0]}: {prefill:.3f}; decode tokens/s {names[1]} / {names[0]}: "
              f"{decode:.3f} (attention: {off._params.flash_attention} vs {on._params.flash_attention})")
    same = result.same_outputs(names[1])
    print(f"identical outputs: {int(same.sum())}/{len(same)}")
    if not args.miss_cost:  # the miss-cost side has no tiers
        stats = on.prefix_tier_stats()
        print(f"tiers: hits {stats['hits']}, misses {stats['misses']}, skips {stats['skips']}, "
              f"held {stats['held_entries']}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"manifest": result.manifest, "summary": summary.to_dict("records"), "ratio": ratio,
                       "paired": paired.median(), "identical": int(same.sum())}, out, indent=2, default=str)
    on.close()
    off.close()
    model.close()


def _rotation(args: argparse.Namespace) -> None:
    choice, threads, model, cold = _open_model(args)
    ram = _tiered(model, threads, entries=2, prefix_cache_ram_bytes=8 << 30)
    texts = [evidence_of_tokens(model, args.prefix_tokens, seed=1888 + i) for i in range(8)]
    cases = [bench.Case(f"p{i + 1}", f"{t}\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}", args.max_tokens)
             for i, t in enumerate(texts)]
    result = bench.run_sides(
        [bench.lease_side("cold", cold), bench.lease_side("ram_tier", ram)], cases, rounds=args.rounds, warmup=1,
        baseline="cold", manifest_=bench.manifest(ram, benchmark="prefix_rotation", **manifest_fields(choice, model)),
    )
    _report(result, model, "ram_tier", ("first_token_ms", "prompt_eval_ms", "cached_input_tokens"), 20, args, cases)
    stats = ram.prefix_tier_stats()
    print(f"RAM tier: {stats['held_entries']['ram']} entries, {stats['held_bytes']['ram']:,} bytes; hits {stats['hits']}, "
          f"misses {stats['misses']}, skips {stats['skips']}")
    ram.close()
    cold.close()
    model.close()


def _report(result, model, side: str, columns, target: int, args: argparse.Namespace, cases) -> None:
    summary = result.summary(columns)
    print(summary.to_string(index=False))
    speedup = 1 / result.ratio(side, "first_token_ms")
    print(f"\nfirst-token speedup {side} vs cold (ratio of medians): {speedup:.1f}x (target >= {target}x)")
    same = result.same_outputs(side)
    print(f"identical outputs: {int(same.sum())}/{len(same)}", flush=True)
    ties = _judge_differences(result, model, side, cases, same)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"manifest": result.manifest, "summary": summary.to_dict("records"),
                       "first_token_speedup": speedup, "identical": int(same.sum()), "divergences": ties},
                      out, indent=2, default=str)


def _judge_differences(result, model, side: str, cases, same) -> dict:
    """Each output of ``side`` that differs from the cold one, judged by the near-tie rule
    (``bench.divergence``: the cold side's plain greedy replay against the shape ``side`` used, a
    prefill of the tail after its restored tokens)."""
    f = result.frame
    prompts = {c.name: c.prompt for c in cases}
    out = {}
    for case in same.index[~same]:
        a = f[(f.side == "cold") & (f.case == case)].tokens.iloc[0]
        row = f[(f.side == side) & (f.case == case)].iloc[0]
        shape = bench.BatchShape.prefill(cached=int(row.cached_input_tokens))
        d = bench.divergence(model, prompts[case], a, row.tokens, shape=shape)
        out[case] = d.as_dict()
        print(f"  {case}: {d}", flush=True)
    return out


if __name__ == "__main__":
    from aner_nb.bench import exclusive

    if "--phase" in sys.argv or "--restart" in sys.argv:  # the measuring child takes the lock (run_sides)
        main()
    else:
        with exclusive("bench_prefix"):  # one benchmark at a time: two would measure each other
            main()
