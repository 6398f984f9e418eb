"""Leases on the tiny fixtures: admission rules, request rules, lifetime, timings.

Every rule of DESIGN.md "Loading and admission", "Leases and lifetime" and
"Requests and responses" has a test here that checks the typed error, that
its message names the offending value and what is allowed, and that the
lease stays usable where it should.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import shutil
import threading

import pytest

from aner_nb import llm
from aner_nb.llm import errors
from aner_nb.llm import _engine
from aner_nb.llm import loader as loader_module

CTX = 256


@pytest.fixture(scope="module")
def model(llama_path):
    with llm.load(llama_path, context=CTX) as m:
        yield m


def test_load_reports_metadata_and_fingerprint(model, llama_path):
    import hashlib

    assert model.architecture == "llama"
    assert model.context == CTX
    assert model.device == "cpu"  # this llama-cpp-python build has no accelerator here
    assert model.fingerprint == hashlib.sha256(llama_path.read_bytes()).hexdigest()
    assert model.chat_template == "embedded"
    summary = model.load_summary()
    assert summary.fingerprint == model.fingerprint
    assert summary.file_bytes == llama_path.stat().st_size
    assert min(summary.hash_duration, summary.load_duration, summary.verify_duration) > 0
    assert summary.total_duration >= summary.load_duration
    assert llm.native_available() is True


def test_repr_is_short_and_shows_no_path_or_prompt(model, llama_path):
    r = repr(model)
    assert "llama" in r and model.fingerprint[:12] in r
    assert str(llama_path) not in r and len(r) < 200


def test_generate_returns_measured_response(model):
    r = model.generate("the cat sat on", max_tokens=12)
    assert r.finish_reason in ("length", "stop")
    assert 1 <= len(r.tokens) <= 12
    assert r.usage.completion_tokens == len(r.tokens)
    assert r.usage.prompt_tokens == len(model.prompt_tokens("the cat sat on"))
    assert r.usage.cached_input_tokens == 0
    t = r.timings
    for f in dataclasses.fields(t):
        assert isinstance(getattr(t, f.name), int), f.name
    assert t.prompt_tokens == r.usage.prompt_tokens == t.evaluated_prompt_tokens
    assert t.prompt_eval_duration > 0 and t.first_token_duration >= t.prompt_eval_duration
    assert t.total_duration >= t.first_token_duration
    assert t.queue_duration == -1  # an ordinary lease has no queue: not measured, not 0
    assert t.speculative_proposed_tokens == -1 and t.batch_peak_sequences == -1
    assert t.threads >= 1 and t.batch_tokens == 512 and t.micro_batch_tokens == 128
    if len(r.tokens) == 12:
        assert t.generated_tokens == 12 and t.decode_calls == 11
    assert r.tokens_per_second() > 0
    import hashlib
    import struct

    assert r.output_hash == hashlib.sha256(struct.pack(f"<{len(r.tokens)}i", *r.tokens)).hexdigest()


def test_greedy_is_deterministic_and_text_matches_tokens(model):
    a = model.generate("hello there", max_tokens=16)
    b = model.generate("hello there", max_tokens=16)
    assert a.tokens == b.tokens and a.text == b.text
    assert a.timings.context_pool_reused in (0, 1)
    assert b.timings.context_pool_reused == 1 and b.timings.context_clear_duration >= 0
    # the text is the detokenized tokens (no stop strings given)
    native = model._weights.native
    assert a.text == native.detokenize(a.tokens)


def test_one_token_response_has_no_timed_decode(model):
    r = model.generate("x", max_tokens=1)
    assert len(r.tokens) == 1 and r.finish_reason == "length"
    assert r.timings.decode_calls == 0
    assert r.tokens_per_second() == -1.0


def test_max_tokens_zero_validates_and_touches_no_kv(llama_path):
    with llm.load(llama_path, context=CTX) as m:
        r = m.generate("nothing to do", max_tokens=0)
        assert r.text == "" and r.tokens == () and r.finish_reason == "length"
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == 0
        assert r.timings.prompt_eval_duration == -1 and r.timings.decode_duration == -1
        assert r.timings.evaluated_prompt_tokens == 0 and r.tokens_per_second() == -1.0
        assert m._state.pool.created == 0  # no context was even created
        m.generate("warm up", max_tokens=2)
        ctx = m._state.pool._idle[0].ctx
        calls = ctx.decode_count
        m.generate("nothing again", max_tokens=0)
        assert ctx.decode_count == calls
        with pytest.raises(errors.ContextOverflowError):
            m.generate("z" * 2000, max_tokens=0)  # still validated


def test_sampling_is_seeded(model):
    a = model.generate("once upon", max_tokens=16, temperature=1.5, seed=3)
    b = model.generate("once upon", max_tokens=16, temperature=1.5, seed=3)
    assert a.tokens == b.tokens
    others = {model.generate("once upon", max_tokens=16, temperature=1.5, seed=s).tokens for s in range(4, 8)}
    assert len(others | {a.tokens}) > 1


def test_stop_string_truncates_text(model):
    full = model.generate("the cat sat on", max_tokens=24)
    assert len(full.text) > 4
    stop = full.text[2:4]
    r = model.generate("the cat sat on", max_tokens=24, stop=[stop])
    assert r.finish_reason == "stop"
    assert r.text == full.text[: full.text.index(stop)]


def test_chat_and_generate_agree_for_one_user_message(model):
    a = model.generate("hi", max_tokens=8)
    b = model.chat([{"role": "user", "content": "hi"}], max_tokens=8)
    assert a.tokens == b.tokens


def test_stream_yields_the_same_text_and_exposes_response(model):
    full = model.generate("stream me", max_tokens=20)
    s = model.stream("stream me", max_tokens=20)
    pieces = list(s)
    assert "".join(pieces) == full.text == s.text
    assert s.response is not None and s.response.tokens == full.tokens
    assert s.done


def test_stream_cancel_ends_cleanly_and_lease_stays_usable(model):
    s = model.stream("cancel me", max_tokens=40)
    next(s)
    s.cancel()
    assert s.done and s.response.finish_reason == "cancelled"
    assert list(s) == []
    assert model.generate("after cancel", max_tokens=3).finish_reason in ("length", "stop")


def test_keyboard_interrupt_in_stream_cancels_and_reraises(model, monkeypatch):
    s = model.stream("interrupt me", max_tokens=40)
    next(s)
    native = model._weights.native
    real = native.token_bytes
    monkeypatch.setattr(native, "token_bytes", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        next(s)
    monkeypatch.setattr(native, "token_bytes", real)
    assert s.response.finish_reason == "cancelled"
    assert model.generate("still works", max_tokens=2).usage.completion_tokens >= 1


def test_abandoned_stream_releases_the_lease(model):
    s = model.stream("abandon", max_tokens=10)
    next(s)
    del s
    gc.collect()
    assert model.generate("next", max_tokens=2).usage.completion_tokens >= 1


def test_busy_second_call_from_another_thread(model):
    s = model.stream("hold the lease", max_tokens=10)
    caught: list[BaseException] = []

    def other() -> None:
        try:
            model.generate("second", max_tokens=2)
        except BaseException as exc:  # noqa: BLE001
            caught.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(caught) == 1 and isinstance(caught[0], errors.BusyError)
    assert "already running" in str(caught[0])
    assert "".join(s) == s.text
    assert model.generate("free again", max_tokens=2).usage.completion_tokens >= 1


# -- request rules --------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, needles",
    [
        ({"max_tokens": -1}, errors.InvalidRequestError, ["max_tokens", "0..65536", "-1"]),
        ({"max_tokens": 65537}, errors.InvalidRequestError, ["max_tokens", "0..65536", "65537"]),
        ({"max_tokens": 2.5}, errors.InvalidRequestError, ["max_tokens", "integer"]),
        ({"temperature": math.nan}, errors.InvalidRequestError, ["temperature", "[0, 2]", "nan"]),
        ({"temperature": -0.1}, errors.InvalidRequestError, ["temperature", "[0, 2]", "-0.1"]),
        ({"temperature": 2.1}, errors.InvalidRequestError, ["temperature", "[0, 2]", "2.1"]),
        ({"seed": -1}, errors.InvalidRequestError, ["seed", "4294967295", "-1"]),
        ({"seed": 2**32}, errors.InvalidRequestError, ["seed", "4294967295", "4294967296"]),
        ({"stop": [""]}, errors.InvalidRequestError, ["stop[0]"]),
        ({"max_tokens": CTX}, errors.ContextOverflowError, ["max_tokens=256", f"context of {CTX}"]),
    ],
)
def test_request_rules(model, kwargs, error, needles):
    with pytest.raises(error) as info:
        model.generate("rule check", **kwargs)
    for needle in needles:
        assert needle in str(info.value)
    assert model.generate("rule check", max_tokens=2).usage.completion_tokens >= 1  # still usable


def test_long_prompt_over_context_is_rejected_not_truncated(model):
    prompt = "word " * 400
    with pytest.raises(errors.ContextOverflowError, match="above the context of 256"):
        model.generate(prompt, max_tokens=1)


def test_bad_messages_name_the_field(model):
    with pytest.raises(errors.InvalidRequestError, match=r"messages\[1\]\.role"):
        model.chat([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(errors.InvalidRequestError, match="prompt must be a string"):
        model.generate(["not", "a", "string"])


# -- admission rules ---------------------------------------------------------------
@pytest.mark.parametrize(
    "key, error, needle",
    [
        ("not_gguf", errors.InvalidArtifactError, "GGUF"),
        ("truncated", errors.InvalidArtifactError, "truncated"),
        ("corrupted", errors.InvalidArtifactError, "corrupted.gguf"),
        ("split", errors.UnsupportedModelError, "split"),
        ("split_metadata", errors.UnsupportedModelError, "split"),
        ("projector", errors.UnsupportedModelError, "projector"),
        ("lora", errors.UnsupportedModelError, "adapter"),
        ("unsupported_arch", errors.UnsupportedModelError, "mamba"),
    ],
)
def test_admission_rejects_before_llama_cpp(fixture_models, key, error, needle, monkeypatch):
    def never(*a, **k):  # llama.cpp must not see the file
        raise AssertionError("native load reached")

    monkeypatch.setattr(_engine, "NativeModel", never)
    with pytest.raises(error) as info:
        llm.load(fixture_models[key])
    assert needle.lower() in str(info.value).lower()


def test_missing_template_needs_an_override(fixture_models):
    with pytest.raises(errors.ChatTemplateError, match="no embedded chat template") as info:
        llm.load(fixture_models["no_template"], context=CTX)
    assert "chatml" in str(info.value)
    with llm.load(fixture_models["no_template"], context=CTX, chat_template="chatml") as m:
        assert m.chat_template == "builtin:chatml"
        assert m.generate("ok", max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "kwargs, error, needles",
    [
        ({"context": 0}, errors.ConfigurationError, ["context", "1..65536", "0"]),
        ({"context": 65537}, errors.ConfigurationError, ["context", "1..65536", "65537"]),
        ({"context": 4096}, errors.ConfigurationError, ["context=4096", "declared context of 2048", "1..2048"]),
        ({"kv_cache_type": "q5_1"}, errors.ConfigurationError, ["kv_cache_type", "f16, q8_0, q4_0"]),
        ({"kv_cache_type": "q8_0", "flash_attention": "off"}, errors.ConfigurationError, ["flash attention"]),
        ({"flash_attention": "maybe"}, errors.ConfigurationError, ["flash_attention", "auto, on, off"]),
        ({"device": "tpu"}, errors.ConfigurationError, ["device", "cpu"]),
        ({"chat_template": "nonesuch"}, errors.ChatTemplateError, ["nonesuch", "chatml"]),
    ],
)
def test_load_settings_rules(llama_path, kwargs, error, needles):
    with pytest.raises(error) as info:
        llm.load(llama_path, **{"context": CTX, **kwargs})
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.skipif(_engine.native_available() and _engine.supports_gpu_offload(), reason="needs a CPU-only build")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "metal", "mps"])
def test_explicit_accelerator_on_cpu_build_never_falls_back(llama_path, device):
    with pytest.raises(errors.DeviceUnavailableError, match=device.split(":")[0]) as info:
        llm.load(llama_path, context=CTX, device=device)
    assert "cpu" in str(info.value)


def test_file_changed_while_loading_is_detected(llama_path, tmp_path, monkeypatch):
    copy = tmp_path / "changing.gguf"
    shutil.copy(llama_path, copy)
    real_load, real_hash = _engine.NativeModel, loader_module.sha256_file
    first_pass_done = threading.Event()
    made: list = []

    def hash_and_signal(path, **kwargs):
        digest = real_hash(path, **kwargs)
        first_pass_done.set()
        return digest

    def load_then_modify(path, **kwargs):
        native = real_load(path, **kwargs)
        made.append(native)
        assert first_pass_done.wait(10)  # the first pass saw the original bytes
        with open(path, "r+b") as f:  # someone rewrites a byte of tensor data mid-load
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 0xFF]))
        return native

    monkeypatch.setattr(_engine, "NativeModel", load_then_modify)
    monkeypatch.setattr(loader_module, "sha256_file", hash_and_signal)
    with pytest.raises(errors.ArtifactChangedError, match="changed while loading"):
        llm.load(copy, context=CTX)
    assert made and not made[0].alive  # the loaded weights were freed


# -- lifetime ------------------------------------------------------------------
def test_close_rejects_requests_and_keeps_metadata(llama_path):
    m = llm.load(llama_path, context=CTX)
    fingerprint, name = m.fingerprint, m.name
    m.close()
    assert m.closed and "closed" in repr(m)
    with pytest.raises(errors.ClosedError, match="closed"):
        m.generate("after close")
    with pytest.raises(errors.ClosedError):
        m.stream("after close")
    with pytest.raises(errors.ClosedError):
        m.session()
    assert (m.fingerprint, m.name, m.architecture, m.context, m.device, m.path) == (
        fingerprint, name, "llama", CTX, "cpu", str(llama_path)
    )
    assert not any(m.supports(f) for f in llm.FEATURES)
    m.close()  # idempotent


def test_supports(model):
    assert model.supports("generate") and model.supports("stream") and model.supports("session")
    assert not model.supports("continuous_batching") and not model.supports("speculative")
    with pytest.raises(errors.ConfigurationError, match="unknown feature"):
        model.supports("teleport")


def test_close_during_stream_lets_accepted_work_finish(llama_path):
    m = llm.load(llama_path, context=CTX)
    native = m._weights.native
    s = m.stream("finish me", max_tokens=8)
    next(s)
    m.close()
    with pytest.raises(errors.ClosedError):
        m.generate("rejected")
    assert native.alive  # the accepted stream still runs
    list(s)
    assert s.response.finish_reason in ("length", "stop")
    assert not native.alive and native.free_calls == 1


def test_weights_freed_when_lease_becomes_unreachable(llama_path):
    m = llm.load(llama_path, context=CTX)
    m.generate("use a context", max_tokens=2)
    native = m._weights.native
    assert native.live_contexts() == 1
    del m
    gc.collect()
    assert not native.alive and native.free_calls == 1


def test_weights_survive_while_a_session_uses_them(llama_path):
    m = llm.load(llama_path, context=CTX)
    native = m._weights.native
    session = m.session()
    m.close()
    assert native.alive
    assert session.send("still here", max_tokens=2).usage.completion_tokens >= 1
    session.close()
    assert not native.alive and native.free_calls == 1


def test_context_manager_closes(llama_path):
    with llm.load(llama_path, context=CTX) as m:
        native = m._weights.native
    assert m.closed and not native.alive


def test_load_close_cycles_do_not_leak(llama_path):
    import psutil

    proc = psutil.Process()
    for _ in range(5):  # warm up allocator and caches
        with llm.load(llama_path, context=CTX) as m:
            m.generate("x", max_tokens=2)
    gc.collect()
    before = proc.memory_info().rss
    natives = []
    for _ in range(50):
        with llm.load(llama_path, context=CTX) as m:
            m.generate("x", max_tokens=2)
            natives.append(m._weights.native)
    gc.collect()
    grown = proc.memory_info().rss - before
    assert all(n.free_calls == 1 and not n.alive for n in natives)
    assert grown < 20 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 50 load/close cycles"


# -- sessions --------------------------------------------------------------------
def test_session_appends_turns_without_reevaluating_history(model):
    with model.session(system="be brief") as s:
        first = s.send("hello", max_tokens=6)
        assert first.usage.cached_input_tokens == 0
        second = s.send("and again", max_tokens=6)
        t = second.timings
        # the whole first turn (system, user, answer) stays in the KV
        assert t.cached_input_tokens >= first.usage.prompt_tokens
        assert t.evaluated_prompt_tokens == t.prompt_tokens - t.cached_input_tokens
        assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "user", "assistant"]
        # same answer as a fresh chat over the same history
        fresh = model.chat(list(s.messages[:-1]), max_tokens=6)
        assert fresh.tokens == second.tokens


def test_session_rejects_builders(model):
    with model.session() as s:
        with pytest.raises(errors.UnsupportedFeatureError, match="builders"):
            s.with_optimizer(threads=1)


def test_memory_summary(model):
    ms = model.memory_summary()
    facts = model._weights.facts
    assert ms.kv_bytes == llm.kv_estimate(CTX, facts.layers, facts.kv_heads, facts.head_dim_k, facts.head_dim_v, "f16")
    assert ms.weights_bytes > 0 and ms.peak_rss_bytes >= ms.rss_bytes > 0
    assert "workspace" in ms.excludes and ms.kv_scope.startswith("per request")
    assert "<table>" in ms._repr_html_()


# -- the lease recipe declared once in Lease (issue 25) -----------------------------------------------
def each_kind(model):
    """One open lease of every class and kind: ordinary, latency, throughput, session."""
    return {
        "ordinary": model,
        "latency": model.with_optimizer(prefix_cache_entries=1),
        "throughput": model.with_batching(2),
        "session": model.session(system="Be brief."),
    }


def test_every_lease_kind_answers_memory_summary(model):
    leases = each_kind(model)
    try:
        for kind, lease in leases.items():
            assert isinstance(lease, llm.Lease) and lease.kind == kind
            summary = lease.memory_summary()
            assert isinstance(summary, llm.MemorySummary), kind
            assert summary.weights_bytes > 0 and summary.kv_bytes > 0 and summary.resident and summary.bounds, kind
        assert leases["session"].memory_summary().kv_scope.startswith("per session")
        assert leases["throughput"].memory_summary().kv_scope.startswith("whole scheduler")
    finally:
        for kind in ("latency", "throughput", "session"):
            leases[kind].close()


def test_builders_a_kind_lacks_are_refused_by_one_path(model):
    assert llm.LLMModel.builders == frozenset(llm.BUILDERS)
    assert llm.BatchingModel.builders == llm.Session.builders == frozenset()
    args = {"with_optimizer": (), "with_context_pool": (1,), "with_adapter": ("x.json",), "with_batching": (2,),
            "session": ()}
    assert set(args) == set(llm.BUILDERS)
    with model.with_batching(2) as serving, model.session() as session:
        for lease, noun in ((serving, "batching lease"), (session, "session")):
            for builder in llm.BUILDERS:
                with pytest.raises(errors.UnsupportedFeatureError, match=f"{builder}\\(\\) is not available on a {noun}") as e:
                    getattr(lease, builder)(*args[builder])
                assert e.value.param == builder


def test_a_lease_class_must_declare_exactly_the_builders_it_implements():
    with pytest.raises(TypeError, match="must name exactly the builders it implements"):
        class Declares(llm.Session):  # declares a builder it does not implement
            builders = frozenset({"with_optimizer"})
    with pytest.raises(TypeError, match="must name exactly the builders it implements"):
        class Implements(llm.Session):  # implements a builder it does not declare
            def session(self, *args, **kwargs):
                return None


def test_stats_is_the_schedulers_snapshot_or_a_typed_refusal(model):
    with model.with_batching(2) as serving:
        assert isinstance(serving.stats(), llm.SchedulerStats) and serving.stats().max_sequences == 2
    with model.session() as session:
        for lease in (model, session):
            assert not lease.supports("continuous_batching")
            with pytest.raises(errors.UnsupportedFeatureError, match="continuous-batching scheduler") as e:
                lease.stats()
            assert e.value.param == "continuous_batching"
