"""Latency profiles on the fixtures: prefix reuse and prompt lookup change speed, never output."""

from __future__ import annotations

import pytest

from aner_nb import llm
from aner_nb.llm import _engine, errors
from aner_nb.llm import lookup as lookup_module

CTX = 512
EVIDENCE = (
    "Evidence: the ledger of Harbor Street lists Mira Okonkwo as treasurer, Tomasz Wieland as clerk, "
    "and the lighthouse fund at 4,210 crowns. The survey of 1888 names the north quay and the salt barn."
)


@pytest.fixture(scope="module")
def base(llama_path):
    with llm.load(llama_path, context=CTX) as m:
        yield m


def greedy(model, prompt, n=16):
    return model.generate(prompt, max_tokens=n)


# -- with_optimizer / with_context_pool ---------------------------------------
def test_with_optimizer_returns_a_new_lease_on_the_same_weights(base):
    fast = base.with_optimizer(prefix_cache_entries=2, speculative_tokens=4)
    try:
        assert fast is not base and fast._weights is base._weights
        assert fast.fingerprint == base.fingerprint
        assert fast.profile.kind == "latency" and base.profile.kind == "ordinary"
        assert fast.supports("prefix_cache") and fast.supports("speculative")
        assert not base.supports("prefix_cache") and not base.supports("speculative")
        assert llm.with_optimizer(base, threads=1).profile.optimizer.threads == 1
    finally:
        fast.close()
    assert not base.closed and greedy(base, "still fine", 2).usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"threads": -1}, "threads"),
        ({"batch_tokens": 0}, "batch_tokens"),
        ({"micro_batch_tokens": 600}, "micro_batch_tokens (600) must be <= batch_tokens (512)"),
        ({"prefix_cache_tokens": 0}, "prefix_cache_tokens"),
        ({"prefix_cache_entries": 17}, "prefix_cache_entries must be in 0..16"),
        ({"speculative_tokens": 65}, "speculative_tokens must be in 0..64"),
        ({"threads": 1.5}, "threads must be an integer"),
    ],
)
def test_optimizer_settings_are_validated_at_configuration(base, kwargs, needle):
    with pytest.raises(errors.ConfigurationError) as info:
        base.with_optimizer(**kwargs)
    assert needle in str(info.value)


def test_threads_and_batch_sizes_reach_the_engine(base, monkeypatch):
    created = []
    init = _engine.NativeContext.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(_engine.NativeContext, "__init__", recording_init)
    with base.with_optimizer(threads=1, prefill_threads=2, batch_tokens=64, micro_batch_tokens=32) as tuned:
        r = greedy(tuned, "threads", 4)
        t = r.timings
        assert (t.threads, t.prefill_threads, t.batch_tokens, t.micro_batch_tokens) == (1, 2, 64, 32)
        # llama.cpp's own view of the context the request ran on
        (ctx,) = [c for c in created if c.alive]
        reported = ctx.engine_settings()
        assert (reported["n_threads"], reported["n_threads_batch"]) == (1, 2)
        assert (reported["n_batch"], reported["n_ubatch"]) == (64, 32)
        # f16 fixture, a one-chunk prompt: per-row dot products do not depend on the thread count
        assert r.tokens == greedy(base, "threads", 4).tokens


def test_context_pool_sizes(base):
    with pytest.raises(errors.ConfigurationError, match="max_idle must be in 0..4"):
        base.with_context_pool(5)
    with base.with_context_pool(0) as none_kept:
        greedy(none_kept, "a", 2)
        second = greedy(none_kept, "a", 2)
        assert second.timings.context_pool_reused == 0 and none_kept._state.pool.idle == 0
    with llm.with_context_pool(base, 2) as kept:
        greedy(kept, "a", 2)
        r = greedy(kept, "b", 2)
        assert r.timings.context_pool_reused == 1
        assert r.usage.cached_input_tokens == 0  # ordinary contexts are handed out empty


def test_builders_on_closed_lease(llama_path):
    m = llm.load(llama_path, context=CTX)
    m.close()
    with pytest.raises(errors.ClosedError):
        m.with_optimizer(prefix_cache_entries=1)
    with pytest.raises(errors.ClosedError):
        m.with_context_pool(1)


# -- prefix cache -------------------------------------------------------------------
def test_repeated_prompt_is_served_from_cache_with_identical_output(base):
    prompt = EVIDENCE + " Who is the clerk?"
    expected = greedy(base, prompt)
    with base.with_optimizer(prefix_cache_entries=1) as fast:
        cold = greedy(fast, prompt)
        warm = greedy(fast, prompt)
        assert cold.tokens == warm.tokens == expected.tokens
        assert cold.timings.prefix_cache_hit == 0 and cold.usage.cached_input_tokens == 0
        assert warm.timings.prefix_cache_hit == 1 and warm.timings.context_pool_reused == 1
        # the prompt's tail (its last token or a few more: the kept part ends on a row block) is evaluated
        # again, for the last row's logits, in the micro-batch the uncached run gave it (see reuse), and is
        # not counted as cached
        assert warm.usage.cached_input_tokens == fast.reuse_shape.reuse_limit(warm.usage.prompt_tokens)
        assert 1 <= warm.timings.evaluated_prompt_tokens < 1 + fast.reuse_shape.row_block
        # what the pool held when each request arrived
        assert cold.timings.prefix_cache_entries == 0 and cold.timings.prefix_cache_retained_tokens == 0
        assert warm.timings.prefix_cache_entries == 1
        assert warm.timings.prefix_cache_retained_tokens == fast.reuse_shape.retained_rows(warm.usage.prompt_tokens, warm.usage.prompt_tokens)


@pytest.mark.parametrize(
    "first, second, hit",
    [
        (EVIDENCE + " Who is the clerk?", EVIDENCE + " What is the fund?", True),  # changed suffix
        ("Preface. " + EVIDENCE, "Foreword. " + EVIDENCE, False),  # only the template's opening is shared
        (EVIDENCE, "Something else entirely, short.", False),  # unrelated
    ],
)
def test_cached_and_uncached_outputs_are_token_identical(base, first, second, hit):
    with base.with_optimizer(prefix_cache_entries=2) as fast:
        greedy(fast, first)
        r = greedy(fast, second)
        assert r.tokens == greedy(base, second).tokens
        shared = llm.prefix_pool.common_prefix_length(base.prompt_tokens(first), base.prompt_tokens(second))
        assert r.timings.prefix_cache_hit == int(hit)
        assert r.usage.cached_input_tokens == (fast.reuse_shape.restore_point(shared, r.usage.prompt_tokens) if hit else 0)
        assert r.timings.evaluated_prompt_tokens == r.usage.prompt_tokens - r.usage.cached_input_tokens


def logprob_rows(r):
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top]) for e in r.logprobs]


@pytest.fixture(scope="module")
def quantized(fixture_models):
    with llm.load(fixture_models["llama_q8_0"], context=CTX) as m:
        yield m


@pytest.mark.parametrize("model", ["base", "quantized"])
@pytest.mark.parametrize(
    "earlier", [" Who is the clerk?", " W", " Who keeps the salt barn and the quay?" * 3, " Who is the treasurer? Be brief."],
)
def test_reuse_is_bitwise_exact_wherever_the_cached_part_ends(request, model, earlier):
    """Every logprob of a cached request equals its uncached run's on the same kind of lease (``reuse``).

    The earlier prompt shares the evidence and leaves the cache at another
    point each time (a short, a one-word and a long continuation, and one
    holding the whole question, so only the template's closing tokens differ),
    so the restore point and the tail's micro-batches differ from the cold run's.
    (f16 and q8_0 weights: quantized weights take other kernels for small micro-batches.)
    """
    base = request.getfixturevalue(model)
    prompt = EVIDENCE + " Who is the treasurer?"
    with base.with_optimizer(prefix_cache_entries=1) as cold_lease:
        cold = cold_lease.generate(prompt, max_tokens=12, logprobs=True, top_logprobs=5)
        assert cold.usage.cached_input_tokens == 0
        # the context a prefix cache uses on a CPU runs attention without flash attention (reuse_attention)
        assert cold_lease._params.flash_attention == "off" and base._params.flash_attention == "auto"
    with base.with_optimizer(prefix_cache_entries=1) as fast:
        fast.generate(EVIDENCE + earlier, max_tokens=4)
        warm = fast.generate(prompt, max_tokens=12, logprobs=True, top_logprobs=5)
    assert warm.usage.cached_input_tokens == fast.reuse_shape.restore_point(
        llm.prefix_pool.common_prefix_length(base.prompt_tokens(EVIDENCE + earlier), base.prompt_tokens(prompt)),
        warm.usage.prompt_tokens,
    ) > 0
    assert warm.tokens == cold.tokens
    assert logprob_rows(warm) == logprob_rows(cold)


def test_retention_is_capped_by_prefix_cache_tokens(base):
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_tokens=10) as fast:
        greedy(fast, EVIDENCE)
        held = fast._state.pool.retained_tokens()
        # 10 capped, then cut to the shape's row block (ReuseShape.retained_rows)
        kept = fast.reuse_shape.floor(10)
        assert len(held) == 1 and held[0] == tuple(base.prompt_tokens(EVIDENCE)[:kept])
        r = greedy(fast, EVIDENCE)
        assert r.usage.cached_input_tokens == kept


def test_template_only_match_keeps_the_useful_entry(base):
    with base.with_optimizer(prefix_cache_entries=2) as fast:
        greedy(fast, EVIDENCE)
        greedy(fast, "zzz")  # shares only the template opening with EVIDENCE
        pool = fast._state.pool
        assert pool.entries == 2 and pool.created == 2
        r = greedy(fast, EVIDENCE)
        assert r.usage.cached_input_tokens == fast.reuse_shape.reuse_limit(r.usage.prompt_tokens)


def test_independent_profiles_and_loads_never_share_kv(base, llama_path):
    with base.with_optimizer(prefix_cache_entries=1) as a, base.with_optimizer(prefix_cache_entries=1) as b:
        greedy(a, EVIDENCE)
        assert greedy(b, EVIDENCE).usage.cached_input_tokens == 0
        assert greedy(a, EVIDENCE).usage.cached_input_tokens > 0
    with llm.load(llama_path, context=CTX) as other:
        with other.with_optimizer(prefix_cache_entries=1) as c:
            assert greedy(c, EVIDENCE).usage.cached_input_tokens == 0


def test_max_tokens_zero_leaves_the_pool_untouched(base):
    with base.with_optimizer(prefix_cache_entries=1) as fast:
        greedy(fast, EVIDENCE)
        pool = fast._state.pool
        before = (pool.retained_tokens(), pool.created)
        r = fast.generate(EVIDENCE + " more", max_tokens=0)
        assert r.tokens == () and (pool.retained_tokens(), pool.created) == before


def test_cancelled_and_failed_requests_leave_nothing_in_the_pool(base, monkeypatch):
    with base.with_optimizer(prefix_cache_entries=2) as fast:
        pool = fast._state.pool
        s = fast.stream(EVIDENCE, max_tokens=20)
        next(s)
        s.cancel()
        assert s.response.finish_reason == "cancelled" and pool.entries == 0

        calls = {"n": 0}
        real = _engine.NativeContext.decode

        def failing(self, batch):
            calls["n"] += 1
            if calls["n"] == 3:
                raise errors.EngineError("injected decode failure")
            return real(self, batch)

        monkeypatch.setattr(_engine.NativeContext, "decode", failing)
        with pytest.raises(errors.EngineError, match="injected"):
            greedy(fast, EVIDENCE, 10)
        monkeypatch.setattr(_engine.NativeContext, "decode", real)
        assert pool.entries == 0
        ok = greedy(fast, EVIDENCE)
        assert ok.tokens == greedy(base, EVIDENCE).tokens and pool.entries == 1


def test_sliding_window_model_reuses_prefix_correctly(fixture_models):
    # the gemma3 fixture has a 32-token sliding window on layer 0
    with llm.load(fixture_models["gemma3"], context=CTX) as plain:
        assert plain._weights.facts.sliding_window == 32
        with plain.with_optimizer(prefix_cache_entries=2) as fast:
            long_a = EVIDENCE + " First question about the quay?"
            long_b = EVIDENCE + " Second question about the barn?"
            shared = llm.prefix_pool.common_prefix_length(plain.prompt_tokens(long_a), plain.prompt_tokens(long_b))
            assert shared > 100  # far longer than the window
            for prompt in (long_a, long_a, long_b):
                r = greedy(fast, prompt, 12)
                assert r.tokens == greedy(plain, prompt, 12).tokens
            # long_b took long_a's entry and trimmed it back to the shared prefix, below the window
            assert r.usage.cached_input_tokens == fast.reuse_shape.restore_point(shared, r.usage.prompt_tokens) > 100
            short_a, short_b = "tell me one thing", "tell me two things"  # divergence inside the window
            greedy(fast, short_a, 12)
            r = greedy(fast, short_b, 12)
            assert r.tokens == greedy(plain, short_b, 12).tokens


def test_sliding_window_trim_far_below_the_window(fixture_models):
    # An entry much longer than window + micro-batch, then a prompt that diverges near its start:
    # the trim lands where a window-sized SWA cache no longer holds the positions the next
    # tokens attend to. Pooled contexts keep the full SWA cache, so reuse stays exact.
    long_tail = " ".join(f"item{i}" for i in range(40))
    first = "Intro shared words here. " + long_tail
    second = "Intro shared words there. " + long_tail
    with llm.load(fixture_models["gemma3"], context=CTX) as plain:
        with plain.with_optimizer(prefix_cache_entries=1, micro_batch_tokens=32, batch_tokens=64) as fast:
            assert len(plain.prompt_tokens(first)) > 32 + 32 + 100
            greedy(fast, first, 8)
            r = greedy(fast, second, 8)
            assert r.timings.prefix_cache_hit == 1 and r.usage.cached_input_tokens > 4
            with plain.with_optimizer(micro_batch_tokens=32, batch_tokens=64) as same_shape:
                assert r.tokens == greedy(same_shape, second, 8).tokens


# -- prompt lookup ---------------------------------------------------------------
REPETITIVE = "Repeat exactly: alpha beta gamma delta, alpha beta gamma delta, alpha beta gamma delta,"
PLAIN = "Write one new sentence about weather."


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("prompt", [REPETITIVE, PLAIN, EVIDENCE])
def test_speculative_output_equals_plain_greedy(free_rows, fixture_models, arch, prompt):
    with llm.load(fixture_models[arch], context=CTX) as plain, plain.with_optimizer(speculative_tokens=6) as spec:
        expected = greedy(plain, prompt, 40)
        r = greedy(spec, prompt, 40)
        assert r.tokens == expected.tokens and r.text == expected.text
        t = r.timings
        assert t.speculative_tokens == 6
        # every verification step proposed 1..6 tokens; what was accepted was proposed
        steps = t.speculative_verification_steps
        assert steps <= t.speculative_proposed_tokens <= 6 * steps
        assert t.speculative_accepted_tokens <= t.speculative_proposed_tokens
        assert steps <= t.decode_calls
        # every verification or plain step is one decode call; accepted proposals save calls
        assert t.decode_calls == t.generated_tokens - 1 - t.speculative_accepted_tokens


def test_speculation_pays_on_repetitive_output(free_rows, llama_path):
    with llm.load(llama_path, context=CTX) as plain, plain.with_optimizer(speculative_tokens=8) as spec:
        r = greedy(spec, REPETITIVE, 64)
        t = r.timings
        assert t.speculative_accepted_tokens > 0 and t.decode_calls < t.generated_tokens - 1
        assert r.tokens == greedy(plain, REPETITIVE, 64).tokens


def test_an_earlier_answer_of_the_same_lease_is_drafted_and_verified(free_rows, llama_path):
    """The lease's corpus holds request 1's answer: re-running the prompt drafts it; another lease has no corpus of it."""
    with llm.load(llama_path, context=CTX) as plain, plain.with_optimizer(speculative_tokens=8) as spec, \
            plain.with_optimizer(speculative_tokens=8) as other:
        expected = greedy(plain, PLAIN, 40)
        first = greedy(spec, PLAIN, 40)
        second = greedy(spec, PLAIN, 40)
        independent = greedy(other, PLAIN, 40)
        assert first.tokens == second.tokens == independent.tokens == expected.tokens
        t1, t2, t3 = first.timings, second.timings, independent.timings
        assert t2.speculative_accepted_tokens > t1.speculative_accepted_tokens
        # nearly every step verifies a long run of the earlier answer (8 proposals + 1 per call)
        assert t2.decode_calls <= -(-(t2.generated_tokens - 1) // 9) + 1
        # the other lease never saw request 1: its first run drafts exactly as the first lease's did
        assert (t3.speculative_proposed_tokens, t3.speculative_accepted_tokens, t3.decode_calls) == (
            t1.speculative_proposed_tokens, t1.speculative_accepted_tokens, t1.decode_calls)


def test_forced_rejections_roll_back_and_keep_output(free_rows, llama_path, monkeypatch):
    with llm.load(llama_path, context=CTX) as plain, plain.with_optimizer(speculative_tokens=4) as spec:
        expected = greedy(plain, EVIDENCE, 30)
        vocab = plain._weights.native.n_vocab

        def wrong(self, k):  # proposals the model will (almost surely) reject
            return lookup_module.Draft(tuple((self.tokens[-1] + 1 + i) % vocab for i in range(k)), match=2)

        monkeypatch.setattr(lookup_module.NgramIndex, "lookup", wrong)
        r = greedy(spec, EVIDENCE, 30)
        t = r.timings
        assert r.tokens == expected.tokens
        assert t.speculative_proposed_tokens > t.speculative_accepted_tokens
        # every rejection rolled back; the draft policy then stops proposing after 2-token matches
        assert 1 <= t.speculative_verification_steps < t.decode_calls


def test_speculative_stream_sees_only_verified_text(free_rows, llama_path):
    with llm.load(llama_path, context=CTX) as plain, plain.with_optimizer(speculative_tokens=8) as spec:
        s = spec.stream(REPETITIVE, max_tokens=48)
        assert "".join(s) == greedy(plain, REPETITIVE, 48).text


def test_temperature_is_rejected_with_speculation(base):
    with base.with_optimizer(speculative_tokens=4) as spec:
        with pytest.raises(errors.InvalidRequestError, match="temperature=0.7 is not allowed"):
            spec.generate("x", temperature=0.7)
        assert greedy(spec, "x", 2).usage.completion_tokens >= 1


def test_prefix_cache_and_speculation_together(free_rows, base):
    with base.with_optimizer(prefix_cache_entries=1, speculative_tokens=6) as fast:
        first = greedy(fast, REPETITIVE, 40)
        second = greedy(fast, REPETITIVE, 40)
        assert first.tokens == second.tokens == greedy(base, REPETITIVE, 40).tokens
        assert second.timings.prefix_cache_hit == 1


def test_engine_fact_window_sized_swa_cache_loses_trimmed_range(fixture_models):
    """Why latency contexts use swa_full: seq_rm 'succeeds' yet the kept range is gone."""
    native = _engine.NativeModel(str(fixture_models["gemma3"]))
    try:
        tokens = [40 + i % 200 for i in range(300)]
        for swa_full, intact in ((False, False), (True, True)):
            ctx = _engine.NativeContext(native, _engine.ContextParams(n_ctx=512, n_batch=64, n_ubatch=32, swa_full=swa_full))
            batch = _engine.Batch(64)
            for lo in range(0, 300, 64):
                batch.clear()
                batch.add_run(tokens[lo : lo + 64], lo, 0)
                ctx.decode(batch)
            assert ctx.trim(0, 10) is intact
            ctx.free()
    finally:
        native.free()
