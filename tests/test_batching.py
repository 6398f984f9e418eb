"""The throughput profile on the fixtures: continuous batching on one shared context.

Every batched request must produce exactly the tokens of the same request
run alone on an ordinary lease; the scheduler must reuse sequence slots,
let late short requests finish first, bound its queue, refuse recursive
submission, cancel one sequence without disturbing the others, survive
engine errors and leave no thread or context behind.
"""

from __future__ import annotations

import dataclasses
import gc
import signal
import sys
import threading
import time

import pytest

from aner_nb import llm
from aner_nb.llm import _engine, errors
from aner_nb.llm.outbox import Request
from aner_nb.llm.scheduler import Scheduler

CTX = 2048  # 8 sequences x 256 cells
PROMPTS = [
    "the cat sat on the mat and",
    "hello",
    "Summarize: apples, pears and plums are fruit. " * 2,
    "x",
    "once upon a time there was",
    "a b c d e f g",
    "tell me about the sea and the sky " * 2,
    "why",
]
MAX_TOKENS = [20, 40, 8, 30, 25, 5, 35, 12]


@pytest.fixture(scope="module")
def model(llama_path):
    with llm.load(llama_path, context=CTX) as m:
        yield m


@pytest.fixture(scope="module")
def solo(model):
    """Each request of PROMPTS run alone on the ordinary lease (the reference)."""
    return [model.generate(p, max_tokens=n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def concurrently(fn, n):
    """Run ``fn(i)`` for i in range(n) on n threads released together; results or exceptions."""
    out: list = [None] * n
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait()
        try:
            out[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def read_response(stream):
    """Read a stream to its end; its final Response."""
    for _ in stream:
        pass
    return stream.response


def request_of(stream):
    """The scheduler request behind a batched stream (its end callback is ``Request.settle``)."""
    return stream._driver._done.__self__


# -- equality with the request run alone ------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_batched_tokens_equal_the_request_run_alone(fixture_models, arch, n):
    """n concurrent mixed-length requests (a stop string and a sampled one among them) on n sequences."""
    with llm.load(fixture_models[arch], context=CTX) as base:
        prompts, max_tokens = PROMPTS[:n], MAX_TOKENS[:n]
        kwargs = [dict(max_tokens=m) for m in max_tokens]
        first = base.generate(prompts[0], max_tokens=max_tokens[0])
        kwargs[0]["stop"] = [first.text[3:5]]  # ends early with finish_reason "stop"
        if n >= 4:
            kwargs[3].update(temperature=0.9, seed=11)  # sampled: same seed, same logits, same tokens
        alone = [base.generate(p, **kw) for p, kw in zip(prompts, kwargs)]
        assert alone[0].finish_reason == "stop"
        with base.with_batching(n) as serving:
            # Every request is submitted before any is read, the last first: a stream whose unread
            # pieces fill its buffer (16) pauses without finishing, so the long requests are still
            # active when the short ones arrive, however the threads are scheduled.
            streams = {i: serving.stream(prompts[i], **kwargs[i]) for i in reversed(range(n))}
            batched = concurrently(lambda i: read_response(streams[i]), n)
            stats = serving.stats()
        for a, b in zip(alone, batched):
            assert isinstance(b, llm.Response), b
            assert b.tokens == a.tokens and b.text == a.text and b.finish_reason == a.finish_reason
            t = b.timings
            assert t.batch_max_sequences == n and 1 <= t.batch_peak_sequences <= n
            assert t.scheduler_steps >= 1 and t.batch_decoded_tokens >= t.prompt_tokens + t.decode_calls
            assert t.queue_duration >= 0 and t.prompt_eval_duration > 0 and t.first_token_duration > 0
        assert stats.completed == n and stats.failed == 0 and stats.peak_sequences <= n
        if n > 1:
            assert stats.steps < sum(len(r.tokens) for r in alone) + n  # rows were shared between sequences
            assert max(r.timings.batch_peak_sequences for r in batched) > 1


def test_generate_many_returns_responses_in_order_beyond_the_queue(model, solo):
    with model.with_batching(2) as serving:
        prompts = PROMPTS + PROMPTS[:4]  # 12 requests: more than 2 running + 8 waiting
        responses = serving.generate_many(prompts, max_tokens=12)
    expected = [model.generate(p, max_tokens=12) for p in prompts]
    assert [r.tokens for r in responses] == [e.tokens for e in expected]
    with pytest.raises(errors.InvalidRequestError, match="list of prompts"):
        serving.generate_many("one string")


def test_chat_and_stream_equal_the_ordinary_lease(model, solo):
    with model.with_batching(2) as serving:
        chat = serving.chat([{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX_TOKENS[0])
        s = serving.stream(PROMPTS[1], max_tokens=MAX_TOKENS[1])
        pieces = list(s)
    assert chat.tokens == solo[0].tokens
    assert "".join(pieces) == s.text == solo[1].text and s.response.tokens == solo[1].tokens and s.done


# -- scheduling behaviour, seen through the timings -------------------------------------------------
def test_slot_reuse_and_a_late_short_request_finishing_first(model):
    with model.with_batching(2) as serving:
        started = threading.Event()
        long_result: list = []

        def slow_reader(piece):  # runs on the scheduler thread: paces every step
            started.set()
            time.sleep(0.002)

        worker = threading.Thread(
            target=lambda: long_result.append(serving.generate("tell me a long story", max_tokens=300, on_text=slow_reader))
        )
        worker.start()
        assert started.wait(30)
        shorts = [serving.generate(p, max_tokens=3) for p in ("a", "b", "c")]  # one after another, same slot
        assert worker.is_alive()  # submitted later, finished first
        worker.join(60)
        stats = serving.stats()
    (long,) = long_result
    assert long.usage.completion_tokens == 300
    for s in shorts:
        assert s.usage.completion_tokens == 3
        assert s.timings.batch_peak_sequences == 2  # decoded beside the long request
        assert s.timings.scheduler_steps < long.timings.scheduler_steps
        assert s.timings.total_duration < long.timings.total_duration
    assert stats.admitted == 4 and stats.peak_sequences == 2  # 4 requests through 2 sequence slots


def test_queued_requests_wait_for_a_free_slot_and_record_their_queue_time(model, solo):
    with model.with_batching(2) as serving:
        responses = concurrently(lambda i: serving.generate(PROMPTS[i], max_tokens=MAX_TOKENS[i]), 6)
        stats = serving.stats()
    assert [r.tokens for r in responses] == [s.tokens for s in solo[:6]]
    assert stats.admitted == 6 and stats.peak_sequences == 2
    waits = sorted(r.timings.queue_duration for r in responses)
    assert waits[-1] > waits[0] and waits[-1] > 1000  # later admissions waited for a slot to free up
    assert all(r.timings.batch_peak_sequences <= 2 for r in responses)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("batch_tokens", [512, 12])
def test_odd_logits_counts_are_padded_without_changing_outputs(fixture_models, arch, batch_tokens, monkeypatch):
    """With column pairing forced on, steps sampling 3 or 5 rows request one more logits row:
    a prompt row that is not sampled (chunked prefill, batch_tokens=12) or a token in an empty
    sequence id that is removed after the step. Nobody's tokens change; no cell is left behind."""
    from aner_nb.llm import batching

    monkeypatch.setattr(batching, "pairs_batch_columns", lambda weight_type: True)
    marked = []  # prompt rows given logits only for the padding
    mark = _engine.Batch.mark_output
    monkeypatch.setattr(_engine.Batch, "mark_output", lambda self, i: (marked.append(i), mark(self, i))[1])
    n = 5
    prompts, max_tokens = PROMPTS[:n], [30, 6, 14, 22, 9]  # finishing one by one: 5, 4, 3, 2, 1 sampled rows
    with llm.load(fixture_models[arch], context=CTX) as base:
        alone = [base.generate(p, max_tokens=m) for p, m in zip(prompts, max_tokens)]
        source = base.with_optimizer(batch_tokens=batch_tokens, micro_batch_tokens=batch_tokens)
        with source.with_batching(6) as serving:
            assert serving._scheduler.pair_columns
            # Holding the scheduler's lock (re-entrant: submission takes it too) while submitting admits
            # all five in one cycle, so the steps, and the padding they need, are the same on every run.
            with serving._scheduler._cv:
                streams = [serving.stream(p, max_tokens=m) for p, m in zip(prompts, max_tokens)]
            batched = concurrently(lambda i: read_response(streams[i]), n)
            stats = serving.stats()
            ctx = serving._scheduler._ctx
            assert [ctx.seq_pos_max(seq) for seq in range(6)] == [-1] * 6  # every sequence cleared
        source.close()
    for a, b in zip(alone, batched):
        assert isinstance(b, llm.Response), b
        assert b.tokens == a.tokens and b.text == a.text
    assert stats.completed == n
    assert len(marked) >= 1 and stats.padding_rows > len(marked)  # both kinds of padding row were used
    assert stats.evaluated_tokens >= sum(len(r.tokens) + r.timings.prompt_tokens for r in alone) - n


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_gap_between_sequence_ids_is_closed_without_changing_outputs(fixture_models, arch):
    """Sequences 0 and 2 keep running after 1 finishes: 2 moves to 1 (a KV stream copy)."""
    with llm.load(fixture_models[arch], context=CTX) as base:
        jobs = [(PROMPTS[6], 60), (PROMPTS[1], 3), (PROMPTS[4], 50)]
        alone = [base.generate(p, max_tokens=n) for p, n in jobs]
        with base.with_batching(3) as serving:
            with serving._scheduler._cv:  # all three admitted in one cycle, on ids 0, 1, 2, whatever the timing
                streams = [serving.stream(p, max_tokens=n) for p, n in jobs]
            texts = concurrently(lambda i: "".join(streams[i]), 3)
            stats = serving.stats()
        assert texts == [a.text for a in alone]
        assert [s.response.tokens for s in streams] == [a.tokens for a in alone]
        assert stats.compactions >= 1


def test_a_slow_consumer_pauses_only_its_own_sequence(model, solo):
    with model.with_batching(2) as serving:
        slow = serving.stream(PROMPTS[1], max_tokens=40)  # not read yet: its buffer fills, then it pauses
        req = request_of(slow)
        other = serving.generate(PROMPTS[0], max_tokens=MAX_TOKENS[0])
        assert other.tokens == solo[0].tokens
        wait_for(lambda: not req.outbox.has_room())
        assert not req.finished.is_set()
        steps = serving.stats().steps
        time.sleep(0.1)
        assert serving.stats().steps == steps  # nothing to do while the only active sequence waits
        assert "".join(slow) == solo[1].text and slow.response.tokens == solo[1].tokens


# -- bounded queue, recursion, cancellation ------------------------------------------------------------
def test_a_full_queue_raises_busy_at_once_and_accepted_work_completes(model, solo, monkeypatch):
    with model.with_batching(1) as serving:
        holder = serving.stream(PROMPTS[1], max_tokens=40)  # occupies the only sequence (paused, unread)
        wait_for(lambda: serving.stats().active == 1)
        queued = [serving.stream(PROMPTS[i % 8], max_tokens=MAX_TOKENS[i % 8]) for i in range(8)]
        assert serving.stats().waiting == 8
        # "at once": the caller never waits on the scheduler's condition for queue room
        cv, caller_waits = serving._scheduler._cv, []
        real_wait = cv.wait

        def wait(timeout=None):
            if threading.current_thread() is threading.main_thread():
                caller_waits.append(timeout)
            return real_wait(timeout)

        monkeypatch.setattr(cv, "wait", wait)
        with pytest.raises(errors.BusyError) as info:
            serving.generate("one too many", max_tokens=2)
        monkeypatch.undo()
        assert caller_waits == [] and serving.stats().waiting == 8
        assert "queue is full (8 waiting" in str(info.value)
        assert holder.response is None and "".join(holder) == solo[1].text
        for i, s in enumerate(queued):
            assert "".join(s) == solo[i % 8].text and s.response.tokens == solo[i % 8].tokens
        assert serving.generate("room again", max_tokens=2).usage.completion_tokens == 2


def test_recursive_submission_from_a_callback_fails_fast(model, solo):
    with model.with_batching(2) as serving:
        def submit_again(piece):
            serving.generate("inner", max_tokens=2)

        with pytest.raises(errors.BusyError, match="own scheduler thread"):
            serving.generate("outer", max_tokens=5, on_text=submit_again)
        # fast: the inner request was refused at submission, never queued, so nothing waited for it
        stats = serving.stats()
        assert stats.admitted == 1 and stats.failed == 1 and stats.waiting == 0 and stats.active == 0

        reader = serving.stream(PROMPTS[0], max_tokens=5)
        with pytest.raises(errors.BusyError, match="reading a stream"):
            serving.generate("outer", max_tokens=5, on_text=lambda piece: next(reader))
        reader.cancel()
        with pytest.raises(errors.InvalidRequestError, match="on_text must be a callable"):
            serving.generate("x", max_tokens=2, on_text="not callable")
        assert serving.generate(PROMPTS[0], max_tokens=MAX_TOKENS[0]).tokens == solo[0].tokens
        assert serving.stats().failed == 2


def test_cancelling_one_stream_leaves_the_others_intact(model, solo):
    with model.with_batching(3) as serving:
        streams = [serving.stream(PROMPTS[i], max_tokens=MAX_TOKENS[i]) for i in (1, 3, 6)]
        for s in streams:
            next(s)
        streams[1].cancel()
        assert streams[1].done and streams[1].response.finish_reason == "cancelled"
        assert list(streams[1]) == []
        cancelled = streams[1].response
        assert cancelled.tokens == solo[3].tokens[: len(cancelled.tokens)]
        for s, i in ((streams[0], 1), (streams[2], 6)):
            assert s.text + "".join(s) == solo[i].text and s.response.tokens == solo[i].tokens
        assert serving.stats().cancelled == 1


def test_keyboard_interrupt_in_a_stream_cancels_only_that_sequence(model, solo):
    with model.with_batching(2) as serving:
        victim = serving.stream(PROMPTS[1], max_tokens=MAX_TOKENS[1])
        other = serving.stream(PROMPTS[6], max_tokens=MAX_TOKENS[6])
        next(victim)
        req = request_of(victim)
        req.outbox.get = lambda: (_ for _ in ()).throw(KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            next(victim)
        assert victim.done and victim.response.finish_reason == "cancelled"
        assert "".join(other) == solo[6].text and other.response.tokens == solo[6].tokens


def test_keyboard_interrupt_in_generate_cancels_only_that_request(model, solo):
    """A real Ctrl-C (SIGINT to the main thread) while ``generate`` waits ends only that request.

    Deterministic: the text callback (scheduler thread) sends the signal only once the main thread is
    blocked in the request's wait, then holds the scheduler until the request is cancelled, so the
    request cannot finish before the interrupt is handled. (The first version signalled on the first
    piece, about 2 ms after submission, whatever the main thread was doing then: on a slow machine it
    could still be running Python code, where CPython drops an interrupt handled inside a finalizer
    that a garbage collection runs, and the request then ran to its end.) Garbage collection is off
    while the interrupted call waits, for the same reason.
    """
    main = threading.main_thread().ident
    waiting_in, blocked_in = Request.wait.__code__, threading.Condition.wait.__code__
    results: list = []
    seen: dict = {}
    interrupted = threading.Event()

    def main_thread_request():
        """The Request whose wait() the main thread is blocked in (on the condition), or None."""
        frame = sys._current_frames().get(main)
        if frame is None or frame.f_code is not blocked_in:
            return None
        while frame is not None:
            if frame.f_code is waiting_in:
                return frame.f_locals["self"]
            frame = frame.f_back
        return None

    def interrupt_once(piece):
        if interrupted.is_set():
            return
        interrupted.set()
        deadline = time.monotonic() + 60  # a hang guard only
        while (req := main_thread_request()) is None:
            if time.monotonic() > deadline:
                seen["error"] = "the main thread never waited for its request"
                return
            time.sleep(0.001)
        seen["request"] = req
        signal.pthread_kill(main, signal.SIGINT)  # a real Ctrl-C
        seen["cancelled"] = req.job.cancel.wait(60)  # this request cannot finish before it is cancelled

    with model.with_batching(2) as serving:
        other = threading.Thread(target=lambda: results.append(serving.generate(PROMPTS[6], max_tokens=35)))
        other.start()
        gc.disable()
        try:
            with pytest.raises(KeyboardInterrupt):
                serving.generate("interrupt me", max_tokens=900, on_text=interrupt_once)
        finally:
            gc.enable()
        assert "error" not in seen, seen
        assert seen["cancelled"] is True
        response = seen["request"].result()
        assert response.finish_reason == "cancelled" and len(response.tokens) < 900
        other.join(60)
        assert results[0].tokens == solo[6].tokens
        assert serving.stats().cancelled == 1
        assert serving.generate(PROMPTS[0], max_tokens=MAX_TOKENS[0]).tokens == solo[0].tokens


# -- engine errors ---------------------------------------------------------------------------------
def inject(serving, monkeypatch, result):
    """Make the next llama_decode with two sequences admitted fail with ``result`` (rc or exception)."""
    ctx = serving._scheduler._ctx
    real = ctx.decode
    fired = threading.Event()

    def decode(batch):
        if not fired.is_set() and serving.stats().active == 2:
            fired.set()
            if isinstance(result, BaseException):
                raise result
            return result
        return real(batch)

    monkeypatch.setattr(ctx, "decode", decode)
    return fired


def drain(stream):
    try:
        return "".join(stream)
    except errors.EngineError as exc:
        return exc


def test_no_kv_slot_fails_one_request_and_the_scheduler_keeps_serving(model, solo, monkeypatch):
    with model.with_batching(2) as serving:
        fired = inject(serving, monkeypatch, _engine.DECODE_NO_KV_SLOT)
        streams = [serving.stream(PROMPTS[i], max_tokens=MAX_TOKENS[i]) for i in (1, 6)]
        out = [drain(s) for s in streams]
        assert fired.is_set()
        failed = [o for o in out if isinstance(o, errors.EngineError)]
        assert len(failed) == 1  # only the newest request gave way
        assert "no KV slot" in str(failed[0]) and "the others continue" in str(failed[0])
        for o, s, i in zip(out, streams, (1, 6)):
            if not isinstance(o, errors.EngineError):
                assert o == solo[i].text and s.response.tokens == solo[i].tokens
        assert serving.generate(PROMPTS[2], max_tokens=MAX_TOKENS[2]).tokens == solo[2].tokens
        assert serving.stats().failed == 1


def test_a_decode_error_fails_that_batch_and_the_scheduler_recovers(model, solo, monkeypatch):
    with model.with_batching(2) as serving:
        fired = inject(serving, monkeypatch, errors.EngineError("llama_decode failed with code -3"))
        streams = [serving.stream(PROMPTS[i], max_tokens=MAX_TOKENS[i]) for i in (1, 6)]
        out = [drain(s) for s in streams]
        assert fired.is_set()
        failed = [o for o in out if isinstance(o, errors.EngineError)]
        assert failed and all("batch failed" in str(o) and "code -3" in str(o) for o in failed)
        for o, s, i in zip(out, streams, (1, 6)):  # a sequence paused by its reader was not in that batch
            if not isinstance(o, errors.EngineError):
                assert o == solo[i].text
        again = concurrently(lambda i: serving.generate(PROMPTS[i], max_tokens=MAX_TOKENS[i]), 2)
        assert [r.tokens for r in again] == [s.tokens for s in solo[:2]]


# -- lifetime ---------------------------------------------------------------------------------------
def scheduler_threads():
    return [t for t in threading.enumerate() if t.name.startswith("aner-scheduler")]


def test_close_drains_accepted_work_then_frees_the_context_and_thread(llama_path, solo):
    baseline = set(threading.enumerate())
    with llm.load(llama_path, context=CTX) as base:
        native = base._weights.native
        contexts = native.live_contexts()
        serving = base.with_batching(4)
        ctx = serving._scheduler._ctx
        assert set(threading.enumerate()) - baseline == {serving._scheduler.thread}
        assert native.live_contexts() == contexts + 1
        unread = serving.stream(PROMPTS[1], max_tokens=MAX_TOKENS[1])  # never read before close
        running = threading.Thread(target=lambda: got.append(serving.generate(PROMPTS[6], max_tokens=MAX_TOKENS[6])))
        got: list = []
        running.start()
        wait_for(lambda: serving.stats().admitted == 2)
        serving.close()
        running.join(30)
        assert got[0].tokens == solo[6].tokens  # accepted work finished
        assert "".join(unread) == solo[1].text  # drained even though nobody was reading
        assert not ctx.alive and native.live_contexts() == contexts
        assert not set(threading.enumerate()) - baseline and not scheduler_threads()
        assert serving.closed and not serving.supports("generate") and not serving.supports("continuous_batching")
        assert serving.name == base.name and serving.fingerprint == base.fingerprint  # metadata stays readable
        with pytest.raises(errors.ClosedError):
            serving.generate("after close", max_tokens=2)
        with pytest.raises(errors.ClosedError):
            serving.stream("after close", max_tokens=2)
        serving.close()  # idempotent
    assert native.free_calls == 1


def test_closing_the_source_lease_keeps_accepted_work_and_the_weights(llama_path, solo):
    base = llm.load(llama_path, context=CTX)
    native = base._weights.native
    serving = base.with_batching(2)
    s = serving.stream(PROMPTS[1], max_tokens=MAX_TOKENS[1])
    base.close()
    assert native.alive
    assert "".join(s) == solo[1].text
    assert serving.generate(PROMPTS[0], max_tokens=MAX_TOKENS[0]).tokens == solo[0].tokens  # still serving
    serving.close()
    assert not native.alive and native.free_calls == 1


def test_an_unreachable_batching_lease_is_released_by_its_finalizer(llama_path):
    baseline = set(threading.enumerate())
    base = llm.load(llama_path, context=CTX)
    native = base._weights.native
    serving = base.with_batching(2)
    thread = serving._scheduler.thread
    ctx = serving._scheduler._ctx
    serving.generate("warm", max_tokens=2)
    del serving
    gc.collect()
    thread.join(10)
    assert not thread.is_alive() and not ctx.alive and not set(threading.enumerate()) - baseline
    assert native.alive  # the source lease still holds the weights
    base.close()
    assert not native.alive


# -- configuration and the lease API -----------------------------------------------------------------
@pytest.mark.parametrize(
    "value, needle",
    [(0, "max_sequences must be in 1..64, got 0"), (65, "1..64"), ("2", "must be an integer"), (True, "integer")],
)
def test_max_sequences_is_validated(model, value, needle):
    with pytest.raises(errors.ConfigurationError) as info:
        model.with_batching(value)
    assert needle in str(info.value)


def test_unsupported_combinations_fail_at_configuration(model, llama_path):
    weights = model._weights
    small = llm.LLMModel(weights, llm.Profile(optimizer=llm.OptimizerSettings(batch_tokens=4, micro_batch_tokens=4)))
    latency = llm.LLMModel(weights, llm.Profile(optimizer=llm.OptimizerSettings(prefix_cache_entries=1)))
    try:
        with pytest.raises(errors.ConfigurationError, match=r"batch_tokens \(4\) must be >= max_sequences \(8\)"):
            small.with_batching(8)
        with pytest.raises(errors.ConfigurationError, match="latency profile"):
            latency.with_batching(2)
    finally:
        small.close()
        latency.close()
    with llm.load(llama_path, context=16) as tiny:
        with pytest.raises(errors.ConfigurationError, match=r"max_sequences \(32\) must be <= the context \(16\)"):
            tiny.with_batching(32)
    closed = llm.load(llama_path, context=64)
    closed.close()
    with pytest.raises(errors.ClosedError, match="with_batching"):
        closed.with_batching(2)


def test_lease_api_metadata_and_builders(model):
    with llm.with_batching(model, 4) as serving:
        assert isinstance(serving, llm.BatchingModel)
        assert serving.fingerprint == model.fingerprint and serving.architecture == "llama"
        assert serving.context == CTX and serving.sequence_context == CTX // 4 and serving.max_sequences == 4
        assert serving.device == model.device and serving.path == model.path
        assert serving.profile == model.profile.with_(batching=llm.BatchingSettings(max_sequences=4))
        assert serving.profile.kind == "throughput"
        assert model.profile.kind == "ordinary" and model.profile.max_sequences == 0
        assert serving.facts is model.facts and serving.chat_template == model.chat_template
        assert serving.batching == llm.BatchingSettings(max_sequences=4)
        r = repr(serving)
        assert "throughput" in r and "max_sequences=4" in r and model.path not in r
        assert serving.load_summary() == model.load_summary()
        for feature in ("generate", "chat", "stream", "continuous_batching"):
            assert serving.supports(feature)
        for feature in ("session", "prefix_cache", "speculative", "adapter"):
            assert not serving.supports(feature)
        assert model.supports("continuous_batching") is False
        with pytest.raises(errors.ConfigurationError, match="unknown feature"):
            serving.supports("teleport")
        for builder, args in (
            (serving.session, ()), (serving.with_optimizer, ()), (serving.with_context_pool, (1,)),
            (serving.with_adapter, ("x.json",)), (serving.with_batching, (2,)),
        ):
            with pytest.raises(errors.UnsupportedFeatureError, match="not available on a batching lease"):
                builder(*args)
        assert serving.prompt_tokens("hi") == model.prompt_tokens("hi")


def test_memory_summary_covers_the_whole_shared_context(model):
    with model.with_batching(4) as serving:
        summary = serving.memory_summary()
        facts = model._weights.facts
        assert summary.kv_bytes == llm.kv_estimate(
            CTX, facts.layers, facts.kv_heads, facts.head_dim_k, facts.head_dim_v, "f16"
        )
        assert "whole scheduler" in summary.kv_scope and "4 sequences x 512 cells" in summary.kv_scope
        assert summary.live_contexts >= 1


def test_requests_are_validated_before_queueing(model):
    with model.with_batching(4) as serving:
        limit = serving.sequence_context
        with pytest.raises(errors.ContextOverflowError) as info:
            serving.generate("hello", max_tokens=limit)
        assert f"{serving.max_sequences} sequences, {limit} each" in str(info.value)
        assert model.generate("hello", max_tokens=limit, stop=None).usage.completion_tokens > 0  # fits the source
        with pytest.raises(errors.InvalidRequestError, match="temperature"):
            serving.generate("x", temperature=3.0)
        with pytest.raises(errors.InvalidRequestError, match="prompt must be a string"):
            serving.generate([{"role": "user", "content": "x"}])
        decodes = serving._scheduler._ctx.decode_count
        r = serving.generate("only validate", max_tokens=0)
        s = serving.stream("only validate", max_tokens=0)
        assert list(s) == [] and s.response.finish_reason == "length"
        assert r.tokens == () and r.timings.queue_duration == -1 and r.timings.evaluated_prompt_tokens == 0
        assert serving._scheduler._ctx.decode_count == decodes and serving.stats().admitted == 0


def test_batched_timings_are_measured(model, solo):
    with model.with_batching(2) as serving:
        r = serving.generate(PROMPTS[0], max_tokens=MAX_TOKENS[0])
    t = r.timings
    assert t.queue_duration >= 0 and t.prompt_tokens == t.evaluated_prompt_tokens == r.usage.prompt_tokens
    assert t.generated_tokens == MAX_TOKENS[0] and t.decode_calls == MAX_TOKENS[0] - 1
    assert t.scheduler_steps == 1 + t.decode_calls  # one prefill step, then one row per step
    assert t.batch_decoded_tokens == t.prompt_tokens + t.decode_calls  # alone: only its own rows
    assert t.batch_peak_sequences == 1 and t.batch_max_sequences == 2
    assert t.total_duration >= t.first_token_duration >= t.prompt_eval_duration > 0
    assert t.context_clear_duration == -1 and t.cached_input_tokens == 0 and t.context_pool_reused == -1
    assert t.speculative_proposed_tokens == -1 and t.threads >= 1 and t.batch_tokens == 512
    assert r.tokens_per_second() > 0


def test_scheduler_is_importable_without_a_model():
    assert Scheduler.__doc__ and llm.SchedulerStats.__doc__


def test_the_schedulers_own_counters_are_declared_once_as_attributes():
    from aner_nb.llm.scheduler_stats import COUNTED, SchedulerCounters

    stats = {f.name: f.type for f in dataclasses.fields(llm.SchedulerStats)}
    counters = SchedulerCounters()
    assert COUNTED == tuple(f.name for f in dataclasses.fields(counters)) and set(COUNTED) <= set(stats)
    counters.steps += 2
    snapshot = llm.SchedulerStats(**{n: 0 for n in stats if n not in COUNTED}, **dataclasses.asdict(counters))
    assert snapshot.steps == 2 and snapshot.completed == 0
