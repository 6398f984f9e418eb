"""Seed-rule deviations an audit found (issue 18), each pinned by a test.

- ``speculative_tokens >= batch_tokens`` decodes plainly instead of raising;
- ``with_context_pool(0)`` is ignored on a prefix-cache lease;
- the model is loaded on one device, never split across every visible GPU;
- a cancelled request stops between prefill chunks, not only between decode steps;
- a request cancelled while it waits to start ends cancelled without touching the KV.

Every output is compared with a fresh lease's answer to the same request.
"""

from __future__ import annotations

import gc
import time

import pytest

from aner_nb import llm
from aner_nb.llm import _engine, errors
from aner_nb.llm.profiles import OptimizerSettings

CTX = 512
CHUNK = 16  # batch_tokens of the chunked-prefill leases: a long prompt takes many llama_decode calls
LONG = "the harbor ledger lists the treasurer, the clerk and the lighthouse fund " * 6
REPEATING = "one two three four five six seven eight. one two three four five six seven eight. one two three"
SPECULATIVE_FIELDS = (
    "speculative_tokens", "speculative_proposed_tokens", "speculative_accepted_tokens",
    "speculative_verification_steps",
)


@pytest.fixture(scope="module")
def base(llama_path):
    with llm.load(llama_path, context=CTX) as m:
        yield m


@pytest.fixture
def decodes(monkeypatch):
    """Every llama_decode call as ``(context, tokens in the batch)``; ``on_call`` runs after each."""
    calls: list[tuple[object, int]] = []
    hooks: list = []
    original = _engine.NativeContext.decode

    def counting(self, batch):
        rc = original(self, batch)
        calls.append((self, batch.n_tokens))
        for hook in hooks:
            hook(len(calls))
        return rc

    monkeypatch.setattr(_engine.NativeContext, "decode", counting)
    counting.calls, counting.hooks = calls, hooks  # type: ignore[attr-defined]
    return counting


# -- speculative_tokens >= batch_tokens: plain decoding ----------------------------------------------
def test_speculation_that_cannot_fit_a_batch_falls_back_to_plain_settings():
    assert OptimizerSettings(speculative_tokens=8, batch_tokens=8, micro_batch_tokens=8).draft_tokens == 0
    assert OptimizerSettings(speculative_tokens=16, batch_tokens=4, micro_batch_tokens=4).draft_tokens == 0
    assert OptimizerSettings(speculative_tokens=7, batch_tokens=8, micro_batch_tokens=8).draft_tokens == 7
    assert OptimizerSettings(speculative_tokens=0).draft_tokens == 0


def test_speculation_that_cannot_fit_a_batch_decodes_plainly(free_rows, base, decodes):
    small = {"batch_tokens": 8, "micro_batch_tokens": 8}
    with base.with_optimizer(speculative_tokens=8, **small) as fallback, \
            base.with_optimizer(**small) as plain, base.with_optimizer(speculative_tokens=4, **small) as drafting:
        # The control: this prompt makes a speculating lease of the same batch size propose drafts.
        drafted = drafting.generate(REPEATING, max_tokens=24)
        assert drafted.timings.speculative_proposed_tokens > 0
        assert not fallback.supports("speculative") and drafting.supports("speculative")

        expected = plain.generate(REPEATING, max_tokens=24)
        decodes.calls.clear()
        r = fallback.generate(REPEATING, max_tokens=24)
        assert r.tokens == expected.tokens == drafted.tokens and r.text == expected.text
        # No drafts: the timings say what a plain lease says, and every decode step is one token.
        for name in SPECULATIVE_FIELDS:
            assert getattr(r.timings, name) == getattr(expected.timings, name), name
        assert r.timings.speculative_tokens == 0 and r.timings.speculative_proposed_tokens == -1
        assert r.timings.decode_calls == expected.timings.decode_calls == len(r.tokens) - 1
        prefill_calls = -(-r.usage.prompt_tokens // 8)
        assert [n for _, n in decodes.calls[prefill_calls:]] == [1] * r.timings.decode_calls
        # Plain decoding takes sampling options, as any non-speculating lease does.
        sampled = dict(max_tokens=12, temperature=0.8, seed=11, top_k=20)
        assert fallback.generate(REPEATING, **sampled).tokens == plain.generate(REPEATING, **sampled).tokens


# -- with_context_pool(0) on a prefix-cache lease -----------------------------------------------
@pytest.mark.parametrize("order", ["pool_then_optimizer", "optimizer_then_pool"])
def test_context_pool_zero_is_ignored_by_a_prefix_cache_lease(base, order):
    prompt = LONG + " Who keeps the fund?"
    with base.with_optimizer(prefix_cache_entries=2) as reference:
        expected = [reference.generate(prompt, max_tokens=8) for _ in range(2)]
    if order == "pool_then_optimizer":
        lease = base.with_context_pool(0).with_optimizer(prefix_cache_entries=2)
    else:
        lease = base.with_optimizer(prefix_cache_entries=2).with_context_pool(0)
    with lease:
        assert lease.profile.max_idle_contexts == 0
        assert lease.supports("prefix_cache") and lease.kind == "latency"
        got = [lease.generate(prompt, max_tokens=8) for _ in range(2)]
        assert [r.tokens for r in got] == [r.tokens for r in expected]
        for name in ("cached_input_tokens", "prefix_cache_hit", "prefix_cache_entries", "prefix_cache_retained_tokens"):
            assert [getattr(r.timings, name) for r in got] == [getattr(r.timings, name) for r in expected], name
        assert got[1].timings.prefix_cache_hit == 1 and got[1].usage.cached_input_tokens > 0
        assert lease._state.pool.entries == 1  # the retained context is still kept


# -- one accelerator, requested explicitly --------------------------------------------------------
def test_model_params_request_one_device_and_no_split():
    assert _engine.single_device(-1) == ("LLAMA_SPLIT_MODE_NONE", 0)  # every layer on GPU 0 only
    assert _engine.single_device(20) == ("LLAMA_SPLIT_MODE_NONE", 0)
    assert _engine.single_device(0) == ("LLAMA_SPLIT_MODE_NONE", -1)  # CPU: no GPU at all


def test_a_loaded_model_asked_llama_cpp_for_no_split(base):
    lib = _engine._llama()
    assert lib.LLAMA_SPLIT_MODE_NONE != lib.llama_model_default_params().split_mode  # the default would split
    split_mode, main_gpu = base._weights.native.placement
    assert split_mode == lib.LLAMA_SPLIT_MODE_NONE
    assert main_gpu == (0 if base.device != "cpu" else -1)


# -- cancellation during prefill ----------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"prefix_cache_entries": 1}], ids=["ordinary", "prefix_cache"])
def test_a_cancel_during_prefill_stops_before_the_prompt_is_evaluated(base, decodes, options):
    settings = dict(batch_tokens=CHUNK, micro_batch_tokens=CHUNK, **options)
    n_prompt = len(base.prompt_tokens(LONG))
    assert n_prompt > 4 * CHUNK
    with base.with_optimizer(**settings) as lease:
        stream = lease.stream(LONG, max_tokens=8)
        decodes.hooks.append(lambda n: stream.cancel() if n == 1 else None)  # after the first chunk
        assert list(stream) == []
        decodes.hooks.clear()
        r = stream.response
        assert r.finish_reason == "cancelled" and r.tokens == () and r.text == ""
        assert len(decodes.calls) == 1  # stopped at the next chunk boundary, not at the end of the prompt
        assert r.timings.evaluated_prompt_tokens == CHUNK < n_prompt
        assert r.timings.generated_tokens == 0 and r.timings.decode_calls == 0

        again = lease.generate(LONG, max_tokens=8)  # the lease is free and its half-filled KV is gone
        if not options:
            assert again.timings.context_pool_reused == 1  # the cancelled context was kept and cleared
        with base.with_optimizer(**settings) as fresh:
            expected = fresh.generate(LONG, max_tokens=8)
        assert again.tokens == expected.tokens and again.text == expected.text
        assert again.usage == expected.usage


def test_a_cancel_during_a_session_prefill_leaves_no_turn(base, decodes):
    with base.with_optimizer(batch_tokens=CHUNK, micro_batch_tokens=CHUNK) as lease:
        chat = lease.session()
        stream = chat.stream(LONG, max_tokens=6)
        decodes.hooks.append(lambda n: stream.cancel() if n == 2 else None)
        assert list(stream) == [] and stream.response.finish_reason == "cancelled"
        decodes.hooks.clear()
        assert stream.response.timings.evaluated_prompt_tokens == 2 * CHUNK
        got = chat.send(LONG, max_tokens=6)
        expected = lease.session().send(LONG, max_tokens=6)
        assert got.tokens == expected.tokens and got.usage.cached_input_tokens == 0


# -- a request cancelled before it starts ---------------------------------------------------------
def test_an_ordinary_request_cancelled_before_it_runs_touches_no_kv(base, decodes):
    with base.with_context_pool(1) as lease:
        waiting = lease.stream("hello there", max_tokens=6)  # submitted: it holds the lease, nothing evaluated
        waiting.cancel()
        assert waiting.done and list(waiting) == []
        r = waiting.response
        assert r is not None and r.finish_reason == "cancelled" and r.tokens == ()
        assert r.timings.evaluated_prompt_tokens == 0 and r.usage.prompt_tokens > 0
        assert decodes.calls == []
        # The lease is free at once, and its untouched context went back to the pool.
        after = lease.generate("hello there", max_tokens=6)
        assert after.timings.context_pool_reused == 1
        assert after.tokens == base.generate("hello there", max_tokens=6).tokens

        forgotten = lease.stream("hello again", max_tokens=6)  # dropped unread: the finalizer cancels it
        job = forgotten._driver.job
        del forgotten
        gc.collect()
        assert job.result is not None and job.result.finish_reason == "cancelled"
        assert lease.generate("x", max_tokens=2).timings.context_pool_reused == 1


def test_a_queued_batched_request_cancelled_before_admission_never_runs(base):
    solo = base.generate("hello", max_tokens=30)
    with base.with_batching(1) as serving:
        holder = serving.stream("hello", max_tokens=30)  # holds the only sequence (paused, unread)
        deadline = time.monotonic() + 10
        while serving.stats().active != 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        queued = serving.stream("the cat sat on the mat", max_tokens=10)
        assert serving.stats().waiting == 1
        queued.cancel()
        assert queued.done and list(queued) == []
        r = queued.response
        assert r.finish_reason == "cancelled" and r.tokens == () and r.timings.evaluated_prompt_tokens == 0
        stats = serving.stats()
        assert (stats.waiting, stats.admitted, stats.cancelled) == (0, 1, 1)  # never admitted
        assert "".join(holder) == solo.text and holder.response.tokens == solo.tokens


@pytest.mark.parametrize("digest", ["a" * 64 + "\n", "A" * 64, "a" * 63, None])
def test_a_profile_names_its_adapter_by_an_exact_lowercase_digest(digest):
    from aner_nb.llm.profiles import Profile

    if digest is None:
        assert Profile(adapter="0" * 64).adapter == "0" * 64
        return
    with pytest.raises(errors.ConfigurationError) as info:
        Profile(adapter=digest)
    assert info.value.param == "adapter" and "lowercase SHA-256" in str(info.value)
