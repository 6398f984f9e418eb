"""Prefix cache on the demo model: time to first token, uncached vs cached, same outputs.

A ~1500-token evidence prefix is shared by 5 questions. The uncached side is
an ordinary lease (every request evaluates the whole prompt); the cached side
is ``with_optimizer(prefix_cache_entries=1)``, whose pool keeps the evidence
between questions. Sides alternate in ABBA order; one warm-up round is
dropped (it also fills the cache). Target: >= 30x faster first token cached.

``--model`` (see ``_models.py``) defaults to ``smollm2`` (SmolLM2-135M-Instruct): prefix reuse
holds for any model. ``--model gemma`` (Gemma 3 270M, whose sections of ``RESULTS.md`` predate the
option) measures it where the prefix is longer than the 512-token sliding window, on the full-size
sliding-window cache a latency lease creates.

Run: ``python benchmarks/bench_prefix.py [--model smollm2|gemma|PATH] [--rounds 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json

from _models import SMOLLM2, add_model_option, header, manifest_fields, resolve
from _workloads import QUESTIONS, evidence_of_tokens

from aner_nb import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json", default=None)
    add_model_option(parser, SMOLLM2)
    args = parser.parse_args()

    choice = resolve(args.model)
    model = choice.load(context=4096)
    print(header(choice, model), flush=True)
    cached = model.with_optimizer(prefix_cache_entries=1)
    text = evidence_of_tokens(model, args.prefix_tokens)
    cases = [bench.Case(f"q{i + 1}", f"{text}\n\nQuestion: {q}", args.max_tokens) for i, q in enumerate(QUESTIONS)]
    result = bench.run_sides(
        [bench.lease_side("uncached", model), bench.lease_side("cached", cached)], cases,
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
    model.close()


if __name__ == "__main__":
    from aner_nb.bench import exclusive

    with exclusive("bench_prefix"):  # one benchmark at a time: two would measure each other
        main()
