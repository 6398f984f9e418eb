"""The engine fact behind exact prefix reuse (``aner_nb/llm/reuse.py``), checked bitwise on a real model.

For each restore point ``P`` it compares, logit for logit, two ways of
reaching the same prompt of ``n`` tokens:

- cold: the whole prompt prefilled from position 0, then 16 greedy decode
  steps;
- cached: an earlier request (``prompt[:P]`` plus ``--extra`` other tokens)
  prefilled, its positions from ``P`` removed (``llama_memory_seq_rm``), the
  tail ``prompt[P:]`` prefilled, then the same 16 steps.

and prints the largest absolute logit difference over the last prompt row and
every step (``0`` is bitwise equal). ``--chunks ours`` splits every prefill
with ``runner.prefill_chunks`` as a prefix-cache lease of the model does (its
``reuse.ReuseShape``: the prompt's tail a call of its own, body micro-batches
of whole row blocks, the last at least ``reuse.MIN_ROWS`` rows), so a restore
point the shape allows is exact; with ``--chunks blocks`` (the 4-row shape
whatever the model, no separate tail) a restore point off a multiple of
``reuse.ROW_BLOCK`` shows the gemm/gemv split of repacked weights (Gemma); ``--chunks plain`` uses llama.cpp's own
split (calls of ``n_batch``, micro-batches of ``n_ubatch`` from each call's
start), which shows which tails round differently. ``--flash-attention on``
shows why a prefix-cache lease turns it off on a CPU.

Run: ``python benchmarks/check_reuse_shapes.py --model gemma --flash-attention off --chunks plain
--tails 10,14,58,130,11,13 --extra 0,37``. Not a benchmark: it times nothing.
"""

from __future__ import annotations

import argparse
import functools
import os

import numpy as np

from _models import SMOLLM2, add_model_option, header, resolve
from _workloads import QUESTIONS, evidence_of_tokens

from aner_nb.llm import _engine
from aner_nb.llm.requests import context_params
from aner_nb.llm.runner import prefill_chunks

STEPS = 16


def plain_chunks(start: int, end: int, n_batch: int, n_ubatch: int) -> list[tuple[int, int]]:
    """llama.cpp's split left alone: calls of ``n_batch`` tokens."""
    return [(lo, min(lo + n_batch, end)) for lo in range(start, end, n_batch)]


def evaluate(ctx, batch, tokens, start, chunks) -> np.ndarray:
    """Prefill ``tokens[start:]`` over ``chunks``; the last row's logits, copied."""
    for lo, hi in chunks:
        batch.clear()
        batch.add_run(tokens[lo:hi], lo, 0, logits_last=hi == len(tokens))
        if ctx.decode(batch) != 0:
            raise SystemExit(f"no KV slot for {lo}..{hi}")
    return ctx.logits(batch.n_tokens - 1).copy()


def steps(ctx, batch, n: int, first: np.ndarray) -> list[np.ndarray]:
    """``STEPS`` greedy decode steps after a prompt of ``n`` tokens: every step's logits."""
    out, logits = [first], first
    for i in range(STEPS):
        batch.clear()
        batch.add(int(np.argmax(logits)), n + i, 0, logits=True)
        ctx.decode(batch)
        logits = ctx.logits(0).copy()
        out.append(logits)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser, SMOLLM2)
    parser.add_argument("--flash-attention", choices=("on", "off"), default="off")
    parser.add_argument("--chunks", choices=("ours", "blocks", "plain"), default="ours")
    parser.add_argument("--tails", default="1,2,4,7,8,16,57,132", help="prompt tokens evaluated after the restore point")
    parser.add_argument("--extra", default="0,34,300", help="tokens the earlier request had past the restore point")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--ubatch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    threads = args.threads or (os.cpu_count() or 1)
    choice = resolve(args.model)
    with choice.load(context=4096, flash_attention=args.flash_attention) as model:
        print(header(choice, model), flush=True)
        prompt = f"{evidence_of_tokens(model, 1600, seed=1889)}\n\nQuestion: {QUESTIONS[1]}"
        tokens = list(model.prompt_tokens(prompt))
        other = list(model.prompt_tokens(evidence_of_tokens(model, 400, seed=7)))
        n = len(tokens)
        with model.with_optimizer(threads=threads, prefill_threads=threads) as lease:
            params = context_params(lease._weights, lease.profile, swa_full=True)
        params = _engine.ContextParams(**{**params.__dict__, "n_batch": args.batch, "n_ubatch": args.ubatch,
                                          "flash_attention": args.flash_attention})
        split = {
            "ours": functools.partial(prefill_chunks, reuse=lease._weights.reuse_shape),
            "blocks": prefill_chunks,
            "plain": plain_chunks,
        }[args.chunks]
        print(f"prompt {n} tokens; n_batch {args.batch}, n_ubatch {args.ubatch}, threads {threads}, "
              f"flash attention {args.flash_attention}, chunks {args.chunks}, swa_full", flush=True)
        native = lease._weights.native
        ctx = _engine.NativeContext(native, params)
        batch = _engine.Batch(args.batch)
        try:
            cold = steps(ctx, batch, n, evaluate(ctx, batch, tokens, 0, split(0, n, args.batch, args.ubatch)))
            for tail in (int(t) for t in args.tails.split(",")):
                p = n - tail
                for extra in (int(e) for e in args.extra.split(",")):
                    earlier = tokens[:p] + other[:extra]
                    ctx.clear()
                    evaluate(ctx, batch, earlier, 0, split(0, len(earlier), args.batch, args.ubatch))
                    if not ctx.seq_rm(0, p, -1):
                        raise SystemExit(f"seq_rm({p}) failed")
                    warm = steps(ctx, batch, n, evaluate(ctx, batch, tokens, p, split(p, n, args.batch, args.ubatch)))
                    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(cold, warm))
                    print(f"tail {tail:4d} (P={p}) extra {extra:4d}: max |logit difference| {diff:.6g}"
                          f"{'  exact' if diff == 0 else ''}", flush=True)
        finally:
            ctx.free()
            batch.free()


if __name__ == "__main__":
    main()
