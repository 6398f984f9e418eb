"""Long-context scenarios on the demo model: decode speed by prompt length, prefix reuse, fact retrieval.

Three scenarios (``--scenario sweep|headers|retrieval|all``), one load of the model:

- ``sweep``: ledger prompts of about 1K/4K/8K/16K/32K tokens (each the longest
  ledger whose chat prompt fits the target, the 32K one also leaving room for the
  decode budget in the 32,768-token context). Per length: prefill tokens/s and
  greedy decode tokens/s over up to 64 tokens; one warm-up request (a ledger of
  at most 512 tokens, dropped), then ``--rounds`` rounds, lengths in alternating
  order (ABBA).
  A length that does not fit (above the model's trained context, or a KV estimate
  above the memory the OS reports available) is reported with the reason.
- ``headers``: two different long system headers A and B alternate on a
  prefix-cache lease (2 entries) as A, B, A', B', A, B, A, B, where a primed
  header changes one fact near its end. Each turn's ``cached_input_tokens`` is
  ASSERTED equal to an expectation computed from the token lists alone: the
  longest common prefix with the prompts the pool should retain (the last two
  served), less the one replayed token, and nothing when only the template's
  opening matches.
- ``retrieval``: a ledger of about 8K/16K/32K tokens with three facts ("The
  access code for vault Q is 48172.") planted at 10%, 50% and 90% depth, then one
  question per fact (the model's chat template, one user turn: the document, then the
  question and "Answer with the code only."). Scored by exact match: the
  expected code is one of the digit runs of the greedy answer. The three
  questions share the document, so a one-entry prefix cache evaluates it once.

``--model`` (see ``_models.py``) defaults to ``gemma`` (Gemma 3 270M), the model every section
of ``RESULTS.md`` on this benchmark ran on: its trained context (32,768 tokens) holds the 16K and
32K lengths, which SmolLM2-135M-Instruct's 8,192 cannot (``--model smollm2`` reports them as not
fitting), and its sliding-window layers (window 512) make ``headers`` a test of prefix reuse beyond
the window. The template is the model's own (``gemma`` for Gemma) unless ``--chat-template`` names one.

Run: ``python benchmarks/bench_long_context.py [--model gemma|smollm2|PATH] [--scenario all] [--rounds 3]
[--json out.json]``;
``--quick --model tiny.gguf`` runs every scenario tiny (for tests). Engine threads
are ``--threads`` for both decode and batches (n_threads = n_threads_batch).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _models import GEMMA, add_model_option, header, manifest_fields, resolve  # noqa: E402
from _workloads import evidence  # noqa: E402

from aner_nb import bench, llm  # noqa: E402
from aner_nb.bench.evidence import load_average  # noqa: E402
from aner_nb.llm.prefix_pool import common_prefix_length  # noqa: E402
from aner_nb.llm.reuse import BLOCKED, ReuseShape  # noqa: E402

SWEEP_QUESTION = "List every treasurer named in the ledger, with the year of each entry."
FACTS = (("Q", "48172", 0.1), ("M", "29536", 0.5), ("T", "73614", 0.9))  # vault, code, depth
HEADER_FACT = "The harbor master on duty tonight is {}."
HEADER_QUESTION = "Who is the harbor master on duty tonight?"


@dataclass(frozen=True)
class Settings:
    sweep_lengths: tuple[int, ...]
    retrieval_lengths: tuple[int, ...]
    header_tokens: int
    rounds: int
    max_tokens: int
    answer_tokens: int
    pattern: tuple[str, ...] = ("A", "B", "A'", "B'", "A", "B", "A", "B")


FULL = Settings((1024, 4096, 8192, 16384, 32768), (8192, 16384, 32768), 1500, 3, 64, 16)
QUICK = Settings((128, 512), (512,), 300, 1, 8, 8)


def _median(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def longest_fitting(count_tokens: Callable[[int], int], limit: int, start: int = 4) -> int:
    """Largest ``n`` >= 1 with ``count_tokens(n) <= limit`` (count_tokens grows with n); 0 when none fits."""
    if count_tokens(1) > limit:
        return 0
    lo, hi = 1, start
    while count_tokens(hi) <= limit:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # count(lo) fits, count(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count_tokens(mid) <= limit else (lo, mid)
    return lo


# -- headers: the expectation, from token lists only -------------------------------------------------
def expected_reuse(
    prompt: Sequence[int], retained: list[list[int]], *, opening: int, capacity: int, cap_tokens: int,
    shape: ReuseShape = BLOCKED,
) -> tuple[int, list[list[int]]]:
    """Prompt tokens a prefix cache should reuse for ``prompt``, and what it retains afterwards.

    A reference model of the documented contract over token lists
    (``retained`` oldest first): the entry with the longest common prefix
    wins (the most recent on ties); a match no longer than the template's
    ``opening`` is worth nothing (a new context while fewer than ``capacity``
    are retained, else the oldest is recycled). An entry is one context, so
    the request that reuses it takes it; afterwards the request's prompt (its
    first ``cap_tokens``) is retained and the oldest entries beyond
    ``capacity`` go. Reuse stops at the restore point and a retained prompt
    is cut to the body (``shape``, the lease's ``aner_nb.llm.reuse.ReuseShape``:
    the prompt's tail is always evaluated again, as the uncached run evaluates it).
    """
    lengths = [common_prefix_length(prompt, r) for r in retained]
    best = max(range(len(retained)), key=lambda i: (lengths[i], i), default=None)
    left = list(retained)
    if best is not None and lengths[best] > opening:
        reuse = shape.restore_point(lengths[best], len(prompt), len(retained[best]))
        del left[best]
    else:
        reuse = 0
        if len(left) >= capacity:
            del left[0]
    left.append(list(prompt[: shape.retained_rows(min(len(prompt), cap_tokens), len(prompt))]))
    return reuse, left[-capacity:]


def header_text(name: str, seed: int, entries: int, fact: str) -> str:
    """A long system header: an introduction, a ledger, one fact near the end, a closing line."""
    intro = {
        "A": "You are the night archivist of the harbor town. The ledger of the harbor office follows.",
        "B": "Acting as auditor for the tide mill company, check every sum against the mill accounts below.",
    }[name]
    return (f"{intro}\n\n{evidence(entries, seed)}\n\n{HEADER_FACT.format(fact)}\n"
            "Answer briefly and use the names as written.")


def headers_scenario(lease_of: Callable[..., Any], base: Any, s: Settings, threads: int) -> dict[str, Any]:
    capacity, cap_tokens = 2, 4 * s.header_tokens
    lease = lease_of(prefix_cache_entries=capacity, prefix_cache_tokens=cap_tokens)
    seeds, facts = {"A": 7, "B": 11}, {"A": ("Mira Okonkwo", "Kwame Brandt"), "B": ("Aiko Tanabe", "Yusuf Demir")}

    def messages(name: str, entries: int) -> list[dict[str, str]]:
        family, primed = name[0], name.endswith("'")
        header = header_text(family, seeds[family], entries, facts[family][int(primed)])
        return [{"role": "system", "content": header}, {"role": "user", "content": HEADER_QUESTION}]

    entries = {f: longest_fitting(lambda n, f=f: len(base.prompt_tokens(messages(f, n))), s.header_tokens)
               for f in ("A", "B")}
    opening = common_prefix_length(base.prompt_tokens("a"), base.prompt_tokens("b"))
    retained: list[list[int]] = []
    rows = []
    try:
        for turn, name in enumerate(s.pattern, 1):
            msgs = messages(name, entries[name[0]])
            tokens = base.prompt_tokens(msgs)
            expect, retained = expected_reuse(tokens, retained, opening=opening, capacity=capacity,
                                              cap_tokens=cap_tokens, shape=lease.reuse_shape)
            r = lease.chat(msgs, max_tokens=s.answer_tokens)
            rows.append({"turn": turn, "header": name, "prompt_tokens": r.usage.prompt_tokens,
                         "reused": r.usage.cached_input_tokens, "expected": expect,
                         "prefill_ms": r.timings.prompt_eval_duration / 1e6,
                         "first_token_ms": r.timings.first_token_duration / 1e6, "answer": r.text.strip()})
    finally:
        lease.close()
    print(f"\n## headers: 2 headers alternating, prefix cache {capacity} entries x {cap_tokens} tokens, "
          f"template opening {opening} tokens, threads {threads}")
    print("| turn | header | prompt tokens | reused tokens | expected reused | prefill ms | answer |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['turn']} | {r['header']} | {r['prompt_tokens']} | {r['reused']} | {r['expected']} | "
              f"{r['prefill_ms']:.0f} | {r['answer'][:40]!r} |")
    wrong = [r for r in rows if r["reused"] != r["expected"]]
    assert not wrong, f"reused tokens differ from the expectation: {wrong}"
    print("reuse assertion: every turn reused exactly the expected tokens")
    return {"capacity": capacity, "prefix_cache_tokens": cap_tokens, "template_opening": opening,
            "header_entries": entries, "turns": rows, "all_as_expected": not wrong}


# -- sweep ------------------------------------------------------------------------------------------
def ledger_messages(entries: int, question: str, seed: int = 1888) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{evidence(entries, seed)}\n\nQuestion: {question}"}]


def fit_reason(base: Any, target: int, max_tokens: int, context: int) -> str:
    """Why a prompt of ``target`` tokens cannot run here, or "" when it can."""
    f = base.facts
    if target > f.context_length:
        return f"above the model's trained context ({f.context_length} tokens)"
    if target > context:
        return f"above the loaded context ({context} tokens)"
    # The most a context of this size can hold: every layer at full length (a latency profile's full SWA cache).
    kv = llm.kv_estimate(target + max_tokens, f.layers, f.kv_heads, f.head_dim_k, f.head_dim_v, "f16")
    import psutil

    available = psutil.virtual_memory().available
    if kv > available // 2:
        return f"KV estimate {kv / 2**20:.0f} MiB above half the available memory ({available / 2**20:.0f} MiB)"
    return ""


def sweep_scenario(lease_of: Callable[..., Any], base: Any, s: Settings, threads: int) -> dict[str, Any]:
    lease = lease_of()
    fits, skipped = [], []
    for target in s.sweep_lengths:
        why = fit_reason(base, target, s.max_tokens, base.context)
        if why:
            skipped.append({"target": target, "reason": why})
            continue
        limit = min(target, base.context - s.max_tokens)
        n = longest_fitting(lambda k: len(base.prompt_tokens(ledger_messages(k, SWEEP_QUESTION))), limit)
        fits.append((target, ledger_messages(n, SWEEP_QUESTION)))
    rows = []
    try:
        if fits:  # warm-up, dropped: a short ledger, so a sweep of long prompts does not pay for one more
            short = longest_fitting(lambda k: len(base.prompt_tokens(ledger_messages(k, SWEEP_QUESTION))),
                                    min(512, fits[0][0]))
            lease.chat(ledger_messages(max(short, 1), SWEEP_QUESTION), max_tokens=s.max_tokens)
        for rnd in range(s.rounds):
            for target, msgs in (fits if rnd % 2 == 0 else list(reversed(fits))):
                r = lease.chat(msgs, max_tokens=s.max_tokens)
                t = r.timings
                rows.append({"target": target, "round": rnd, "prompt_tokens": r.usage.prompt_tokens,
                             "prefill_tok_s": t.evaluated_prompt_tokens / (t.prompt_eval_duration / 1e9),
                             "decode_tok_s": r.tokens_per_second(), "generated": r.usage.completion_tokens,
                             "first_token_ms": t.first_token_duration / 1e6, "threads": t.threads,
                             "prefill_threads": t.prefill_threads})
                last = rows[-1]
                print(f"# sweep round {rnd}: {last['prompt_tokens']} tokens, prefill {last['prefill_tok_s']:.1f} "
                      f"tok/s, decode {last['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        lease.close()
    table = []
    for target, _ in fits:
        mine = [r for r in rows if r["target"] == target]
        decode = [r["decode_tok_s"] for r in mine if r["decode_tok_s"] > 0]
        table.append({"target": target, "prompt_tokens": mine[0]["prompt_tokens"],
                      "generated": sorted({r["generated"] for r in mine}),
                      "prefill_tok_s": _median([r["prefill_tok_s"] for r in mine]),
                      "decode_tok_s": _median(decode) if decode else None,
                      "first_token_ms": _median([r["first_token_ms"] for r in mine])})
    print(f"\n## sweep: {s.rounds} rounds after one warm-up, greedy, up to {s.max_tokens} decode tokens, "
          f"threads {threads} (n_threads = n_threads_batch)")
    print("| target | prompt tokens | prefill tok/s median (min-max) | decode tok/s median (min-max) | "
          "first token ms median | generated |")
    print("|---|---|---|---|---|---|")

    def cell(m: dict[str, float] | None, digits: int = 1) -> str:
        return "-" if m is None else f"{m['median']:.{digits}f} ({m['min']:.{digits}f}-{m['max']:.{digits}f})"

    for t in table:
        print(f"| {t['target']} | {t['prompt_tokens']} | {cell(t['prefill_tok_s'])} | {cell(t['decode_tok_s'])} | "
              f"{t['first_token_ms']['median']:.0f} | {'/'.join(map(str, t['generated']))} |")
    for sk in skipped:
        print(f"| {sk['target']} | did not fit: {sk['reason']} | | | | |")
    return {"rows": rows, "table": table, "skipped": skipped, "warmup": 1 if fits else 0}


# -- retrieval --------------------------------------------------------------------------------------
def planted_document(entries: int, seed: int = 2024) -> str:
    """A ledger of ``entries`` lines with each fact inserted before the line at its depth."""
    lines = evidence(entries, seed).split("\n")
    for vault, code, depth in sorted(FACTS, key=lambda f: -f[2]):  # deepest first keeps earlier indices
        lines.insert(int(depth * len(lines)), f"The access code for vault {vault} is {code}.")
    return "\n".join(lines)


def retrieval_question(document: str, vault: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{document}\n\nQuestion: What is the access code for vault {vault}? "
                                        "Answer with the code only."}]


def retrieval_scenario(lease_of: Callable[..., Any], base: Any, s: Settings, threads: int) -> dict[str, Any]:
    results, skipped = [], []
    for target in s.retrieval_lengths:
        why = fit_reason(base, target, s.answer_tokens, base.context)
        if why:
            skipped.append({"target": target, "reason": why})
            continue
        limit = min(target, base.context - s.answer_tokens)
        n = longest_fitting(lambda k: len(base.prompt_tokens(retrieval_question(planted_document(k), "Q"))), limit)
        document = planted_document(n)
        for _, code, _ in FACTS:
            assert document.count(code) == 1, f"code {code} must appear only as its planted fact"
        lease = lease_of(prefix_cache_entries=1, prefix_cache_tokens=limit)
        answers = []
        try:
            for vault, code, depth in FACTS:
                r = lease.chat(retrieval_question(document, vault), max_tokens=s.answer_tokens)
                answers.append({"vault": vault, "depth": depth, "expected": code, "answer": r.text.strip(),
                                "correct": code in re.findall(r"\d+", r.text), "prompt_tokens": r.usage.prompt_tokens,
                                "cached_input_tokens": r.usage.cached_input_tokens,
                                "total_ms": r.timings.total_duration / 1e6})
                print(f"# retrieval {target}: vault {vault} -> {r.text.strip()[:30]!r}", file=sys.stderr, flush=True)
        finally:
            lease.close()
        results.append({"target": target, "prompt_tokens": answers[0]["prompt_tokens"],
                        "score": sum(a["correct"] for a in answers), "of": len(answers), "answers": answers})
    print(f"\n## retrieval: 3 facts at depths {', '.join(str(f[2]) for f in FACTS)}, greedy, "
          f"up to {s.answer_tokens} answer tokens, threads {threads}")
    print("| target | prompt tokens | score | answers (expected -> greedy answer) |")
    print("|---|---|---|---|")
    for res in results:
        detail = "; ".join(f"{a['vault']}@{a['depth']}: {a['expected']} -> {a['answer'][:24]!r}"
                           for a in res["answers"])
        print(f"| {res['target']} | {res['prompt_tokens']} | {res['score']}/{res['of']} | {detail} |")
    for sk in skipped:
        print(f"| {sk['target']} | did not fit: {sk['reason']} | | |")
    return {"results": results, "skipped": skipped, "facts": [list(f) for f in FACTS],
            "prompt_format": "one user turn: document, blank line, 'Question: What is the access code for vault "
                             "{V}? Answer with the code only.'; correct when the code is one of the answer's "
                             "digit runs"}


SCENARIOS = {"sweep": sweep_scenario, "headers": headers_scenario, "retrieval": retrieval_scenario}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke run for tests)")
    add_model_option(parser, GEMMA, "32K contexts and a sliding window")
    parser.add_argument("--chat-template", default=None, help="default: 'gemma' for gemma, else embedded")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                        else (os.cpu_count() or 1))
    parser.add_argument("--lengths", type=int, nargs="*", default=None, help="sweep prompt lengths (tokens)")
    parser.add_argument("--retrieval-lengths", type=int, nargs="*", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    s = QUICK if args.quick else FULL
    s = Settings(tuple(args.lengths or s.sweep_lengths), tuple(args.retrieval_lengths or s.retrieval_lengths),
                 s.header_tokens, args.rounds or s.rounds, s.max_tokens, s.answer_tokens, s.pattern)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    choice = resolve(args.model, args.chat_template)
    path, template = choice.path, choice.chat_template
    trained = llm.inspect_model(path).context_length
    needed = max([*(s.sweep_lengths if "sweep" in names else ()),
                  *(s.retrieval_lengths if "retrieval" in names else ()), 4 * s.header_tokens])
    context = min(trained, needed + s.max_tokens)
    base = llm.load(path, context=context, chat_template=template)

    def lease_of(**optimizer: Any) -> Any:
        return base.with_optimizer(threads=args.threads, prefill_threads=args.threads, **optimizer)

    probe = lease_of()
    manifest = bench.manifest(probe, benchmark="long_context", scenarios=names, quick=args.quick,
                              settings=s.__dict__ | {"pattern": list(s.pattern)}, chat_template=base.chat_template,
                              **manifest_fields(choice, base))
    probe.close()
    print(header(choice, base))
    print(f"model {base.name} sha256 {base.fingerprint}, context {base.context} (trained {trained}), "
          f"threads {args.threads}, load average {manifest['load_average']}")
    out: dict[str, Any] = {"manifest": manifest, "scenarios": {}}
    start = time.perf_counter()
    for name in names:
        out["scenarios"][name] = SCENARIOS[name](lease_of, base, s, args.threads)
        out["manifest"]["load_average_end"] = load_average()
        out["manifest"]["wall_s"] = round(time.perf_counter() - start, 1)
        print(f"\nload average after {name}: {out['manifest']['load_average_end']}, {out['manifest']['wall_s']} s",
              flush=True)
        if args.json:  # after every scenario, so a long run that is stopped keeps what it measured
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2, default=str)
    base.close()


if __name__ == "__main__":
    from aner_nb.bench import exclusive

    if "--quick" in sys.argv:  # a smoke run on a tiny fixture measures nothing and needs no exclusive machine
        main()
    else:
        with exclusive("bench_long_context"):  # one benchmark at a time: two would measure each other
            main()
