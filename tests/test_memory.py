"""KV arithmetic against the formula written out by hand (DESIGN.md "Memory"), and against llama.cpp.

The hand-written figures follow llama.cpp's allocation rules in the pinned
llama-cpp-python 0.3.36 (``llama-context.cpp``: n_ctx padded to 256 cells,
per-sequence streams; ``llama-kv-cache-iswa.cpp``: the sliding-window cache).
The engine tests compare the estimate with the KV buffers llama.cpp itself
reported allocating for a fresh context (``NativeContext.kv_buffers``).
"""

import pytest
from hypothesis import given, strategies as st

from aner_nb import llm
from aner_nb.llm import _engine, kv_estimate
from aner_nb.llm.engine_log import kv_buffers
from aner_nb.llm.artifact import inspect_model
from aner_nb.llm.errors import ConfigurationError
from fixtures.models import write_tiny_model
from aner_nb.llm.memory import (
    KV_CACHE_TYPES, kv_caches, kv_caches_for, kv_cells, kv_row_bytes, sliding_window_layers,
)


def test_f16_rows_are_two_bytes_per_element():
    # 4096 ctx x 32 layers x 8 kv heads x (128*2 + 128*2) bytes = 512 MiB (Llama-3-8B at f16)
    assert kv_estimate(4096, 32, 8, 128, 128, "f16") == 4096 * 32 * 8 * 512 == 512 * 2**20


def test_q8_0_is_34_bytes_per_32_elements():
    assert kv_row_bytes(128, "q8_0") == 4 * 34
    assert kv_estimate(1024, 2, 4, 64, 64, "q8_0") == 1024 * 2 * 4 * (2 * 34 + 2 * 34)


def test_q4_0_is_18_bytes_per_32_elements():
    assert kv_row_bytes(256, "q4_0") == 8 * 18
    assert kv_estimate(512, 18, 1, 256, 256, "q4_0") == 512 * 18 * 1 * (8 * 18 * 2)


def test_k_and_v_head_dims_may_differ():
    # e.g. MLA-style models: K rows of 192, V rows of 128 elements; 100 cells are padded to 256
    assert kv_estimate(100, 3, 2, 192, 128, "f16") == 256 * 3 * 2 * (192 * 2 + 128 * 2)
    assert kv_estimate(100, 3, 2, 192, 128, "q8_0") == 256 * 3 * 2 * (6 * 34 + 4 * 34)


@pytest.mark.parametrize(
    "args, needle",
    [
        ((0, 1, 1, 32, 32, "f16"), "context"),
        ((1, -1, 1, 32, 32, "f16"), "layers"),
        ((1, 1, 1, 32, 32, "q5_1"), "kv_cache_type"),
        ((1, 1, 1, 48, 32, "q4_0"), "multiple"),
        ((1, 1, True, 32, 32, "f16"), "kv_heads"),
    ],
)
def test_bad_inputs_name_the_field(args, needle):
    with pytest.raises(ConfigurationError, match=needle):
        kv_estimate(*args)


@given(
    ctx=st.integers(1, 256).map(lambda n: 256 * n),
    layers=st.integers(1, 128),
    heads=st.integers(1, 64),
    blocks=st.integers(1, 8),
)
def test_quantized_types_are_smaller_than_f16_and_linear_in_context(ctx, layers, heads, blocks):
    dim = 32 * blocks
    f16 = kv_estimate(ctx, layers, heads, dim, dim, "f16")
    q8 = kv_estimate(ctx, layers, heads, dim, dim, "q8_0")
    q4 = kv_estimate(ctx, layers, heads, dim, dim, "q4_0")
    assert q4 < q8 < f16
    assert kv_estimate(2 * ctx, layers, heads, dim, dim, "q8_0") == 2 * q8


# -- llama.cpp's allocation rules, written out ---------------------------------------------------
def test_the_context_is_padded_to_256_cells():
    assert kv_cells(1) == kv_cells(256) == (256, 1)
    assert kv_cells(1000) == (1024, 1)
    assert kv_estimate(1000, 2, 1, 32, 32) == kv_estimate(1024, 2, 1, 32, 32) == 1024 * 2 * (64 + 64)


def test_per_sequence_streams_get_a_padded_share_each():
    # n_ctx 1000 -> 1024; 1024 // 3 = 341 -> 512 cells per stream, 3 streams (llama.cpp then reports n_ctx 1536)
    assert kv_cells(1000, 3, unified=False) == (512, 3)
    assert kv_cells(4096, 4, unified=False) == (1024, 4)
    assert kv_cells(4096, 4, unified=True) == (4096, 1)  # a unified cache is shared by the sequences
    assert kv_estimate(1000, 2, 1, 32, 32, n_seq=3, unified=False) == 512 * 3 * 2 * 128
    with pytest.raises(ConfigurationError, match="n_seq"):
        kv_cells(256, 0)


def test_sliding_window_layers_follow_llama_cpp_pattern_rule():
    # gemma3: every 6th layer is full attention (il % 6 == 5); gemma2: every 2nd
    assert sliding_window_layers(18, 512, 6) == tuple(il for il in range(18) if il % 6 != 5)
    assert sliding_window_layers(4, 4096, 2) == (0, 2)
    assert sliding_window_layers(3, 32, [True, False, True]) == (0, 2)
    assert sliding_window_layers(3, 32, 0) == (0, 1, 2)
    assert sliding_window_layers(6, 0, 2) == ()  # no window: no sliding layers


def test_the_sliding_window_cache_holds_window_plus_a_micro_batch():
    swa = list(range(0, 18))
    full_layers = [5, 11, 17]
    for il in full_layers:
        swa.remove(il)
    args = (8192, 18, 1, 256, 256, "f16")
    row = 2 * 256 * 2  # K + V row bytes of one head
    caches = kv_caches(*args, sliding_window=512, swa_layers=swa, n_ubatch=512)
    assert [(c.kind, c.cells, c.streams, c.layers) for c in caches] == [
        ("full", 8192, 1, 3), ("sliding-window", 1024, 1, 15)  # pad256(512 + 512)
    ]
    assert kv_estimate(*args, sliding_window=512, swa_layers=swa, n_ubatch=512) == (8192 * 3 + 1024 * 15) * row
    # a unified cache of 4 sequences keeps 4 windows; per-sequence streams one window each
    assert kv_caches(*args, sliding_window=512, swa_layers=swa, n_seq=4)[1].cells == 2560  # 4 * 512 + 512
    unified_off = kv_caches(*args, sliding_window=512, swa_layers=swa, n_seq=4, unified=False)
    assert [(c.cells, c.streams) for c in unified_off] == [(2048, 4), (1024, 4)]
    # n_ubatch is clamped by n_batch; never more cells than the full cache; swa_full: the full size
    assert kv_caches(*args, sliding_window=32, swa_layers=swa, n_batch=64, n_ubatch=512)[1].cells == 256
    assert kv_caches(512, 18, 1, 256, 256, sliding_window=512, swa_layers=swa)[1].cells == 512
    assert kv_caches(*args, sliding_window=512, swa_layers=swa, swa_full=True)[1].cells == 8192


def test_per_layer_kv_heads_and_transposed_v():
    # two layers with 2 and 4 KV heads: K rows per layer; V transposed (flash attention off) is as wide as the widest
    heads = [2, 4]
    assert kv_estimate(256, 2, heads, 32, 32) == 256 * (2 + 4) * (64 + 64)
    assert kv_estimate(256, 2, heads, 32, 32, v_trans=True) == 256 * (2 + 4) * 64 + 256 * (4 + 4) * 64
    with pytest.raises(ConfigurationError, match="per-layer"):
        kv_estimate(256, 3, heads, 32, 32)


def test_kv_buffers_parses_the_engine_report():
    log = [
        "llama_kv_cache_iswa: creating non-SWA KV cache, size = 8192 cells\n",
        "llama_kv_cache:      CUDA0 KV buffer size =    16.00 MiB\n",
        "llama_kv_cache:        CPU KV buffer size =     8.00 MiB\n",
        "llama_kv_cache: size =   24.00 MiB (  8192 cells,   3 layers,  4/4 seqs), K (q8_0):   12.00 MiB, V (q8_0):   12.00 MiB\n",
        "llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells\n",
        "llama_kv_cache:        CPU KV buffer size =    15.00 MiB\n",
        "llama_kv_cache: size =   15.00 MiB (  1024 cells,  15 layers,  4/4 seqs), K (q8_0):    7.50 MiB, V (q8_0):    7.50 MiB\n",
    ]
    full, swa = kv_buffers(log)
    assert (full.kind, full.cells, full.layers, full.streams, full.type_k) == ("full", 8192, 3, 4, "q8_0")
    assert full.buffer_bytes == 24 * 2**20 and full.k_bytes == 12 * 2**20  # both devices' buffers
    assert (swa.kind, swa.cells, swa.layers, swa.buffer_bytes) == ("sliding-window", 1024, 15, 15 * 2**20)
    assert kv_buffers(["llama_context: n_ctx = 512\n"]) == ()


# -- against the engine: the fixtures of every family and the demo model --------------------------
FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# (n_seq, unified, swa_full): one request; a batching lease's per-sequence streams; a unified
# multi-sequence cache; a latency lease's full sliding-window cache
LAYOUTS = ((1, True, False), (3, False, False), (4, True, False), (1, True, True))


def check_against_engine(path, contexts):
    """Estimate vs engine for each context, KV type and layout: same caches, bytes within 5%."""
    facts = inspect_model(path)
    model = _engine.NativeModel(str(path))
    checked = 0
    try:
        for context in contexts:
            for kv in KV_CACHE_TYPES:
                for n_seq, unified, swa_full in LAYOUTS:
                    params = _engine.ContextParams(
                        n_ctx=context, n_batch=512, n_ubatch=512, n_seq_max=n_seq, kv_cache_type=kv,
                        flash_attention="on", kv_unified=unified, swa_full=swa_full,
                    )
                    ctx = _engine.NativeContext(model, params)
                    buffers = ctx.kv_buffers
                    ctx.free()
                    caches = kv_caches_for(facts, params)
                    where = f"{facts.name} n_ctx={context} {kv} n_seq={n_seq} unified={unified} swa_full={swa_full}"
                    assert [(c.kind, c.cells, c.streams, c.layers) for c in caches] == [
                        (b.kind, b.cells, b.streams, b.layers) for b in buffers
                    ], where
                    assert all(b.type_k == b.type_v == kv for b in buffers), where
                    estimate, engine = sum(c.bytes for c in caches), sum(b.buffer_bytes for b in buffers)
                    assert abs(estimate - engine) <= 0.05 * engine, (where, estimate, engine)
                    # the engine reports 0.01 MiB: the estimate is the allocation up to that rounding
                    assert abs(estimate - engine) <= len(buffers) * _engine.KV_LOG_RESOLUTION, (where, estimate, engine)
                    checked += 1
    finally:
        model.free()
    return checked


@pytest.mark.parametrize("family", FAMILIES)
def test_estimate_matches_the_engine_buffers_of_each_family(fixture_models, family):
    # the fixtures are tiny (2 layers, 32-element heads): contexts large enough for >= 0.25 MiB of KV
    assert check_against_engine(fixture_models[family], (4000, 8192, 20000)) >= 27


def test_estimate_matches_the_engine_buffers_of_the_demo_model():
    from aner_nb.demo_model import gemma_model_path

    facts = inspect_model(gemma_model_path())
    assert facts.sliding_window > 0 and len(facts.swa_layers) == 15  # gemma-3-270m: 18 layers, every 6th full
    assert check_against_engine(gemma_model_path(), (512, 2000, 8192)) == 36


# -- the memory summary -----------------------------------------------------------------------
def long_fixture(tmp_path, family):
    """A family fixture declaring a 16k training context, so a lease's KV is large enough to compare."""
    return write_tiny_model(tmp_path / f"{family}-16k.gguf", family, n_ctx_train=16384)


def test_summary_reads_back_live_contexts_and_scopes_each_holding(tmp_path):
    with llm.load(long_fixture(tmp_path, "gemma3"), context=8192) as model:
        before = model.memory_summary()
        assert before.resident_kv_bytes == 0 and before.resident[0].what == "weights"
        model.generate("the cat", max_tokens=2)
        summary = model.memory_summary()
        (ctx,) = model._weights.native.contexts()  # the pooled idle context of the request
        read_back = sum(b.buffer_bytes for b in ctx.kv_buffers)
        assert summary.resident_kv_bytes == read_back
        assert abs(summary.kv_bytes - read_back) <= 0.05 * read_back
        idle = next(h for h in summary.resident if h.what == "idle pooled contexts")
        assert (idle.count, idle.bytes, idle.scope) == (1, read_back, "per lease")
        scopes = {h.what: h.scope for h in summary.bounds}
        assert scopes["the running request's context"] == "per request"
        assert scopes["idle pooled contexts (max_idle_contexts)"] == "per lease"
        with model.with_optimizer(prefix_cache_entries=3) as fast:
            fast.generate("the cat", max_tokens=2)
            held = fast.memory_summary()
            entries = next(h for h in held.resident if h.what.startswith("retained prefix entries"))
            assert entries.count == 1 and entries.scope == "per lease"
            (bound,) = held.bounds
            assert bound.count == 3 and bound.bytes == 3 * held.kv_bytes and bound.scope == "per lease"
            assert all(h.scope != "per request" for h in held.resident + held.bounds if "prefix" in h.what)
            # a latency lease keeps a full sliding-window cache: its contexts are larger
            assert held.kv_bytes > summary.kv_bytes
        assert "per lease" in summary._repr_html_() and len(summary.holdings_frame()) == 5


def test_a_batching_summary_counts_every_stream(tmp_path):
    with llm.load(long_fixture(tmp_path, "gemma2"), context=8192) as model, model.with_batching(4) as serving:
        summary = serving.memory_summary()
        (ctx,) = [c for c in model._weights.native.contexts() if c.params.n_seq_max == 4]
        read_back = sum(b.buffer_bytes for b in ctx.kv_buffers)
        assert [b.streams for b in ctx.kv_buffers] == [4, 4]
        assert abs(summary.kv_bytes - read_back) <= 0.05 * read_back
        batching = next(h for h in summary.resident if h.what.startswith("KV of live batching contexts"))
        assert (batching.count, batching.bytes) == (1, read_back) and "4 streams" in batching.what
