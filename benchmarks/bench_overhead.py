"""aner_nb vs llama-cpp-python on the demo model: decode speed and cold load time.

Two paired comparisons in one run, ABBA order, medians with min/max and the
ratio of medians:

1. Greedy decode tokens/s: ``model.stream(prompt)`` against
   ``Llama.create_completion(prompt_tokens, stream=True)`` with the same
   threads, context parameters, prompt tokens and token budget. Both sides
   are timed the same way from outside: from the first streamed chunk to the
   end of the stream, over the tokens generated after the first one (the
   first token belongs to the prompt evaluation). Target: ratio >= 1.0.
2. Load to first token, like for like: ``llm.load(path)`` (both SHA-256
   passes included) plus ``generate(max_tokens=1)`` against
   ``llama_cpp.Llama(model_path=...)`` plus ``create_completion(max_tokens=1)``,
   same context size, batch sizes, threads and flash-attention setting (each
   side builds a context and its compute graphs before the first token). The
   model file is in the page cache on both sides (the decode rounds read it
   first). Target: ratio <= 1.5.

The whole run holds the machine-wide benchmark lock (``bench.exclusive``) and
prints the threads and the build's CPU features.

``--model`` (see ``_models.py``) defaults to ``smollm2`` (SmolLM2-135M-Instruct): the library's
overhead is not specific to a model. The sections of ``RESULTS.md`` measured before the option
existed ran on Gemma 3 270M (``--model gemma``).

Run: ``python benchmarks/bench_overhead.py [--model smollm2|gemma|PATH] [--rounds 7] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import llama_cpp

from _models import SMOLLM2, add_model_option, header, manifest_fields, resolve

from aner_nb.bench import abba, compare, environment, exclusive, format_comparison

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    with exclusive("bench_overhead"):
        run()


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--json", default=None)
    add_model_option(parser, SMOLLM2)
    args = parser.parse_args()

    choice = resolve(args.model)
    path = choice.path
    model = choice.load(context=args.context, flash_attention="off")
    fingerprint = model.fingerprint
    print(header(choice, model), flush=True)
    # The default profile's threads (the engine default, same rule as Llama's) are given to both sides.
    probe = model.generate(PROMPT, max_tokens=1)
    threads, prefill_threads = probe.timings.threads, probe.timings.prefill_threads
    prompt_tokens = model.prompt_tokens(PROMPT)
    ref = llama_cpp.Llama(
        model_path=path, n_ctx=args.context, n_batch=512, n_ubatch=128, n_threads=threads,
        n_threads_batch=prefill_threads, flash_attn=False, swa_full=False, n_gpu_layers=0, verbose=False,
    )

    def ours(lease=model) -> float:
        s = lease.stream(PROMPT, max_tokens=args.max_tokens)
        first = None
        for _ in s:
            if first is None:
                first = time.perf_counter_ns()
        end = time.perf_counter_ns()
        n = s.response.timings.generated_tokens
        return (n - 1) * 1e9 / (end - first)

    ref_counts: list[int] = []

    def theirs() -> float:
        first = None
        count = 0
        # Forget the previous request so Llama evaluates the whole prompt, as aner_nb's ordinary lease
        # does (its own prefix reuse is also unreliable on SWA models without swa_full).
        ref.reset()
        for _ in ref.create_completion(prompt_tokens, max_tokens=args.max_tokens, temperature=0.0, stream=True):
            count += 1
            if first is None:
                first = time.perf_counter_ns()
        end = time.perf_counter_ns()
        ref_counts.append(count)
        # create_completion streams one chunk per generated token (it holds back only incomplete UTF-8)
        return (count - 1) * 1e9 / (end - first)

    ours(), theirs()  # warm both once
    a, b = abba(args.rounds, ours, theirs, ("aner_nb stream", "Llama.create_completion"))
    decode = compare(f"greedy decode tokens/s, {args.max_tokens} tokens, threads={threads}", a, b, "tok/s", higher_is_better=True)
    # Each round ran both sides back to back; the median of the per-round ratios cancels slow drift.
    decode["paired_ratio_median"] = statistics.median(x / y for x, y in zip(a.values, b.values))
    # The default threads against the old default (llama-cpp-python's rule: half the logical CPUs
    # for decode). Unequal threads on purpose: this measures what the default choice is worth.
    cpus = os.cpu_count() or 1
    old_rule = model.with_optimizer(threads=max(cpus // 2, 1), prefill_threads=cpus)
    ours(old_rule)
    na, nb = abba(args.rounds, ours, lambda: ours(old_rule),
                  (f"default threads {threads}/{prefill_threads}", f"old default {max(cpus // 2, 1)}/{cpus}"))
    defaults = compare("greedy decode tokens/s, new default threads vs the old default", na, nb, "tok/s",
                       higher_is_better=True)
    defaults["paired_ratio_median"] = statistics.median(x / y for x, y in zip(na.values, nb.values))
    old_rule.close()
    check = model.generate(PROMPT, max_tokens=args.max_tokens)
    ref.reset()
    ref_text = ref.create_completion(prompt_tokens, max_tokens=args.max_tokens, temperature=0.0)["choices"][0]["text"]
    same = check.text == ref_text
    ref.close()
    model.close()
    gc.collect()

    def load_ours() -> float:
        t0 = time.perf_counter_ns()
        m = choice.load(context=args.context, flash_attention="off")
        lease = m.with_optimizer(threads=threads, prefill_threads=prefill_threads)
        lease.generate(PROMPT, max_tokens=1)
        t = time.perf_counter_ns() - t0
        lease.close()
        m.close()
        return t / 1e6

    def load_theirs() -> float:
        t0 = time.perf_counter_ns()
        r = llama_cpp.Llama(
            model_path=path, n_ctx=args.context, n_batch=512, n_ubatch=128, n_threads=threads,
            n_threads_batch=prefill_threads, flash_attn=False, swa_full=False, n_gpu_layers=0, verbose=False,
        )
        r.create_completion(prompt_tokens, max_tokens=1, temperature=0.0)
        t = time.perf_counter_ns() - t0
        r.close()
        return t / 1e6

    load_ours(), load_theirs()
    la, lb = abba(args.rounds, load_ours, load_theirs, ("llm.load + first token", "Llama() + first token"))
    load = compare("load to first token (page cache warm), ms", la, lb, "ms", higher_is_better=False)

    env = environment()
    print(header(choice, fingerprint=fingerprint))
    print(f"threads {threads} / prefill threads {prefill_threads} on both sides; {env['cpu']}; {env['system_info']}")
    print(f"same greedy text as Llama.create_completion: {same}")
    print(format_comparison(decode))
    print(f"  median of per-round ratios: {decode['paired_ratio_median']:.3f}")
    print(format_comparison(load))
    print(format_comparison(defaults))
    print(f"  median of per-round ratios: {defaults['paired_ratio_median']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, **manifest_fields(choice, fingerprint=fingerprint), "threads": [threads, prefill_threads], "decode": decode, "load": load, "defaults": defaults, "same_text": same}, f, indent=2)


if __name__ == "__main__":
    main()
