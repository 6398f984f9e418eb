"""Agreement with llama-cpp-python / llama.cpp itself, for every admitted model family.

Greedy output equals llama-cpp-python's own ``Llama`` for the same prompt
tokens and settings: the test that proves the low-level runner drives
llama.cpp the way the library it wraps does (same formatted prompt tokens,
same context parameters: n_ctx, n_batch, n_ubatch, threads, KV type, flash
attention; same greedy choice), on a fixture of each family. The sliding
window that ``ModelFacts`` reports is the one llama.cpp applies, and the
built-in chat templates render what llama.cpp's own formatter of the same
name renders. This module is the one place besides ``test_artifact.py`` that
uses ``llama_cpp`` directly, as the reference.
"""

from __future__ import annotations

import ctypes

import pytest

from aner_nb import llm
from aner_nb.llm.chat import resolve_template
from fixtures.models import FAMILIES, write_tiny_model

llama_cpp = pytest.importorskip("llama_cpp")

CTX = 512
PROMPTS = [
    "the cat sat on the mat and",
    "Summarize: apples, pears and plums are fruit.",
    "héllo wörld ✓ — unicode in the prompt",
]


GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}


def reference_model(path, *, flash=False, n_threads=None, n_threads_batch=None, kv="f16"):
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=CTX,
        n_batch=512,
        n_ubatch=128,
        n_threads=n_threads,
        n_threads_batch=n_threads_batch,
        flash_attn=flash,
        swa_full=False,  # as ordinary aner_nb contexts
        type_k=GGML_TYPES[kv], type_v=GGML_TYPES[kv],  # as kv_cache_type
        n_gpu_layers=0,
        verbose=False,
    )


def greedy_tokens(ref, prompt_tokens, max_tokens):
    """``Llama.generate``'s greedy tokens for ``prompt_tokens``, up to ``max_tokens``, without the end token."""
    out = []
    for token in ref.generate(prompt_tokens, temp=0.0, repeat_penalty=1.0, reset=True):
        if llama_cpp.llama_vocab_is_eog(ref._model.vocab, token):
            break
        out.append(token)
        if len(out) == max_tokens:
            break
    return out


def reference_tokens(path, prompt_tokens, max_tokens, *, flash, n_threads, n_threads_batch, kv="f16"):
    ref = reference_model(path, flash=flash, n_threads=n_threads, n_threads_batch=n_threads_batch, kv=kv)
    try:
        return greedy_tokens(ref, prompt_tokens, max_tokens)
    finally:
        ref.close()


def assert_greedy_parity(path, *, flash, context=CTX, kv="f16", **load):
    with llm.load(path, context=context, flash_attention="on" if flash else "off", kv_cache_type=kv, **load) as model:
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
                kv=kv,
            )
            assert list(response.tokens) == expected, prompt
            assert len(expected) > 4  # a real comparison, not two empty outputs


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("flash", [False, True])
def test_greedy_tokens_equal_llama_cpp_python(fixture_models, family, flash):
    assert_greedy_parity(fixture_models[family], flash=flash)


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_quantized_kv_greedy_tokens_equal_llama_cpp_python(fixture_models, family, kv):
    """A quantized KV cache (flash attention on: llama.cpp stores a quantized V only through it)."""
    assert_greedy_parity(fixture_models[family], flash=True, kv=kv)


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_quantized_kv_on_the_demo_model_equals_llama_cpp_python(kv):
    """The real demo model (gemma3, sliding window) with a quantized KV cache, against ``Llama``."""
    from aner_nb.demo_model import GEMMA_CHAT_TEMPLATE, gemma_model_path

    assert_greedy_parity(gemma_model_path(), flash=True, kv=kv, chat_template=GEMMA_CHAT_TEMPLATE)


def test_quantized_kv_is_refused_at_load_when_heads_do_not_fill_whole_blocks(tmp_path):
    path = write_tiny_model(tmp_path / "h16.gguf", "llama", n_embd=64, n_head=4, n_head_kv=1, head_dim=16)
    with pytest.raises(llm.errors.ConfigurationError, match=r"q8_0.*K heads.*head_dim 16.*block size 32") as info:
        llm.load(path, context=CTX, kv_cache_type="q8_0")
    assert info.value.param == "kv_cache_type"
    with llm.load(path, context=CTX) as model:  # f16 stores any head size
        assert model.generate("hello", max_tokens=2).finish_reason in ("stop", "length")


def test_a_quantized_kv_cache_is_smaller_in_the_memory_summary(fixture_models):
    sizes = {}
    for kv in ("f16", "q8_0", "q4_0"):
        with llm.load(fixture_models["llama"], context=CTX, kv_cache_type=kv, flash_attention="on") as model:
            sizes[kv] = model.memory_summary().kv_bytes
            facts = model.facts
            assert sizes[kv] == llm.kv_estimate(CTX, facts.layers, facts.kv_heads, facts.head_dim_k, facts.head_dim_v, kv)
    assert sizes["f16"] > sizes["q8_0"] > sizes["q4_0"]


def test_phi3_long_rope_factors_greedy_parity(tmp_path):
    """Phi-3 128k files carry LongRoPE factors; a context above the original one uses the long set."""
    path = write_tiny_model(tmp_path / "phi3-long.gguf", "phi3", rope_original_context=256)
    assert_greedy_parity(path, flash=False)


# -- the facts llama.cpp agrees with -----------------------------------------------------------
def native_window(path):
    ref = reference_model(path)
    try:
        return llama_cpp.llama_model_n_swa(ref._model.model)
    finally:
        ref.close()


@pytest.mark.parametrize(
    "family, config, window",
    [
        ("llama", {}, 0),
        ("llama", {"metadata": {"llama.attention.sliding_window": 64}}, 0),  # llama.cpp ignores the key
        ("mistral", {}, 0),
        ("qwen2", {}, 0),
        ("qwen3", {}, 0),
        ("gemma2", {}, 32),
        ("gemma2", {"sliding_window": 0}, 4096),  # not written: llama.cpp's Gemma 2 default
        ("gemma3", {}, 32),
        ("gemma3", {"sliding_window": 0}, 0),  # not written: no sliding-window layers
        ("phi3", {}, 0),  # declared (48) but disabled by llama.cpp
    ],
)
def test_sliding_window_fact_is_the_one_llama_cpp_applies(tmp_path, family, config, window):
    path = write_tiny_model(tmp_path / f"{family}.gguf", family, **config)
    assert llm.inspect_model(path).sliding_window == native_window(path) == window


# -- built-in templates against llama.cpp's own formatter --------------------------------------
def llama_cpp_format(name, messages, add_generation_prompt=True):
    """llama.cpp's built-in chat format ``name`` (llama_chat_apply_template, no model needed)."""
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
    chat = (llama_cpp.llama_chat_message * len(keep))(*(llama_cpp.llama_chat_message(r, c) for r, c in keep))
    size = 4096
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(keep), add_generation_prompt, buf, size)
    assert 0 < n <= size, n
    return buf.raw[:n].decode()


TWO_TURNS = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
]
WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, *TWO_TURNS]


@pytest.mark.parametrize(
    "builtin, reference, bos, conversations",
    [
        ("chatml", "chatml", "", [TWO_TURNS, WITH_SYSTEM]),
        ("gemma", "gemma", "<bos>", [TWO_TURNS, WITH_SYSTEM]),
        ("llama3", "llama3", "<|begin_of_text|>", [TWO_TURNS, WITH_SYSTEM]),
        ("phi3", "phi3", "", [TWO_TURNS, WITH_SYSTEM]),
        # llama.cpp formats Mistral's official [INST] template as its "llama2" format; it places a
        # system message differently from Mistral's v1 format, so only system-less turns compare.
        ("mistral", "llama2", "<s>", [TWO_TURNS]),
    ],
)
def test_builtin_template_renders_what_llama_cpp_formats(builtin, reference, bos, conversations):
    template = resolve_template(builtin, None, bos_token=bos, eos_token="</s>")
    for messages in conversations:
        # llama.cpp's formats leave BOS to the tokenizer; the built-ins write it
        assert template.render(messages) == bos + llama_cpp_format(reference, messages)
