"""Exact prefix reuse (``llm/reuse.py``, ``runner.prefill_chunks``): the rules, then the fixture against its cold run."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from aner_nb import llm

from aner_nb.llm.reuse import BLOCKED, MIN_ROWS, ROW_BLOCK, ROW_LOCAL, TAIL_ROWS, ReuseShape, micro_batch_rows, reuse_shape, restore_point, retained_rows, reuse_attention, reuse_limit
from aner_nb.llm.runner import prefill_chunks
from test_optimizer import logprob_rows


def chunks(start: int, end: int, n_batch: int, n_ubatch: int, shape=BLOCKED) -> list[tuple[int, int]]:
    """A prefix-cache context's prefill calls (its prompt's tail apart)."""
    return prefill_chunks(start, end, n_batch, n_ubatch, reuse=shape)


def micro_batches(chunks: list[tuple[int, int]], n_ubatch: int) -> list[int]:
    """The micro-batch sizes llama.cpp runs for these calls: each call split from its start."""
    return [min(n_ubatch, hi - lo) for lo0, hi in chunks for lo in range(lo0, hi, n_ubatch)]


def test_examples():
    # the tail (1,720 = reuse_limit(1721)) is a call of its own
    assert chunks(0, 1721, 512, 128) == [(0, 512), (512, 1024), (1024, 1536), (1536, 1720), (1720, 1721)]
    assert chunks(0, 1724, 512, 128) == [(0, 512), (512, 1024), (1024, 1536), (1536, 1720), (1720, 1724)]
    # 1,664 + 57 rows: one body call of 56, then the tail
    assert chunks(1664, 1721, 512, 128) == [(1664, 1720), (1720, 1721)]
    assert chunks(1720, 1721, 512, 128) == [(1720, 1721)]  # a repeated prompt: its tail only
    # a body of 128 + 4 would leave a micro-batch under 8 rows: its last takes a row block from the one before
    assert chunks(0, 133, 512, 128) == [(0, 124), (124, 132), (132, 133)]
    assert chunks(0, 1030, 512, 512) == [(0, 512), (512, 1020), (1020, 1028), (1028, 1030)]
    # n_ubatch 79 is not a multiple of the row block: micro-batches of 76, one per call
    assert chunks(60, 240, 79, 79) == [(60, 136), (136, 212), (212, 236), (236, 240)]
    assert chunks(0, 5, 512, 128) == [(0, 5)]  # too short for a body: one small micro-batch
    assert chunks(3, 3, 512, 128) == []
    assert chunks(1722, 1723, 512, 128) == [(1722, 1723)]  # a session's start past the tail's (conversation_keep)
    # without a row block (ROW_LOCAL): the body ends where the tail, the last token, starts
    assert chunks(0, 1721, 512, 128, ROW_LOCAL) == [(0, 512), (512, 1024), (1024, 1536), (1536, 1720), (1720, 1721)]
    assert chunks(0, 1723, 512, 128, ROW_LOCAL) == [(0, 512), (512, 1024), (1024, 1536), (1536, 1722), (1722, 1723)]
    assert chunks(1714, 1723, 512, 128, ROW_LOCAL) == [(1714, 1722), (1722, 1723)]
    assert chunks(0, 131, 512, 128, ROW_LOCAL) == [(0, 122), (122, 130), (130, 131)]
    # a lease without a prefix cache keeps its tail in the last micro-batch
    assert prefill_chunks(0, 1721, 512, 128) == [(0, 512), (512, 1024), (1024, 1536), (1536, 1721)]
    assert prefill_chunks(0, 133, 512, 128) == [(0, 124), (124, 133)]


@given(
    start=st.integers(0, 3000), length=st.integers(0, 3000),
    n_batch=st.sampled_from([16, 32, 100, 128, 512, 2048]), n_ubatch=st.sampled_from([16, 17, 64, 128, 512]),
    shape=st.sampled_from([BLOCKED, ROW_LOCAL]),
)
def test_chunks_cover_the_prompt_in_calls_llama_cpp_accepts(start, length, n_batch, n_ubatch, shape):
    end = start + length
    calls = chunks(start, end, n_batch, n_ubatch, shape)
    block = shape.row_block
    assert [lo for lo, _ in calls] == ([start, *(hi for _, hi in calls[:-1])] if length else [])
    assert (calls[-1][1] if calls else start) == end
    assert all(0 < hi - lo <= n_batch for lo, hi in calls)
    ub = min(n_ubatch, n_batch)
    tail = shape.reuse_limit(end)
    if 0 < tail and start <= tail < end:  # the tail is the last call, of TAIL_ROWS to TAIL_ROWS + row_block - 1 rows
        assert calls[-1][0] == tail and TAIL_ROWS <= end - tail < TAIL_ROWS + block
        body = calls[:-1]
    else:
        body = calls
    sizes = micro_batches(body, ub)
    # every body micro-batch but the last is a whole row block, all but the last two have micro_batch_rows,
    # and none is under MIN_ROWS unless the body is too short to lend from
    assert all(s % block == 0 for s in sizes[:-1])
    assert all(s == shape.micro_batch_rows(ub) for s in sizes[:-2])
    if start % block == 0 and start <= tail and tail - start >= MIN_ROWS and (len(sizes) > 1 or ub >= 2 * MIN_ROWS):
        assert min(sizes) >= MIN_ROWS and all(s % block == 0 for s in sizes)


@given(common=st.integers(0, 5000), n=st.integers(0, 5000), shape=st.sampled_from([BLOCKED, ROW_LOCAL]))
def test_a_request_evaluates_the_tail_or_at_least_min_rows_of_body_too(common, n, shape):
    keep = shape.restore_point(common, n)
    limit, block = shape.reuse_limit(n), shape.row_block
    assert 0 <= keep <= min(common, n) and keep % block == 0
    assert keep == limit or limit - keep >= MIN_ROWS or keep == 0
    assert limit == 0 or TAIL_ROWS <= n - limit < TAIL_ROWS + block
    # the most it may keep: the whole body when all of it is cached, else up to MIN_ROWS before the tail
    assert keep == (limit if common >= limit else max(0, min(common - common % block, limit - MIN_ROWS)))
    assert shape.retained_rows(n, n) == limit and shape.retained_rows(common, n) == min(common - common % block, limit)
    if shape is BLOCKED:  # the module-level rules
        assert (restore_point(common, n), reuse_limit(n), retained_rows(common, n)) == (keep, limit, shape.retained_rows(common, n))


def test_a_prompt_repeated_evaluates_one_to_four_tokens():
    for n in range(9, 40):
        assert 1 <= n - restore_point(n, n) <= ROW_BLOCK
        assert n - ROW_LOCAL.restore_point(n, n) == TAIL_ROWS == 1  # no row block: its last token only


def test_the_row_local_shape_needs_every_weight_type_known_and_an_x86_cpu_build_without_amx():
    smollm2 = ["Q4_1", "F32", "Q8_0"]  # the demo model's tensor types
    gemma = ["F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"]
    cpu = {"build_flags": {"AVX2", "LLAMAFILE"}, "machine": "x86_64", "on_cpu": True}
    assert reuse_shape(smollm2, **cpu) is ROW_LOCAL
    assert reuse_shape(["F16", "F32"], **cpu) is ROW_LOCAL
    assert reuse_shape(gemma, **cpu) is BLOCKED  # Q4_K is repacked, Q6_K tiled
    assert reuse_shape(["Q4_0", "F32"], **cpu) is BLOCKED  # repacked on x86
    assert reuse_shape(["IQ4_XS"], **cpu) is BLOCKED and reuse_shape([], **cpu) is ROW_LOCAL
    assert reuse_shape(smollm2, **{**cpu, "build_flags": {"AVX2", "AMX_INT8"}}) is BLOCKED  # AMX kernels: not read
    assert reuse_shape(smollm2, **{**cpu, "machine": "aarch64"}) is BLOCKED  # other repack kernels
    assert reuse_shape(smollm2, **{**cpu, "on_cpu": False}) is BLOCKED  # GPU kernels
    with pytest.raises(ValueError, match="row_block"):
        ReuseShape(2)


def test_reuse_attention_turns_auto_off_on_a_cpu_only():
    assert reuse_attention("auto", kv_cache_type="f16", on_cpu=True) == "off"
    assert reuse_attention("on", kv_cache_type="f16", on_cpu=True) == "on"  # asked for: kept
    assert reuse_attention("auto", kv_cache_type="q8_0", on_cpu=True) == "auto"  # a quantized V cache needs it
    assert reuse_attention("auto", kv_cache_type="f16", on_cpu=False) == "auto"


# -- the demo models: where small micro-batches really take other kernels -------------------------


def demo(name: str):
    from aner_nb.demo_model import GEMMA_CHAT_TEMPLATE, demo_model_path, gemma_model_path

    if name == "gemma":
        return llm.load(gemma_model_path(), context=1024, chat_template=GEMMA_CHAT_TEMPLATE, warmup=False)
    return llm.load(demo_model_path(), context=1024, warmup=False)


LEDGER = (
    "Ledger of Harbor Street, 1888. Treasurer: Mira Okonkwo. Clerk: Tomasz Wieland. Lighthouse fund: "
    "4,210 crowns. North quay repaired in spring; the salt barn let to the Jansen brothers for 40 crowns a "
    "year. The fishing guild paid 112 crowns in dues and asked for a second crane. "
) * 3


@pytest.mark.parametrize("name, odd_ubatch", [("smollm2", False), ("gemma", False), ("gemma", True)])
def test_demo_models_reuse_bitwise_exactly_after_any_earlier_request(name, odd_ubatch):
    """On SmolLM2 (Q4_1) and Gemma 3 (Q4_K_M) a cached request's logprobs equal the uncached run's, whichever
    earlier request left the cache: the same prompt (only its 1-4 token tail is evaluated again), one that
    held the whole question (the tail is then the template's closing tokens) and ones that diverged early or
    late. ``odd_ubatch``: micro-batches
    of a size that is no multiple of ROW_BLOCK, and the uncached prompt's last would be under MIN_ROWS rows."""
    prompt = LEDGER + "Who is the clerk?"
    with demo(name) as model:
        n = len(model.prompt_tokens(prompt))
        ub = (n - 3) // 3
        ub -= (ub % ROW_BLOCK == 0)  # not a multiple of the row block either
        sizes = {"batch_tokens": ub, "micro_batch_tokens": ub} if odd_ubatch else {}
        assert not odd_ubatch or (0 < n % ub < MIN_ROWS and ub % ROW_BLOCK)

        def lease():
            return model.with_optimizer(prefix_cache_entries=1, threads=1, prefill_threads=1, **sizes)

        with lease() as cold_lease:
            cold = cold_lease.generate(prompt, max_tokens=6, logprobs=True, top_logprobs=3)
            assert cold.usage.cached_input_tokens == 0 and cold_lease._params.flash_attention == "off"
            shape = cold_lease.reuse_shape
            assert shape is not None and model.reuse_shape is None  # a plain lease has no prefix cache
        kept = set()
        for earlier in (prompt, prompt + " Answer in one word.", LEDGER + "Who is the treasurer?", LEDGER[:200], LEDGER[:203]):
            with lease() as warm_lease:
                warm_lease.generate(earlier, max_tokens=2)
                warm = warm_lease.generate(prompt, max_tokens=6, logprobs=True, top_logprobs=3)
            kept.add(warm.usage.cached_input_tokens)
            assert warm.usage.cached_input_tokens > 0, earlier
            assert logprob_rows(warm) == logprob_rows(cold), earlier
        # the shape's restore points were taken: off a row block where the model has none (SmolLM2's Q4_1 on x86)
        assert all(k % shape.row_block == 0 for k in kept) and (shape.row_block == ROW_BLOCK or any(k % ROW_BLOCK for k in kept))
