"""Check: greedy tokens from aner_nb equal llama-cpp-python's ``Llama`` on the demo model.

Same formatted prompt tokens, same context parameters (n_ctx, n_batch,
n_ubatch, threads, f16 KV, flash attention off/on, swa_full off), same token
budget. Exits non-zero on any difference.

``--model`` (see ``_models.py``) defaults to ``smollm2`` (SmolLM2-135M-Instruct, the demo
model): parity is not specific to a model. ``--model gemma`` checks Gemma 3 270M, whose
sliding-window layers both sides run with the window-sized cache (swa_full off).

Run: ``python benchmarks/check_parity_demo.py [--model smollm2|gemma|PATH] [--max-tokens 48]``.
"""

from __future__ import annotations

import argparse
import sys

import llama_cpp

from _models import SMOLLM2, add_model_option, header, resolve

PROMPTS = [
    "What is the capital of France?",
    "List three uses of a paperclip.",
    "Translate 'good morning' into Spanish and German.",
    "Explain in two sentences why the sky is blue.",
]


def reference(path: str, tokens: list[int], max_tokens: int, *, ctx: int, threads: tuple[int, int], flash: bool) -> list[int]:
    ref = llama_cpp.Llama(
        model_path=path, n_ctx=ctx, n_batch=512, n_ubatch=128, n_threads=threads[0], n_threads_batch=threads[1],
        flash_attn=flash, swa_full=False, type_k=llama_cpp.GGML_TYPE_F16, type_v=llama_cpp.GGML_TYPE_F16,
        n_gpu_layers=0, verbose=False,
    )
    try:
        out: list[int] = []
        for token in ref.generate(tokens, temp=0.0, repeat_penalty=1.0, reset=True):
            if llama_cpp.llama_vocab_is_eog(ref._model.vocab, token) or len(out) == max_tokens:
                break
            out.append(token)
        return out
    finally:
        ref.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--context", type=int, default=1024)
    add_model_option(parser, SMOLLM2)
    args = parser.parse_args()
    choice = resolve(args.model)
    path = choice.path
    failures = 0
    for flash in (False, True):
        with choice.load(context=args.context, flash_attention="on" if flash else "off") as model:
            if not flash:
                print(header(choice, model))
            print(f"{model!r} flash_attention={'on' if flash else 'off'}")
            for prompt in PROMPTS:
                response = model.generate(prompt, max_tokens=args.max_tokens)
                t = response.timings
                expected = reference(path, model.prompt_tokens(prompt), args.max_tokens, ctx=args.context,
                                     threads=(t.threads, t.prefill_threads), flash=flash)
                same = list(response.tokens) == expected
                failures += not same
                print(f"  {'same' if same else 'DIFFERENT'}: {len(expected)} tokens  {prompt!r} -> {response.text[:60]!r}")
    print("parity: OK" if not failures else f"parity: {failures} differences")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
