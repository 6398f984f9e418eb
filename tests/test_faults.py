"""Fault injection at the engine edge (``aner_nb.llm.faults.inject``) on every lease kind.

Each fault (a failed or refused decode, a tokenizer failure, a free that
raises, a context that cannot be made, a KV trim refused or interrupted, a
cancellation at each phase, the model file changed around the load, the
batching scheduler thread raising) must leave: the faulted request failed
with a typed error (or cancelled), every other request with its solo output,
no native owner (context, batch, sampler) beyond what the lease's pool holds,
nothing from the failed request in a pool, and the next request's output
equal to a fresh lease's.
"""

from __future__ import annotations

import gc
import os
import shutil
import threading

import pytest

from aner_nb import llm
from aner_nb.llm import _engine, errors
from aner_nb.llm._engine import DECODE_NO_KV_SLOT
from aner_nb.llm.faults import Fault, armed, inject
from aner_nb.llm.context_pool import ContextPool

CTX = 1024
PROMPT = "the cat sat on the mat and"
OTHER = "once upon a time there was"
# Repetitive, so prompt lookup proposes (and verification runs) from the first decode steps.
REPEAT = "a b c d e f g a b c d e f g a b c d e f g a b c d"
LONG = "tell me about the sea and the sky and the ships on the water " * 3
N = 12

KINDS = {
    "ordinary": lambda base: base.with_context_pool(1),
    "prefix": lambda base: base.with_optimizer(prefix_cache_entries=2),
    "speculative": lambda base: base.with_optimizer(prefix_cache_entries=2, speculative_tokens=4),
}
# The same kinds with 8-token prefill chunks, so a prompt takes several llama_decode calls.
CHUNKED = {
    "ordinary": lambda base: base.with_optimizer(batch_tokens=8, micro_batch_tokens=8),
    "prefix": lambda base: base.with_optimizer(batch_tokens=8, micro_batch_tokens=8, prefix_cache_entries=2),
    "speculative": lambda base: base.with_optimizer(
        batch_tokens=8, micro_batch_tokens=8, prefix_cache_entries=2, speculative_tokens=4),
}


pytestmark = pytest.mark.usefixtures("one_thread", "free_rows")  # conftest: one engine thread; every lookup verified


@pytest.fixture(scope="module")
def base(llama_path, one_thread):
    with llm.load(llama_path, context=CTX, progress=False) as m:
        yield m


_fresh: dict = {}


def ordinary(base):
    return base.with_context_pool(0)


def fresh(base, prompt, make=ordinary):
    """The tokens of ``prompt`` on a fresh lease built by ``make`` (computed once, never faulted)."""
    key = (make, prompt)
    if key not in _fresh:
        with make(base) as lease:
            _fresh[key] = lease.generate(prompt, max_tokens=N).tokens
    return _fresh[key]


def pool_contexts(lease) -> int:
    pool = lease._state.pool
    return pool.idle if isinstance(pool, ContextPool) else pool.entries


def assert_clean(lease, base, contexts_before, injection):
    """Native owners are back: only what the pool retains is alive; no sampler or batch is left over."""
    gc.collect()
    native = base._weights.native
    held = pool_contexts(lease)
    assert native.live_contexts() == contexts_before + held
    live = injection.live()
    assert live.get("sampler", 0) == 0
    assert live.get("batch", 0) == live.get("context", 0) <= held
    pool = lease._state.pool
    if not isinstance(pool, ContextPool):
        assert pool._in_use == 0  # every acquire was given back


def assert_next_equals_fresh(lease, base, make):
    for prompt in (PROMPT, REPEAT):
        assert lease.generate(prompt, max_tokens=N).tokens == fresh(base, prompt, make)


def prefill_rows(ctx, batch):
    return batch.n_tokens > 1


# -- engine faults on the exclusive leases (ordinary, prefix cache, speculative) ------------------------
FAULTS = {
    "decode error in prefill": (Fault("decode", result=-3), "llama_decode failed with code -3"),
    "decode error in decode": (Fault("decode", after=2, result=-3), "llama_decode failed with code -3"),
    "no KV slot in prefill": (Fault("decode", result=DECODE_NO_KV_SLOT), "no KV slot"),
    "no KV slot in decode": (Fault("decode", after=2, result=DECODE_NO_KV_SLOT), "no KV slot"),
    "tokenizer": (Fault("tokenize"), "injected fault at tokenize"),
    "detokenizer": (Fault("token_bytes", after=3), "injected fault at token_bytes"),
    "no context": (Fault("context_init"), "injected fault at context_init"),
    "free after a failure": (
        Fault("free", when=lambda owner: owner._what == "context"), "injected fault at free"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault", FAULTS)
def test_an_engine_fault_fails_the_request_typed_and_leaves_nothing(base, kind, fault):
    # "no context": an empty pool, so the request needs a new context (that cannot be made)
    make = ordinary if (kind, fault) == ("ordinary", "no context") else KINDS[kind]
    with make(base) as lease:
        if fault != "no context":
            lease.generate(OTHER, max_tokens=N)  # a retained entry / idle context that must survive
        contexts = base._weights.native.live_contexts() - pool_contexts(lease)
        armed, message = FAULTS[fault]
        if fault == "free after a failure":  # the failed request's context is freed, and that raises
            armed = (armed, Fault("decode", after=1, result=-3))
        faults = armed if isinstance(armed, tuple) else (armed,)
        with inject(*faults) as injection:
            with pytest.raises(errors.EngineError, match=message):
                lease.generate(LONG if fault == "no context" else PROMPT, max_tokens=N)
            assert injection.fired() == len(faults)
        if kind != "ordinary":  # nothing of the failed prompt is retained; the earlier entry is
            retained = lease._state.pool.retained_tokens()
            failed = tuple(lease.prompt_tokens(PROMPT))
            assert all(t != failed[: len(t)] or len(t) <= lease._state.pool.trivial_prefix for t in retained)
        assert_clean(lease, base, contexts, injection)
        assert_next_equals_fresh(lease, base, make)


def test_a_failing_free_still_frees_the_rest_of_the_slot(base):
    """ContextSlot.free frees its batch even when freeing the context raises (e.g. Ctrl-C)."""
    make = ordinary
    with make(base) as lease:
        contexts = base._weights.native.live_contexts()
        with inject(Fault("free", when=lambda owner: owner._what == "context", error=KeyboardInterrupt())) as inj:
            with pytest.raises(KeyboardInterrupt) as info:
                lease.generate(PROMPT, max_tokens=N)  # succeeds, then giving its context back is interrupted
            # While the traceback still references the slot: its batch was freed anyway.
            assert inj.live().get("batch", 0) == 0 and inj.live().get("context", 0) == 1
            del info
        assert_clean(lease, base, contexts, inj)
        assert_next_equals_fresh(lease, base, make)


@pytest.mark.parametrize("kind", ["prefix", "speculative"])
@pytest.mark.parametrize("refused", [True, False], ids=["trim refused", "trim interrupted"])
def test_a_prefix_trim_refused_or_interrupted_on_reuse(base, kind, refused):
    """A retained entry whose trim fails is not reused; an interrupted one is freed and its use returned."""
    make = KINDS[kind]
    with make(base) as lease:
        lease.generate(PROMPT, max_tokens=N)
        contexts = base._weights.native.live_contexts() - pool_contexts(lease)
        fault = Fault("seq_rm", result=False) if refused else Fault("seq_rm", error=KeyboardInterrupt())
        reference = fresh(base, PROMPT, make)
        with inject(fault) as injection:
            if refused:
                r = lease.generate(PROMPT, max_tokens=N)
                assert r.tokens == reference and r.usage.cached_input_tokens == 0
            else:
                with pytest.raises(KeyboardInterrupt):
                    lease.generate(PROMPT, max_tokens=N)
            assert injection.fired() == 1
        assert_clean(lease, base, contexts, injection)
        assert_next_equals_fresh(lease, base, make)


# -- cancellation at every phase -----------------------------------------------------------------------
def cancel_at(stream_box, **fault):
    return Fault("decode", action=lambda *_: stream_box[0].cancel(), **fault)


PHASES = [(kind, phase) for phase in ("prefill chunk", "decode", "interrupt") for kind in KINDS]
PHASES.append(("speculative", "verification"))  # verification runs on speculative leases only


@pytest.mark.parametrize("kind, phase", PHASES)
def test_cancellation_at_each_phase(base, kind, phase):
    make = CHUNKED[kind] if phase == "prefill chunk" else KINDS[kind]
    with make(base) as lease:
        lease.generate(OTHER, max_tokens=N)
        contexts = base._weights.native.live_contexts() - pool_contexts(lease)
        prompt = REPEAT if phase == "verification" else LONG
        reference = fresh(base, prompt, make)
        box: list = []
        if phase == "prefill chunk":
            fault = cancel_at(box, after=1)  # between the first and second 8-token chunk
        elif phase == "decode":
            fault = cancel_at(box, after=3)
        elif phase == "verification":  # the first multi-row batch after the prompt's is a verification
            fault = cancel_at(box, after=1, when=prefill_rows)
        else:
            fault = Fault("decode", after=3, error=KeyboardInterrupt())
        with inject(fault) as injection:
            if phase == "interrupt":  # Ctrl-C in generate: re-raised, the context is not reused dirty
                with pytest.raises(KeyboardInterrupt):
                    lease.generate(prompt, max_tokens=N)
            else:
                box.append(lease.stream(prompt, max_tokens=N))
                text = "".join(box[0])
                response = box[0].response
                assert response.finish_reason == "cancelled" and text == response.text
                assert response.tokens == reference[: len(response.tokens)]
                if phase == "prefill chunk":
                    assert len(response.tokens) <= 1
            assert injection.fired() == 1
        if kind != "ordinary":
            other = lease.prompt_tokens(OTHER)  # still the entry, as retained (cut to a row block, llm.reuse)
            assert lease._state.pool.retained_tokens()[-1] == tuple(other[: lease.reuse_shape.retained_rows(len(other), len(other))])
        assert_clean(lease, base, contexts, injection)
        assert_next_equals_fresh(lease, base, make)


@pytest.mark.parametrize("kind", ["prefix", "speculative"])
def test_cancellation_during_prefix_cache_retention(base, kind):
    """Ctrl-C while a finished request's context is trimmed for retention: freed, not retained, use returned."""
    make = KINDS[kind]
    with make(base) as lease:
        lease.generate(OTHER, max_tokens=N)
        contexts = base._weights.native.live_contexts() - pool_contexts(lease)
        before = lease._state.pool.retained_tokens()
        n = len(lease.prompt_tokens(PROMPT))
        keep = lease.reuse_shape.retained_rows(n, n)  # the retention trim: positions from the kept prompt's end
        with inject(Fault("seq_rm", error=KeyboardInterrupt(),
                          when=lambda ctx, seq, p0, p1: (p0, p1) == (keep, -1))) as injection:
            stream = lease.stream(PROMPT, max_tokens=N)
            with pytest.raises(KeyboardInterrupt):
                for _ in stream:
                    pass
            assert injection.fired() == 1
        assert stream.response.tokens == fresh(base, PROMPT, make)  # the answer itself was complete
        assert lease._state.pool.retained_tokens() == before
        assert_clean(lease, base, contexts, injection)
        assert_next_equals_fresh(lease, base, make)


# -- the model file changed around the load ------------------------------------------------------------
def wait_for_first_hash(*_):
    """The first hash pass runs on its own thread, beside the native load: let it see the original bytes."""
    for t in threading.enumerate():
        if t.name == "aner-sha256":
            t.join(30)


@pytest.mark.parametrize("change", ["replaced", "truncated", "rewritten"])
def test_model_file_changed_during_load(llama_path, tmp_path, change):
    path = tmp_path / "model.gguf"
    shutil.copy(llama_path, path)
    other = tmp_path / "other.gguf"
    shutil.copy(llama_path, other)
    with open(other, "r+b") as f:  # same size, one byte of tensor data differs
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    models: list = []

    def change_file(native):
        models.append(native)
        wait_for_first_hash()
        if change == "replaced":
            os.replace(other, path)
        elif change == "truncated":
            os.truncate(path, os.path.getsize(path) // 2)
        else:
            with open(path, "r+b") as f:
                f.seek(-1, 2)
                f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")

    with inject(Fault("model_loaded", action=change_file)) as injection:
        with pytest.raises(errors.ArtifactChangedError, match="changed while loading"):
            llm.load(path, context=256, progress=False)
    assert injection.fired() == 1 and len(models) == 1
    assert not models[0].alive and models[0].free_calls == 1
    gc.collect()
    assert injection.live() == {}


def test_model_file_truncated_before_the_native_load_is_an_engine_error(llama_path, tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copy(llama_path, path)

    def truncate(p):
        wait_for_first_hash()
        os.truncate(p, os.path.getsize(p) // 2)

    with inject(Fault("model_load", action=truncate)) as injection:
        with pytest.raises(errors.EngineError, match="failed to load"):
            llm.load(path, context=256, progress=False)
    gc.collect()
    assert injection.fired() == 1 and injection.live() == {}


# -- continuous batching: 2-3 concurrent requests, one of them faulted --------------------------------
PROMPTS = [PROMPT, OTHER, "hello", "a b c d e f g"]


@pytest.fixture(scope="module")
def solo(base):
    return {p: fresh(base, p) for p in PROMPTS}


def run_all(serving, prompts, **options):
    """Stream every prompt concurrently (one thread each); the Response or the exception of each."""
    out: list = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def run(i):
        barrier.wait()
        try:
            out[i] = serving.generate(prompts[i], max_tokens=N, **options)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def check_batched(serving, base, out, solo, contexts, expect_failed, message):
    failed = [o for o in out if isinstance(o, BaseException)]
    assert all(isinstance(o, errors.EngineError) and message in str(o) for o in failed), failed
    assert expect_failed(len(failed)), failed
    for prompt, o in zip(PROMPTS, out):
        if not isinstance(o, BaseException):
            assert o.tokens == solo[prompt]
    gc.collect()
    stats = serving.stats()
    assert stats.active == 0 and stats.waiting == 0
    # the shared context holds nothing of any request: every sequence is empty
    ctx = serving._scheduler._ctx
    assert all(ctx.seq_pos_max(seq) == -1 for seq in range(serving.max_sequences))
    assert base._weights.native.live_contexts() == contexts
    again = run_all(serving, PROMPTS[:3])
    assert [r.tokens for r in again] == [solo[p] for p in PROMPTS[:3]]


BATCH_FAULTS = {
    # A failed llama_decode fails the requests of that batch only; the rest (queued) complete.
    "decode error": (lambda: Fault("decode", after=2, result=-3), lambda n: 1 <= n <= 2, "batch failed"),
    "no KV slot": (lambda: Fault("decode", after=2, result=DECODE_NO_KV_SLOT), lambda n: n == 1, "no KV slot"),
    "detokenizer": (lambda: Fault("token_bytes", after=5), lambda n: n == 1, "injected fault at token_bytes"),
    "tokenizer": (
        lambda: Fault("tokenize", when=lambda model, text: "hello" in text), lambda n: n == 1,
        "injected fault at tokenize"),
}


@pytest.mark.parametrize("fault", BATCH_FAULTS)
def test_a_batching_fault_fails_one_request_and_the_others_match_solo(base, solo, fault):
    armed, expect_failed, message = BATCH_FAULTS[fault]
    contexts = base._weights.native.live_contexts()
    with base.with_batching(2) as serving:
        with inject(armed()) as injection:
            out = run_all(serving, PROMPTS[:3])
            assert injection.fired() == 1
        check_batched(serving, base, out, solo, contexts + 1, expect_failed, message)
        assert injection.live().get("sampler", 0) == 0


def test_a_sampler_failure_at_admission_fails_that_request_only(base, solo):
    """A sampled request's chain is built at admission; when that fails only it fails."""
    contexts = base._weights.native.live_contexts()
    with base.with_batching(2) as serving:
        with inject(Fault("sampler_init")) as injection:
            out = run_all(serving, PROMPTS[:3], temperature=0.0)  # greedy: no chain, nothing fires
            assert injection.fired() == 0
            failing = run_all(serving, ["hello", "hello"], temperature=0.7, seed=1)
            assert injection.fired() == 1
        assert sum(isinstance(o, errors.EngineError) for o in failing) == 1
        ok = [o for o in failing if not isinstance(o, BaseException)]
        assert ok and ok[0].tokens == serving.generate("hello", max_tokens=N, temperature=0.7, seed=1).tokens
        check_batched(serving, base, out, solo, contexts + 1, lambda n: n == 0, "")
        # A sampler chain that raises when freed at the end of its request: that request fails typed.
        with inject(Fault("free", when=lambda owner: owner._what == "sampler")) as injection:
            with pytest.raises(errors.EngineError, match="injected fault at free"):
                serving.generate("hello", max_tokens=4, temperature=0.7, seed=1)
            assert injection.fired() == 1
        gc.collect()
        assert injection.live() == {} and serving.stats().active == 0


def test_cancelling_a_queued_request_and_one_at_admission(base, solo):
    contexts = base._weights.native.live_contexts()
    with base.with_batching(1) as serving:
        gate = threading.Event()
        # The running request's second step waits until the queued one was cancelled.
        with inject(Fault("decode", after=1, action=lambda *_: gate.wait(10))) as injection:
            running = serving.stream(PROMPT, max_tokens=N)
            first = next(running)
            queued = serving.stream(OTHER, max_tokens=N)
            queued.cancel()
            gate.set()
            rest = "".join(running)
            assert queued.done and queued.response.finish_reason == "cancelled"
            assert queued.response.tokens == () and queued.response.timings.evaluated_prompt_tokens == 0
            assert running.response.tokens == solo[PROMPT] and first + rest == running.response.text
            assert injection.fired() == 1
        # Cancelled at admission (while its sampler chain is built): it ends before any step.
        box: list = []
        with inject(Fault("sampler_init", action=lambda *_: box[0].cancel())) as injection:
            steps = serving.stats().steps
            box.append(serving.stream(OTHER, max_tokens=N, temperature=0.7, seed=1))
            assert "".join(box[0]) == ""
            assert box[0].response.finish_reason == "cancelled" and box[0].response.tokens == ()
            assert injection.fired() == 1 and serving.stats().steps == steps
        # Cancelled during its first prefill step.
        with inject(Fault("decode", when=prefill_rows, action=lambda *_: box[1].cancel())) as injection:
            box.append(serving.stream(OTHER, max_tokens=N))
            assert "".join(box[1]) == box[1].response.text
            assert box[1].response.finish_reason == "cancelled" and len(box[1].response.tokens) <= 1
            assert injection.fired() == 1
        stats = serving.stats()
        assert stats.cancelled == 3 and stats.active == 0 and stats.waiting == 0
        assert serving._scheduler._ctx.seq_pos_max(0) == -1
        assert base._weights.native.live_contexts() == contexts + 1
        assert serving.generate(OTHER, max_tokens=N).tokens == solo[OTHER]


def test_the_scheduler_thread_raising_fails_every_request_and_closes_the_lease(base, solo):
    contexts = base._weights.native.live_contexts()
    serving = base.with_batching(2)
    scheduler = serving._scheduler
    ctx = scheduler._ctx
    # Not an EngineError: nothing in the step handles it, so it ends the scheduler thread. The first
    # decode holds the thread until all three requests were submitted (the others wait in the queue
    # meanwhile), then raises: none finished early or was refused as closed, however slow the machine.
    def wait_for_all_submitted(*_):
        while True:
            stats = serving.stats()
            if stats.admitted + stats.waiting >= 3:
                return
            threading.Event().wait(0.005)

    with inject(Fault("decode", error=RuntimeError("a bug in the scheduler"), action=wait_for_all_submitted)) as injection:
        out = run_all(serving, PROMPTS[:3])
        assert injection.fired() == 1
    scheduler.thread.join(10)
    assert not scheduler.thread.is_alive()
    assert all(isinstance(o, errors.EngineError) and "scheduler stopped" in str(o) for o in out), out
    assert serving.closed and not serving.supports("generate") and not serving.stats().running
    with pytest.raises(errors.ClosedError):
        serving.generate(PROMPT, max_tokens=N)
    assert not ctx.alive and base._weights.native.live_contexts() == contexts
    gc.collect()
    assert injection.live() == {}
    serving.close()
    assert base.generate(PROMPT, max_tokens=N).tokens == solo[PROMPT]  # the weights are unaffected


# -- the seam itself ---------------------------------------------------------------------------------
def test_the_seam_is_off_by_default_validates_and_does_not_nest(base):
    assert armed() is None and _engine._faults is None  # the seam and the engine's mirror of it
    with pytest.raises(ValueError, match="unknown fault point"):
        Fault("llama_decode")
    with pytest.raises(ValueError, match="times >= 1"):
        Fault("decode", times=0)
    # A request tokenizes more than once (the whole render, then the template's pieces to check that
    # only they hold control tokens): count one request's calls with a fault that only watches.
    calls: list[str] = []
    with inject(Fault("tokenize", times=10**6, action=lambda native, text: calls.append(text))):
        base.generate("x", max_tokens=2)
        per_request = len(calls)
        base.generate("x", max_tokens=2)
    assert per_request >= 1 and len(calls) == 2 * per_request
    with inject(Fault("tokenize", after=per_request, times=2)) as injection:
        with pytest.raises(RuntimeError, match="do not nest"):
            with inject():
                pass
        outcomes = []
        for _ in range(4):  # passes one request's calls, fires on two (each fails at its first call), then passes
            try:
                base.generate("x", max_tokens=2)
                outcomes.append("ok")
            except errors.EngineError:
                outcomes.append("failed")
        assert outcomes == ["ok", "failed", "failed", "ok"] and injection.fired() == 2
    assert armed() is None and _engine._faults is None  # the seam and the engine's mirror of it


def test_a_failing_free_at_scheduler_teardown_still_frees_the_context(base, solo):
    """Closing a batching lease whose batch refuses to be freed: the context and the weights' hold
    are released anyway, and the weights keep serving."""
    contexts = base._weights.native.live_contexts()
    serving = base.with_batching(2)
    assert serving.generate(PROMPT, max_tokens=N).tokens == solo[PROMPT]
    scheduler = serving._scheduler
    ctx, batch = scheduler._ctx, scheduler._batch
    with inject(Fault("free", when=lambda owner: owner is batch)) as injection:
        serving.close()
        assert injection.fired("free") == 1
    assert not scheduler.thread.is_alive() and not ctx.alive
    assert base._weights.native.live_contexts() == contexts
    assert not batch.alive  # the lease's own release (after the teardown) freed it on a second try
    assert base.generate(PROMPT, max_tokens=N).tokens == solo[PROMPT]
