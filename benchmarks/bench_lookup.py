"""Prompt-lookup speculation on the demo model: decode speed off vs on, and llama-cpp-python's own.

Three tasks: copy-heavy (quote and summarize an evidence ledger using its
original names and terms), low-overlap free writing (the small base model
still repeats itself there), and counting, the adversarial low-overlap case
whose proposals the model keeps rejecting. Four sides, ABBA
order, one warm-up round dropped:

- ``off``: plain greedy decoding, ``with_optimizer(threads=T, prefill_threads=T)``;
- ``on``: ``with_optimizer(threads=T, prefill_threads=T, speculative_tokens=N)``;
- ``llama``: llama-cpp-python's ``Llama.create_completion`` (plain);
- ``llama+lookup``: the same with ``draft_model=LlamaPromptLookupDecoding(num_pred_tokens=N)``.

aner_nb sides report their own decode timing (first token to last);
llama-cpp-python sides are timed from outside over the stream (first chunk to
end), so compare ``on/off`` with each other and ``llama+lookup/llama`` with
each other. Targets: ``on/off`` >= 2.0x on the copy-heavy task and >= 0.95x on
the low-overlap tasks. Outputs are compared with the plain greedy output.

Every side gets the same ``T`` for one-token decodes and for batches
(llama.cpp runs a verification batch on ``n_threads_batch``; unequal counts
would hand speculation more threads than the decoding it is compared with).
``T`` defaults to the logical CPUs; the run holds the benchmark lock.

``--model`` (see ``_models.py``) defaults to ``smollm2`` (SmolLM2-135M-Instruct): prompt lookup
is not specific to an attention layout or vocabulary. The targets above were set, and the
sections of ``RESULTS.md`` measured, on Gemma 3 270M (``--model gemma``); on SmolLM2 the
speculative side saves forward calls but gains little or no decode speed, so expect the
copy-heavy target not to be met there.

Run: ``python benchmarks/bench_lookup.py [--model smollm2|gemma|PATH] [--rounds 3] [--speculative-tokens 16]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from _models import SMOLLM2, add_model_option, header, manifest_fields, resolve
from _workloads import evidence

from aner_nb import bench, llm


def llama_side(name: str, ref: llama_cpp.Llama, model: llm.LLMModel) -> bench.Side:
    def run(case: bench.Case) -> dict:
        tokens = model.prompt_tokens(case.prompt)
        ref.reset()  # evaluate the whole prompt, like the ordinary lease
        first, chunks, text = None, 0, []
        for chunk in ref.create_completion(tokens, max_tokens=case.max_tokens, temperature=0.0, stream=True):
            chunks += 1
            text.append(chunk["choices"][0]["text"])
            if first is None:
                first = time.perf_counter_ns()
        end = time.perf_counter_ns()
        out = "".join(text)
        return {"decode_tokens_per_s": (chunks - 1) * 1e9 / (end - first) if chunks > 1 else float("nan"),
                "completion_tokens": chunks, "text": out, "output_hash": str(hash(out)), "tokens": ()}

    return bench.Side(name, run)


def main() -> None:
    with bench.exclusive("bench_lookup"):
        run()


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--speculative-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="T for every side (default: logical CPUs)")
    parser.add_argument("--json", default=None)
    add_model_option(parser, SMOLLM2)
    args = parser.parse_args()
    n = args.speculative_tokens

    choice = resolve(args.model)
    path = choice.path
    threads = args.threads or (os.cpu_count() or 1)
    base = choice.load(context=1024, flash_attention="off")
    print(header(choice, base), flush=True)
    model = base.with_optimizer(threads=threads, prefill_threads=threads)
    spec = base.with_optimizer(threads=threads, prefill_threads=threads, speculative_tokens=n)
    probe = model.generate("x", max_tokens=1).timings
    assert (probe.threads, probe.prefill_threads) == (threads, threads)
    common = dict(model_path=path, n_ctx=1024, n_batch=512, n_ubatch=128, n_threads=threads,
                  n_threads_batch=threads, flash_attn=False, swa_full=False, n_gpu_layers=0, verbose=False)
    ref = llama_cpp.Llama(**common)
    # llama-cpp-python 0.3.36 sizes its score buffer from the logits_all argument while a draft
    # model switches logits_all on internally: pass it explicitly or prompts > n_batch crash.
    ref_lookup = llama_cpp.Llama(**common, logits_all=True, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=n))

    ledger = evidence(12)
    tasks = {
        "copy-heavy": [bench.Case("copy", "Quote the ledger below line by line, keeping every name, place and sum, "
                                          f"then summarize it using its original names and terms.\n\n{ledger}",
                                  args.max_tokens)],
        "low-overlap": [bench.Case("free", "Write a short poem about the sea at night, with new images in every line.",
                                   args.max_tokens)],
        # Counting repeats ", " constantly but never the digits after it: n-gram matches keep
        # proposing continuations the model rejects, the worst case for prompt lookup.
        "counting": [bench.Case("count", "Count upward from 1 to 200, separated by commas: 1, 2, 3,", args.max_tokens)],
    }
    report = {"manifest": bench.manifest(spec, benchmark="lookup", **manifest_fields(choice, base)), "tasks": {}}
    env = report["manifest"]
    print(f"model {model.name} sha256 {model.fingerprint} speculative_tokens={n} "
          f"threads={threads} prefill_threads={threads} (every side)")
    print(f"{env['cpu']}; {env['system_info']}")
    for task, cases in tasks.items():
        result = bench.run_sides(
            [bench.lease_side("off", model), bench.lease_side("on", spec),
             llama_side("llama", ref, model), llama_side("llama+lookup", ref_lookup, model)],
            cases, rounds=args.rounds, warmup=1, baseline="off",
        )
        f = result.frame
        on = f[f.side == "on"]
        acceptance = on.speculative_accepted.sum() / max(on.speculative_proposed.sum(), 1)
        speedup = result.ratio("on", "decode_tokens_per_s")
        llama_speedup = float(f[f.side == "llama+lookup"].decode_tokens_per_s.median()
                              / f[f.side == "llama"].decode_tokens_per_s.median())
        off_text = f[f.side == "off"].text.iloc[0]
        same_on = bool((result.same_outputs("on")).all())
        same_llama_lookup = f[f.side == "llama+lookup"].text.iloc[0] == f[f.side == "llama"].text.iloc[0]
        print(f"\n== {task} ==")
        print(result.summary(("decode_tokens_per_s", "decode_ms", "completion_tokens")).to_string(index=False))
        print(f"on/off decode speedup: {speedup:.2f}x   acceptance {acceptance:.1%} "
              f"({int(on.speculative_accepted.sum())}/{int(on.speculative_proposed.sum())})   same output as off: {same_on}")
        print(f"llama+lookup/llama decode speedup: {llama_speedup:.2f}x   same output as plain Llama: {same_llama_lookup}")
        print(f"llama text equals aner_nb off text: {f[f.side == 'llama'].text.iloc[0] == off_text}")
        if not same_on:
            a = f[f.side == "off"].tokens.iloc[0]
            b = on.tokens.iloc[0]
            print(f"  divergence: {bench.divergence(model, cases[0].prompt, a, b, shape=bench.BatchShape.verification(n))}")
        report["tasks"][task] = {"speedup_on_off": speedup, "acceptance": acceptance, "same_on": same_on,
                                 "speedup_llama_lookup": llama_speedup, "same_llama_lookup": same_llama_lookup,
                                 "summary": result.summary(("decode_tokens_per_s",)).to_dict("records")}
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2, default=str)
    for r in (ref, ref_lookup):
        r.close()
    spec.close()
    model.close()
    base.close()


if __name__ == "__main__":
    main()
