"""Greedy output equals llama-cpp-python's own ``Llama`` for the same prompt tokens and settings.

This is the test that proves the low-level runner drives llama.cpp the way
the library it wraps does: same formatted prompt tokens, same context
parameters (n_ctx, n_batch, n_ubatch, threads, KV type, flash attention),
same greedy choice. It is the one place besides ``test_artifact.py`` that
uses ``llama_cpp`` directly, as the reference.
"""

from __future__ import annotations

import pytest

from aner_nb import llm

llama_cpp = pytest.importorskip("llama_cpp")

CTX = 512
PROMPTS = [
    "the cat sat on the mat and",
    "Summarize: apples, pears and plums are fruit.",
    "héllo wörld ✓ — unicode in the prompt",
]


def reference_tokens(path, prompt_tokens, max_tokens, *, flash, n_threads, n_threads_batch):
    ref = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=CTX,
        n_batch=512,
        n_ubatch=128,
        n_threads=n_threads,
        n_threads_batch=n_threads_batch,
        flash_attn=flash,
        swa_full=False,  # as ordinary aner_nb contexts
        type_k=1, type_v=1,  # GGML_TYPE_F16, as kv_cache_type="f16"
        n_gpu_layers=0,
        verbose=False,
    )
    try:
        out = []
        for token in ref.generate(prompt_tokens, temp=0.0, repeat_penalty=1.0, reset=True):
            if llama_cpp.llama_vocab_is_eog(ref._model.vocab, token):
                break
            out.append(token)
            if len(out) == max_tokens:
                break
        return out
    finally:
        ref.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("flash", [False, True])
def test_greedy_tokens_equal_llama_cpp_python(fixture_models, arch, flash):
    path = fixture_models[arch]
    with llm.load(path, context=CTX, flash_attention="on" if flash else "off") as model:
        timings = None
        for prompt in PROMPTS:
            response = model.generate(prompt, max_tokens=24)
            timings = response.timings
            expected = reference_tokens(
                path,
                model.prompt_tokens(prompt),
                24,
                flash=flash,
                n_threads=timings.threads,
                n_threads_batch=timings.prefill_threads,
            )
            assert list(response.tokens) == expected, prompt
            assert len(expected) > 4  # a real comparison, not two empty outputs
