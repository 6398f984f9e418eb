"""Check: greedy tokens from aner_nb equal llama-cpp-python's ``Llama`` on the demo model.

Same formatted prompt tokens, same context parameters (n_ctx, n_batch,
n_ubatch, threads, f16 KV, flash attention off/on, swa_full off), same token
budget. Exits non-zero on any difference.

Run: ``python benchmarks/check_parity_demo.py [--max-tokens 48]``.
"""

from __future__ import annotations

import argparse
import sys

import llama_cpp

from aner_nb import llm
from aner_nb.demo_model import DEMO_CHAT_TEMPLATE, demo_model_path

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
    args = parser.parse_args()
    path = str(demo_model_path())
    failures = 0
    for flash in (False, True):
        with llm.load(path, context=args.context, chat_template=DEMO_CHAT_TEMPLATE, flash_attention="on" if flash else "off") as model:
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
