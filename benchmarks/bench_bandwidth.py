"""Plain greedy decoding against the physical limit: the bytes a decode step reads over the measured bandwidth.

For each round, in one process: the read bandwidth (``aner_nb.bench.bandwidth.read_bandwidth``, the
decoder's thread count, a 1 GiB buffer, best of 7 passes), then one plain greedy answer of ``--tokens``
tokens on an open-ended prompt nobody tuned (``n_threads = n_threads_batch = --threads``). The bytes a
step reads come from the GGUF's tensor table and the model's KV layout at the answer's mean position
(``decode_reads``). Reported: medians (min-max) over rounds of decode tok/s and bandwidth, the bound
``bandwidth / bytes per step`` in tok/s, and the achieved fraction (decode tok/s x bytes / bandwidth, per
round, then the median). Threads and the build's CPU features are printed first.

``--llama-bench PATH`` also runs llama.cpp's ``llama-bench`` of a build with the same CPU flags (its ``tg``
test: ``-p 0 -n TOKENS -r 1``, the same threads, flash attention as the lease resolved it, ``-d`` the answer's
prompt length so both decode over the same KV depth) in every round, the two in ABBA order after the
warm-up; reported: its tok/s and ours over it (ratio of medians, paired median).

Run: ``python benchmarks/bench_bandwidth.py [--model smollm2|gemma|PATH] [--threads 2] [--tokens 128]
[--rounds 5] [--llama-bench PATH] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from _models import SMOLLM2, add_model_option, header, manifest_fields, resolve

from aner_nb.bench import environment, exclusive
from aner_nb.bench.bandwidth import decode_reads, read_bandwidth, tensor_bytes
from aner_nb.llm.memory import kv_row_bytes

PROMPT = ("Write a few paragraphs about how a small coastal town changes over one year: the seasons, "
          "the people who arrive and leave, and what stays the same.")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def llama_bench_tg(binary: str, model_path: str, *, threads: int, tokens: int, depth: int, flash: str) -> float:
    """One ``llama-bench`` tg run (``-r 1``): its average tokens per second."""
    cmd = [binary, "-m", model_path, "-t", str(threads), "-p", "0", "-n", str(tokens), "-d", str(depth), "-r", "1",
           "-fa", flash, "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    rows = json.loads(out)
    return float(rows[0]["avg_ts"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_option(parser, SMOLLM2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--llama-bench", default=None, help="llama-bench binary: its tg beside ours, ABBA")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    choice = resolve(args.model)
    env = environment()
    print(f"cpu: {env['cpu']}; threads: n_threads = n_threads_batch = {args.threads}; "
          f"build: {env['system_info']}; load average {env['load_average']}")
    with exclusive("bench_bandwidth"), choice.load(context=2048, progress=False) as base:
        print(header(choice, base))
        model = base.with_optimizer(threads=args.threads, prefill_threads=args.threads)
        facts = base.facts
        heads = list(facts.kv_heads_per_layer) or [facts.kv_heads] * facts.layers
        per_cell = [h * (kv_row_bytes(facts.head_dim_k) + kv_row_bytes(facts.head_dim_v)) for h in heads]
        windows = [facts.sliding_window if il in facts.swa_layers else 0 for il in range(facts.layers)]
        tensors = tensor_bytes(str(choice.path))
        model.generate(PROMPT, max_tokens=16)  # warm-up: weights paged in, context created
        flash = model._params.flash_attention  # as requested: llama-bench resolves "auto" as llama.cpp does for us
        depth = len(model.prompt_tokens(PROMPT))
        rows = []
        for i in range(args.rounds):
            bw = read_bandwidth(args.threads)
            theirs = None
            if args.llama_bench and i % 2 == 1:  # ABBA: theirs first in odd rounds
                theirs = llama_bench_tg(args.llama_bench, str(choice.path), threads=args.threads, tokens=args.tokens,
                                        depth=depth, flash=flash)
            r = model.generate(PROMPT, max_tokens=args.tokens)
            if args.llama_bench and theirs is None:
                theirs = llama_bench_tg(args.llama_bench, str(choice.path), threads=args.threads, tokens=args.tokens,
                                        depth=depth, flash=flash)
            reads = decode_reads(tensors, vocab=facts.vocab_size, kv_bytes_per_cell=per_cell, windows=windows,
                                 positions=r.usage.prompt_tokens + len(r.tokens) // 2)
            tps = r.tokens_per_second()
            rows.append({"tok_s": tps, "bandwidth": bw.best, "bytes_per_step": reads.total,
                         "weights": reads.weights, "kv": reads.kv, "tied_output": reads.tied_output,
                         "fraction": tps * reads.total / bw.best, "tokens": len(r.tokens), "llama_bench_tok_s": theirs})
        model.close()
    step = statistics.median(r["bytes_per_step"] for r in rows)
    bandwidth = [r["bandwidth"] / 1e9 for r in rows]
    print(f"bytes per decode step: {step / 1e6:.1f} MB (weights {rows[0]['weights'] / 1e6:.1f} MB, "
          f"KV {rows[0]['kv'] / 1e6:.2f} MB, output tied to the embeddings: {rows[0]['tied_output']})")
    print(f"read bandwidth, {args.threads} threads: {spread(bandwidth)} GB/s")
    print(f"plain decode: {spread([r['tok_s'] for r in rows])} tok/s over {args.rounds} rounds of {args.tokens} tokens")
    print(f"bound (bandwidth / bytes per step): {spread([r['bandwidth'] / r['bytes_per_step'] for r in rows])} tok/s")
    print(f"achieved fraction of the bound: {spread([r['fraction'] for r in rows])}")
    if args.llama_bench:
        theirs = [r["llama_bench_tok_s"] for r in rows]
        ours = [r["tok_s"] for r in rows]
        paired = [a / b for a, b in zip(ours, theirs)]
        print(f"llama-bench tg ({args.tokens} tokens at depth {depth}, flash attention {flash}): "
              f"{spread(theirs)} tok/s; ours / llama-bench: ratio of medians "
              f"{statistics.median(ours) / statistics.median(theirs):.3f}, paired median {spread(paired)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, **manifest_fields(choice), "threads": args.threads, "rounds": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
