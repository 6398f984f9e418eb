"""Exact prefix reuse (``llm/reuse.py``, ``runner.prefill_chunks``): the rules, then the fixture against its cold run."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from aner_nb import llm

from aner_nb.llm.reuse import BLOCKED, MIN_ROWS, RAGGED, ROW_BLOCK, ROW_LOCAL, TAIL_ROWS, ReuseShape, micro_batch_rows, reuse_shape, restore_point, retained_rows, reuse_attention, reuse_limit
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
    shape=st.sampled_from([BLOCKED, RAGGED, ROW_LOCAL]),
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
        assert not shape.ragged_body or end - tail == TAIL_ROWS  # a ragged body: the last row alone
        body = calls[:-1]
    else:
        body = calls
    sizes = micro_batches(body, ub)
    # every body micro-batch but the last is a whole row block, all but the last two have micro_batch_rows,
    # and none is under MIN_ROWS unless the body is too short to lend from
    assert all(s % block == 0 for s in sizes[:-1])
    assert all(s == shape.micro_batch_rows(ub) for s in sizes[:-2])
    if start % block == 0 and start <= tail and tail - start >= MIN_ROWS and (len(sizes) > 1 or ub >= 2 * MIN_ROWS):
        # (a ragged body's last micro-batch ends off a row block: its gemv rows, the same in every run of this body)
        assert min(sizes) >= MIN_ROWS and all(s % block == 0 for s in sizes[:-1])
        assert sizes[-1] % block == 0 or (shape.ragged_body and sizes[-1] % block == tail % block)


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


def reference_keep(common: int, n: int, stored: int | None, shape: ReuseShape) -> int:
    """The most of a stored entry a prompt of ``n`` tokens may keep, row by row (a brute-force model).

    A stored row after the entry's last whole block is a gemv row (an entry is cut to a row block unless
    it holds a whole body, so only a whole body has such rows; ``None``: none is known to be one, so any
    may be); the prompt's uncached run computes a row by gemv when it is after its own body's last whole
    block. A kept row must be of the same kind in both, and what is kept the whole body or a row block
    leaving MIN_ROWS rows of body to evaluate.
    """
    body = shape.reuse_limit(n)

    def stored_gemv(p: int) -> bool | None:
        return None if stored is None else p >= shape.floor(stored)

    def same_kernel(p: int) -> bool:
        ours = p >= shape.floor(body)
        return stored_gemv(p) is ours or (stored_gemv(p) is None and not ours)

    exact = next((p for p in range(common) if not same_kernel(p)), common)  # rows before this one match
    return next((k for k in range(min(exact, body), 0, -1)
                 if k == body or (k % shape.row_block == 0 and body - k >= MIN_ROWS)), 0)


@given(data=st.data(), n=st.integers(0, 600), shape=st.sampled_from([BLOCKED, RAGGED, ROW_LOCAL]))
def test_restore_points_keep_only_rows_every_run_computes_alike(data, n, shape):
    stored = data.draw(st.one_of(st.none(), st.integers(0, 700)))
    common = data.draw(st.integers(0, stored if stored is not None else 700))
    # a stored entry is a whole body (possibly ragged) or cut to a row block (retained_rows)
    if stored is not None and stored % shape.row_block and not shape.ragged_body:
        stored -= stored % shape.row_block
        common = min(common, stored)
    keep = shape.restore_point(common, n, stored)
    assert keep == reference_keep(common, n, stored, shape), (common, n, stored)
    body = shape.reuse_limit(n)
    assert shape.retained_rows(n, n) == body  # a whole body is kept whole: the same prompt restores it all
    if shape is RAGGED and body:
        assert n - body == TAIL_ROWS
        assert shape.restore_point(body, n, body) == body  # the same prompt again: its last row only


def test_a_ragged_body_comes_whole_only_from_an_entry_whose_body_ends_in_the_same_block():
    n = 103  # body 102: rows 100 and 101 are gemv rows of the uncached run
    assert RAGGED.reuse_limit(n) == 102 and RAGGED.retained_rows(n, n) == 102
    assert RAGGED.restore_point(102, n, 102) == 102  # the same body
    assert RAGGED.restore_point(102, n, 103) == 102  # a longer prompt's body, ending in the same block
    assert RAGGED.restore_point(102, n, 104) == 92  # cut to a block: rows 100-101 were gemm rows there
    assert RAGGED.restore_point(102, n, 130) == 92 and RAGGED.restore_point(102, n, None) == 92
    assert RAGGED.restore_point(101, n, 101) == 92  # not all of the body is cached
    assert RAGGED.restore_point(100, 101, 130) == 100  # a body on a block takes whole-block rows from any entry
    assert BLOCKED.restore_point(102, n, 102) == 100 and ROW_LOCAL.restore_point(102, n, 104) == 102


def test_a_prompt_repeated_evaluates_one_to_four_tokens():
    for n in range(9, 40):
        assert 1 <= n - restore_point(n, n) <= ROW_BLOCK
        assert n - ROW_LOCAL.restore_point(n, n) == TAIL_ROWS == 1  # no row block: its last token only
        # a ragged body, kept whole (retained_rows), serves the same prompt again: its last token only
        assert n - RAGGED.restore_point(n, n, RAGGED.retained_rows(n, n)) == TAIL_ROWS


def test_the_row_local_shape_needs_every_weight_type_known_and_an_x86_cpu_build_without_amx():
    smollm2 = ["Q4_1", "F32", "Q8_0"]  # the demo model's tensor types
    gemma = ["F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"]
    cpu = {"build_flags": {"AVX2", "LLAMAFILE"}, "machine": "x86_64", "on_cpu": True}
    assert reuse_shape(smollm2, **cpu) is ROW_LOCAL
    assert reuse_shape(["F16", "F32"], **cpu) is ROW_LOCAL
    assert reuse_shape(gemma, **cpu) is RAGGED  # Q4_K is repacked, Q6_K tiled
    assert reuse_shape(["Q4_0", "F32"], **cpu) is RAGGED  # repacked on x86
    assert reuse_shape(["IQ4_XS"], **cpu) is RAGGED and reuse_shape([], **cpu) is ROW_LOCAL
    assert reuse_shape(gemma, **{**cpu, "on_cpu": False}) is BLOCKED
    assert reuse_shape(smollm2, **{**cpu, "build_flags": {"AVX2", "AMX_INT8"}}) is BLOCKED  # AMX kernels: not read
    assert reuse_shape(smollm2, **{**cpu, "machine": "aarch64"}) is BLOCKED  # other repack kernels
    assert reuse_shape(smollm2, **{**cpu, "on_cpu": False}) is BLOCKED  # GPU kernels
    with pytest.raises(ValueError, match="row_block"):
        ReuseShape(2)


def test_sliding_window_shapes_take_whole_blocks_of_the_softmax_lanes():
    from aner_nb.llm.reuse import for_restored_windows, softmax_lanes

    x86 = {"machine": "x86_64", "on_cpu": True}
    assert softmax_lanes({"AVX", "AVX2", "FMA"}, **x86) == 8
    assert softmax_lanes({"AVX2", "AVX512", "AVX512_VBMI"}, **x86) == 16
    assert softmax_lanes({"NEON"}, machine="aarch64", on_cpu=True) == 16  # not read there: the widest
    assert softmax_lanes({"AVX2"}, machine="x86_64", on_cpu=False) == 16
    assert for_restored_windows(RAGGED, 8) == ReuseShape(8) == for_restored_windows(ROW_LOCAL, 8)
    assert for_restored_windows(BLOCKED, 16) == ReuseShape(16) and for_restored_windows(ReuseShape(16), 8) == ReuseShape(16)
    shape = ReuseShape(8)  # Gemma with AVX2: restore points and the tail's start on multiples of 8
    assert shape.reuse_limit(1662) == 1656 and shape.restore_point(1661, 1662, 1661) == 1656
    assert shape.restore_point(1000, 1662) == 1000 and shape.restore_point(1003, 1662) == 1000


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
    earlier request left the cache: the same prompt (only its tail is evaluated again: its last token, 1-4 on a
    BLOCKED shape), one that
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
        # the shape's restore points were taken: off a row block where the model has none (SmolLM2's Q4_1 on x86),
        # where a ragged body is restored whole, else on whole blocks (Gemma's: the softmax's lanes)
        assert all(k % shape.row_block == 0 or (shape.ragged_body and k == shape.reuse_limit(n)) for k in kept)
        assert shape.row_block > 1 or any(k % ROW_BLOCK for k in kept)


def test_gemma_ragged_bodies_restore_bitwise_from_entries_that_end_anywhere():
    """Gemma's repacked Q4_K on an x86 CPU (``RAGGED``; elsewhere its weights' shape, whichever), live KV: at the engine, with a prefix-cache lease's contexts
    and prefill calls, a prompt restored from an entry (the body of an earlier prompt: the same one, one
    token longer or shorter, one with another last token, a longer one) at the shape's restore point gives
    the uncached run's logits bit for bit on the last prompt row and four greedy steps. Prompt lengths
    cover every body end modulo the row block, so whole bodies ending off a block are among them."""
    import numpy as np

    from aner_nb.llm import _engine
    from aner_nb.llm.prefix_pool import common_prefix_length
    from aner_nb.llm.requests import context_params
    from aner_nb.llm.runner import prefill

    import dataclasses
    import platform

    with demo("gemma") as model:
        with model.with_optimizer(prefix_cache_entries=1, threads=2, prefill_threads=2) as lease:
            # the weights' own shape (a lease of this sliding-window model aligns it to the softmax's lanes
            # for restored states, reuse.for_restored_windows; live KV, as here, keeps every cell in place)
            shape = reuse_shape((t for _, t in model.facts.tensor_types), build_flags=_engine.build_flags(),
                                machine=platform.machine(), on_cpu=True)
            params = dataclasses.replace(
                context_params(lease._weights, lease.profile, swa_full=True, reuses_prefixes=True), prefix_reuse=shape
            )
            native = lease._weights.native
            base = list(model.prompt_tokens(LEDGER + "Who is the clerk?"))
            other = list(model.prompt_tokens("The fishing guild asked for a second crane; the quay was repaired."))[1:]
            ctx, batch = _engine.NativeContext(native, params), _engine.Batch(512)

            def run(tokens: list[int], start: int) -> list[np.ndarray]:
                prefill(ctx, batch, tokens, start, 0)
                rows, n = [ctx.logits(batch.n_tokens - 1).copy()], len(tokens)
                for i in range(4):
                    batch.clear()
                    batch.add(int(np.argmax(rows[-1])), n + i, 0, logits=True)
                    ctx.decode(batch)
                    rows.append(ctx.logits(0).copy())
                ctx.seq_rm(0, n, -1)
                return rows

            try:
                kinds = set()
                for cut in range(4):
                    prompt = base[: len(base) - cut]
                    body = shape.reuse_limit(len(prompt))
                    ctx.clear()
                    cold = run(prompt, 0)
                    for earlier in (prompt, prompt + other[:1], prompt[:-1], prompt[:-1] + other[:1], prompt + other):
                        stored = shape.retained_rows(len(earlier), len(earlier))  # the entry: the earlier prompt's body
                        keep = shape.restore_point(common_prefix_length(earlier[:stored], prompt), len(prompt), stored)
                        ctx.clear()
                        run(earlier, 0)
                        assert ctx.seq_rm(0, keep, -1)
                        warm = run(prompt, keep)
                        kinds.add((body % ROW_BLOCK, keep == body))
                        assert all(np.array_equal(a, b) for a, b in zip(cold, warm)), (len(prompt), len(earlier), keep)
                # whole bodies off a row block were restored (RAGGED: an x86 CPU build without AMX; elsewhere
                # Gemma's shape is BLOCKED, whose bodies end on a block)
                assert {(r, True) for r in range(1, ROW_BLOCK)} <= kinds if shape is RAGGED else {r for r, _ in kinds} == {0}
            finally:
                ctx.free()
                batch.free()


def test_gemma_prefixes_restored_from_saved_states_equal_the_uncached_run():
    """A sliding-window model's prefix from the RAM tier gives the uncached run's logprobs bit for bit, for
    prompts longer than the window whose lengths cover every residue of the softmax's lanes, whole or cut
    below the stored entry's end. A latency lease saves every cell (``KVIdentity.state ==
    "all_cells"``: each loaded back into its own cell); a per-sequence state would keep only the
    window's cells and load them into the first cells, which rounds the softmax differently unless the
    restore point is a whole block of lanes and cannot be cut at all."""
    from aner_nb.llm import _engine
    import platform

    from aner_nb.llm.reuse import for_restored_windows, softmax_lanes

    prompt = LEDGER * 4 + "Who is the clerk?"
    with demo("gemma") as model:
        tiered = dict(prefix_cache_entries=1, threads=2, prefill_threads=2, prefix_cache_ram_bytes=256 << 20)
        lanes = softmax_lanes(_engine.build_flags(), machine=platform.machine(), on_cpu=True)
        with model.with_optimizer(**tiered) as probe, model.with_optimizer(prefix_cache_entries=1) as untiered:
            assert probe.reuse_shape == untiered.reuse_shape == probe._weights.reuse_shape
            # several sequences (batching) restore per-sequence states: their restore points are lane-aligned
            assert probe._weights.reuse_shape_for(4) == for_restored_windows(probe._weights.reuse_shape, lanes)
        n_swa = model._weights.native.n_swa
        seen = set()
        for cut in range(lanes + 1):
            text = prompt + " Say" + " yes" * cut  # one more token each
            n = len(model.prompt_tokens(text))
            assert n > n_swa + 2 * lanes
            with model.with_optimizer(prefix_cache_entries=1, threads=2, prefill_threads=2) as cold_lease:
                cold = cold_lease.generate(text, max_tokens=6, logprobs=True, top_logprobs=3)
            with model.with_optimizer(**tiered) as lease:
                lease.generate(text, max_tokens=2)
                lease.generate("An unrelated short question?", max_tokens=2)  # the long entry goes to RAM
                warm = lease.generate(text, max_tokens=6, logprobs=True, top_logprobs=3)
                skips = dict(lease.prefix_tier_stats()["skips"])
            if cut % 3 == 0:
                # the only stored entry is a longer prompt's, cut below its end (inside the window) on restore
                longer = text + " And what is the ledger's date?"
                ids, longer_ids = model.prompt_tokens(text), model.prompt_tokens(longer)
                with model.with_optimizer(**tiered) as lease:
                    lease.generate(longer, max_tokens=2)
                    lease.generate("An unrelated short question?", max_tokens=2)
                    cut_warm = lease.generate(text, max_tokens=6, logprobs=True, top_logprobs=3)
                    shape, stored = lease.reuse_shape, lease.reuse_shape.retained_rows(len(longer_ids), len(longer_ids))
                    skips.update({f"cut {k}": v for k, v in lease.prefix_tier_stats()["skips"].items()})
                common = next((i for i, (a, b) in enumerate(zip(ids, longer_ids)) if a != b), min(len(ids), len(longer_ids)))
                assert cut_warm.timings.prefix_cache_tier == llm.prefix_tiers.TIER_CODES["ram"], cut
                assert n_swa < cut_warm.usage.cached_input_tokens == shape.restore_point(min(common, stored), n, stored) < stored
                assert logprob_rows(cut_warm) == logprob_rows(cold), (cut, n, "cut")
            assert not any(skips.values()), skips
            assert warm.timings.prefix_cache_tier == llm.prefix_tiers.TIER_CODES["ram"], cut
            assert warm.usage.cached_input_tokens == lease.reuse_shape.reuse_limit(n)
            assert logprob_rows(warm) == logprob_rows(cold), (cut, n)
            seen.add((n - 1) % lanes)
        assert len(seen) == lanes  # prompts end at every residue of the lanes
