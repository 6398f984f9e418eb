"""``model.map`` over a DataFrame against the loop a user would write: rows per second, paired.

``--model`` (default ``smollm2``, SmolLM2-135M-Instruct; ``gemma`` or a GGUF path:
see ``_models.py``): nothing here depends on sliding-window attention or the vocabulary.

``--rows`` (64) rows, each a short question (the eight topics of ``_workloads.TOPICS``
under eight framings written for this benchmark, not tuned on it) answered in at most
``--max-tokens`` (48) greedy tokens. Two sides, alternated ABBA over ``--rounds``
after one warm-up run of each:

- ``loop``: ``[lease.generate(prompt, max_tokens=N) for prompt in frame.text]`` on an
  ordinary lease, the Python loop a notebook user writes first;
- ``map``: ``lease.with_batching(--sequences).map(frame, "{text}", max_tokens=N)``.

Both sides' contexts run every ``llama_decode`` with the same ``n_threads`` and
``n_threads_batch`` (``--threads``, default the physical cores), the same context
per request (``--context`` / ``--sequences`` cells for both) and batch size.
Reported: rows per second (median, min, max over rounds), the map/loop ratio of
medians and the median of the per-round ratios, and how many answers are identical
text (greedy; a batched step sums in another order, so a near tie may flip).
Target (issue 29): map >= 1.5x the loop's rows per second, the same answers.

Run: ``python benchmarks/bench_map.py [--rounds 3] [--rows 64] [--json out.json]``.
Smoke: ``python benchmarks/bench_map.py --rounds 1 --rows 4 --max-tokens 4``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _models import SMOLLM2, add_model_option, header, manifest_fields, resolve
from _workloads import TOPICS

from aner_nb import bench
from aner_nb.llm import system_info

FRAMINGS = [
    "{q}", "Answer in one sentence: {q}", "Explain to a child: {q}", "Give two facts. {q}",
    "Briefly: {q}", "A student asks: {q}", "In plain words, {q}", "Quick question - {q}",
]


def rows(n: int):
    import pandas as pd

    texts = [FRAMINGS[(i // len(TOPICS)) % len(FRAMINGS)].format(q=TOPICS[i % len(TOPICS)]) for i in range(n)]
    return pd.DataFrame({"text": texts})


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_loop(lease, frame, max_tokens: int) -> tuple[float, list[str]]:
    start = time.perf_counter()
    answers = [lease.generate(text, max_tokens=max_tokens).text for text in frame["text"]]
    return len(frame) / (time.perf_counter() - start), answers


def run_map(lease, frame, max_tokens: int) -> tuple[float, list[str]]:
    start = time.perf_counter()
    out = lease.map(frame, "{text}", max_tokens=max_tokens, progress=False)
    elapsed = time.perf_counter() - start
    assert (out["error"] == "").all(), out.loc[out["error"] != "", "error"].tolist()
    return len(frame) / elapsed, list(out["answer"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096, help="the batching lease's context, split by --sequences")
    parser.add_argument("--threads", type=int, default=system_info().cpu_count_physical)
    parser.add_argument("--json", default=None)
    add_model_option(parser, SMOLLM2)
    args = parser.parse_args()

    choice = resolve(args.model)
    per_request = args.context // args.sequences
    base = choice.load(context=args.context, progress=False)
    print(header(choice, base), flush=True)
    engine = dict(threads=args.threads, prefill_threads=args.threads)
    loop = base.with_optimizer(**engine)
    loop_lease = choice.load(context=per_request, progress=False).with_optimizer(**engine)  # the same cells per request
    batched = loop.with_batching(args.sequences)
    frame = rows(args.rows)
    env = bench.environment()
    print(f"threads {args.threads} (n_threads = n_threads_batch, both sides); context per request {per_request}; "
          f"cpu {env['cpu']}; build {env['system_info']}", flush=True)
    sides = {"loop": lambda: run_loop(loop_lease, frame, args.max_tokens),
             "map": lambda: run_map(batched, frame, args.max_tokens)}
    rates: dict[str, list[float]] = {"loop": [], "map": []}
    answers: dict[str, list[str]] = {}
    with bench.exclusive("bench_map"):
        for side in sides:  # warm-up, not counted
            sides[side]()
        for r in range(args.rounds):
            order = ["loop", "map"] if r % 2 == 0 else ["map", "loop"]
            for side in order:
                rate, answers[side] = sides[side]()
                rates[side].append(rate)
                print(f"round {r + 1} {side}: {rate:.2f} rows/s", flush=True)
    paired = [m / lo for m, lo in zip(rates["map"], rates["loop"])]
    identical = sum(a == b for a, b in zip(answers["loop"], answers["map"]))
    result = {
        "rows": args.rows, "max_tokens": args.max_tokens, "sequences": args.sequences, "threads": args.threads,
        "rows_per_s": {side: summarize(v) for side, v in rates.items()},
        "ratio": statistics.median(rates["map"]) / statistics.median(rates["loop"]),
        "paired_ratio": summarize(paired),
        "identical_answers": identical,
        "differing_rows": [i for i, (a, b) in enumerate(zip(answers["loop"], answers["map"])) if a != b],
    }
    s = result["rows_per_s"]
    print(f"loop {s['loop']['median']:.2f} rows/s ({s['loop']['min']:.2f}-{s['loop']['max']:.2f}), "
          f"map {s['map']['median']:.2f} ({s['map']['min']:.2f}-{s['map']['max']:.2f}): "
          f"{result['ratio']:.2f}x (paired median {result['paired_ratio']['median']:.2f}x); "
          f"identical answers {identical} of {args.rows}", flush=True)
    if args.json:
        manifest = bench.manifest(loop, rounds=args.rounds, **manifest_fields(choice, base))
        with open(args.json, "w") as f:
            json.dump({"manifest": manifest, "result": result}, f, indent=2)
    batched.close()
    loop.close()
    loop_lease.close()
    base.close()


if __name__ == "__main__":
    main()
