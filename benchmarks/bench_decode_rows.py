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

Run: ``python benchmarks/bench_decode_rows.py [--rows 1 2 3 4 8] [--rounds 6] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from aner_nb.demo_model import demo_model_path
from aner_nb.llm._engine import Batch, ContextParams, NativeContext, NativeModel, pairs_batch_columns, system_info
from aner_nb.llm.artifact import inspect_model, sha256_file

PROMPT = "Tell me a story about the sea, the harbour and the ships that come and go. " * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    path = str(demo_model_path())
    facts = inspect_model(path)
    model = NativeModel(path)
    # Sequence 0 stays empty for the padding row; a k-row step uses sequences 1..k. Ids are
    # consecutive, so llama.cpp runs each step as one micro-batch (as the scheduler arranges).
    n_seq = max(args.rows) + 1
    ctx = NativeContext(model, ContextParams(
        n_ctx=512 * n_seq, n_batch=512, n_ubatch=128, n_seq_max=n_seq, n_threads=args.threads,
        n_threads_batch=args.threads, kv_unified=False, flash_attention="auto",
    ))
    batch = Batch(512, 1)
    prompt = model.tokenize(PROMPT, add_special=True)
    for seq in range(1, n_seq):
        batch.clear()
        batch.add_run(prompt, 0, seq, logits_last=True)
        ctx.decode(batch)
    pos = len(prompt)

    configs = [(k, "all") for k in args.rows] + [(k, "one") for k in args.rows if k > 1]
    configs += [(k, "pad") for k in args.rows if k >= 3 and k % 2]
    times: dict[tuple[int, str], list[float]] = {c: [] for c in configs}
    token = 1000
    for _ in range(args.rounds):
        for k, mode in configs:
            for step in range(args.steps + 1):
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
    batch.free()
    ctx.free()
    model.free()


if __name__ == "__main__":
    from aner_nb.bench import exclusive

    with exclusive("bench_decode_rows"):  # one benchmark at a time: two would measure each other
        main()
