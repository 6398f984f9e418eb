"""Exact prefix reuse (``llm/reuse.py``, ``runner.prefill_chunks``): the rules, then the fixture against its cold run."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from aner_nb import llm

from aner_nb.llm.reuse import MIN_ROWS, ROW_BLOCK, micro_batch_rows, restore_point, retained_rows, reuse_attention, reuse_limit
from aner_nb.llm.runner import prefill_chunks
from test_optimizer import logprob_rows


def micro_batches(chunks: list[tuple[int, int]], n_ubatch: int) -> list[int]:
    """The micro-batch sizes llama.cpp runs for these calls: each call split from its start."""
    return [min(n_ubatch, hi - lo) for lo0, hi in chunks for lo in range(lo0, hi, n_ubatch)]


def test_examples():
    assert prefill_chunks(0, 1721, 512, 128) == [(0, 512), (512, 1024), (1024, 1536), (1536, 1721)]
    # 1,664 + 57 rows: one call of 57, no lending needed
    assert prefill_chunks(1664, 1721, 512, 128) == [(1664, 1721)]
    # 128 + 4 (or + 5) would leave a micro-batch under 8 rows: the last takes a row block from the one before
    assert prefill_chunks(0, 132, 512, 128) == [(0, 124), (124, 132)]
    assert prefill_chunks(0, 133, 512, 128) == [(0, 124), (124, 133)]
    assert prefill_chunks(0, 1030, 512, 512) == [(0, 512), (512, 1020), (1020, 1030)]
    # n_ubatch 79 is not a multiple of the row block: micro-batches of 76, one per call
    assert prefill_chunks(60, 240, 79, 79) == [(60, 136), (136, 212), (212, 240)]
    assert prefill_chunks(0, 5, 512, 128) == [(0, 5)]  # too short to lend from
    assert prefill_chunks(3, 3, 512, 128) == []


@given(
    start=st.integers(0, 3000), length=st.integers(0, 3000),
    n_batch=st.sampled_from([16, 32, 100, 128, 512, 2048]), n_ubatch=st.sampled_from([16, 17, 64, 128, 512]),
)
def test_chunks_cover_the_prompt_in_calls_llama_cpp_accepts(start, length, n_batch, n_ubatch):
    end = start + length
    chunks = prefill_chunks(start, end, n_batch, n_ubatch)
    assert [lo for lo, _ in chunks] == ([start, *(hi for _, hi in chunks[:-1])] if length else [])
    assert (chunks[-1][1] if chunks else start) == end
    assert all(0 < hi - lo <= n_batch for lo, hi in chunks)
    ub = min(n_ubatch, n_batch)
    sizes = micro_batches(chunks, ub)
    assert sum(sizes) == length
    # every micro-batch but the last is a whole row block, all but the last two have micro_batch_rows, and
    # none is under MIN_ROWS unless the prompt is too short to lend from
    assert all(s % ROW_BLOCK == 0 for s in sizes[:-1])
    assert all(s == micro_batch_rows(ub) for s in sizes[:-2])
    if length >= MIN_ROWS and (len(sizes) > 1 or ub >= 2 * MIN_ROWS):
        assert min(sizes) >= MIN_ROWS


@given(common=st.integers(0, 5000), n=st.integers(0, 5000))
def test_a_request_always_evaluates_min_rows_or_its_whole_prompt(common, n):
    keep = restore_point(common, n)
    assert 0 <= keep <= min(common, n) and n - keep >= min(n, MIN_ROWS) and keep % ROW_BLOCK == 0
    assert keep == min(common, reuse_limit(n)) - min(common, reuse_limit(n)) % ROW_BLOCK
    assert retained_rows(n, n) == (n - n % ROW_BLOCK if n >= MIN_ROWS else 0)


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
    earlier request left the cache: one that held the whole question (the tail is then only the template's
    closing tokens, fewer than MIN_ROWS) and ones that diverged early or late. ``odd_ubatch``: micro-batches
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
        for earlier in (prompt + " Answer in one word.", LEDGER + "Who is the treasurer?", LEDGER[:200]):
            with lease() as warm_lease:
                warm_lease.generate(earlier, max_tokens=2)
                warm = warm_lease.generate(prompt, max_tokens=6, logprobs=True, top_logprobs=3)
            assert warm.usage.cached_input_tokens > 0, earlier
            assert logprob_rows(warm) == logprob_rows(cold), earlier
