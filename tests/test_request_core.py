"""The request core: one lease protocol, typed timings parts, typed error details, one lifetime.

Every lease kind (ordinary, latency, adapter, throughput, session) goes
through the same preparation and the same generate/chat/stream code; these
tests pin what that shared core promises.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest

from aner_nb import llm
from aner_nb.llm import errors, requests, timings
from aner_nb.llm.lifetime import Lifetime

CTX = 256
PART_CLASSES = (
    timings.ProfileTimings, timings.PoolTimings, timings.PrefixCacheTimings, timings.QueueTimings,
    timings.RunTimings, timings.SpeculativeTimings, timings.BatchTimings, timings.PrefixTierTimings,
)


@pytest.fixture(scope="module")
def model(llama_path):
    with llm.load(llama_path, context=CTX) as m:
        yield m


# -- timings parts ---------------------------------------------------------------------------


def test_every_timings_field_has_exactly_one_producing_part_and_display_metadata():
    owners: dict[str, list[str]] = {}
    for cls in PART_CLASSES:
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, []).append(cls.__name__)
    names = [f.name for f in dataclasses.fields(llm.Timings)]
    assert sorted(owners) == sorted(names)
    assert {n: o for n, o in owners.items() if len(o) > 1} == {}
    for f in dataclasses.fields(llm.Timings):
        assert f.metadata["unit"] in timings.UNITS and f.metadata["label"] and f.metadata["part"]
    assert [f.name for f in llm.timing_fields(unit="ns")] == [
        "queue_duration", "context_clear_duration", "prompt_eval_duration", "first_token_duration",
        "decode_duration", "total_duration", "prefix_restore_duration",
    ]
    assert set(PART_CLASSES) == set(timings.TimingsPart.__subclasses__())  # a new part is listed here too


def test_assemble_refuses_a_field_set_by_two_parts_and_leaves_the_rest_unmeasured():
    queue = timings.QueueTimings(queue_duration=5)
    t = llm.Timings.assemble(queue, timings.PoolTimings(cached_input_tokens=3))
    assert (t.queue_duration, t.cached_input_tokens, t.total_duration) == (5, 3, -1)
    with pytest.raises(ValueError, match="queue_duration is set by both QueueTimings and QueueTimings"):
        llm.Timings.assemble(queue, timings.QueueTimings(queue_duration=7))
    with pytest.raises(TypeError, match="timings parts"):
        llm.Timings.assemble({"queue_duration": 1})  # type: ignore[arg-type]


def test_prefix_cache_capacity_and_entries_found_are_two_fields(llama_path):
    with llm.load(llama_path, context=CTX) as base, base.with_optimizer(prefix_cache_entries=2) as fast:
        cold = fast.generate("the cat sat on", max_tokens=3)
        warm = fast.generate("the cat sat on", max_tokens=3)
        plain = base.generate("the cat sat on", max_tokens=3)
    assert cold.timings.prefix_cache_capacity == warm.timings.prefix_cache_capacity == 2
    assert (cold.timings.prefix_cache_entries, warm.timings.prefix_cache_entries) == (0, 1)
    assert plain.timings.prefix_cache_capacity == 0 and plain.timings.prefix_cache_entries == -1


# -- typed error details -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"seed": -2}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", ""]}, "stop[1]"),
        ({"top_q": 0.5}, "top_q"),
        ({"max_tokens": CTX}, "max_tokens"),
    ],
)
def test_request_errors_name_the_offending_option(model, options, param):
    with pytest.raises(errors.InvalidRequestError) as info:
        model.generate("hello", **options)
    assert info.value.param == param and param.split("[")[0] in str(info.value)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ("hello", "messages"),
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x"}, {"role": "user"}], "messages[1].content"),
    ],
)
def test_message_errors_name_the_offending_message(model, messages, param):
    with pytest.raises(errors.InvalidRequestError) as info:
        model.chat(messages)
    assert info.value.param == param


def test_configuration_errors_name_the_setting(model):
    with pytest.raises(errors.ConfigurationError) as info:
        model.with_optimizer(speculative_tokens=99)
    assert info.value.param == "speculative_tokens"


def test_an_unknown_option_is_refused_by_name_with_the_allowed_list():
    with pytest.raises(errors.InvalidRequestError, match="'top_q'.*max_tokens, temperature, seed, stop"):
        requests.request_settings({"top_q": 1})


# -- one protocol for every kind ------------------------------------------------------------------


def test_every_lease_kind_is_a_lease_with_its_kind_and_features(model):
    fast = model.with_optimizer(speculative_tokens=2)
    serving = model.with_batching(2)
    chat = model.session()
    try:
        kinds = {lease.kind: lease for lease in (model, fast, serving, chat)}
        assert sorted(kinds) == ["latency", "ordinary", "session", "throughput"]
        assert all(isinstance(lease, llm.Lease) for lease in kinds.values())
        assert set(llm.KINDS) >= set(kinds)
        assert serving.supports("continuous_batching") and not model.supports("continuous_batching")
        assert fast.supports("speculative") and not chat.supports("chat")
        with pytest.raises(errors.ConfigurationError, match="unknown feature") as info:
            model.supports("teleport")
        assert info.value.param == "feature"
    finally:
        for lease in (fast, serving, chat):
            lease.close()
    assert not serving.supports("generate") and serving.closed


def test_on_text_sees_every_piece_on_every_kind(model):
    """``on_text`` is part of the shared generate(): the pieces it sees join to the answer."""
    serving = model.with_batching(2)
    try:
        for lease in (model, serving):
            seen: list[str] = []
            r = lease.generate("the cat sat on", max_tokens=8, on_text=seen.append)
            assert "".join(seen) == r.text and r.text
    finally:
        serving.close()
    with pytest.raises(errors.InvalidRequestError, match="on_text must be a callable") as info:
        model.generate("x", max_tokens=2, on_text="no")  # type: ignore[arg-type]
    assert info.value.param == "on_text"


def test_a_session_turn_is_one_user_message(model):
    with model.session() as chat:
        with pytest.raises(errors.UnsupportedFeatureError, match="send"):
            chat.chat([{"role": "user", "content": "hi"}])
        with pytest.raises(errors.InvalidRequestError) as info:
            chat.stream([{"role": "system", "content": "x"}])
        assert info.value.param == "prompt"
        r = chat.send("hello", max_tokens=3)
        assert [m["role"] for m in chat.messages] == ["user", "assistant"] and r.usage.completion_tokens <= 3


def test_max_tokens_zero_validates_without_a_context_on_every_kind(model):
    serving = model.with_batching(2)
    try:
        for lease in (model, serving):
            r = lease.generate("hello", max_tokens=0)
            assert r.tokens == () and r.timings.evaluated_prompt_tokens == 0 and r.usage.cached_input_tokens == 0
            assert r.timings.prompt_tokens == len(lease.prompt_tokens("hello"))
    finally:
        serving.close()


# -- one lifetime ----------------------------------------------------------------------------------


def test_a_half_built_lifetime_unwinds_what_it_took_in_reverse_order():
    released: list[str] = []
    life = Lifetime("lease")
    with pytest.raises(RuntimeError, match="context creation failed"):
        with life.building() as stack:
            stack.callback(released.append, "weights")
            stack.callback(released.append, "adapter")
            raise RuntimeError("context creation failed")
    assert released == ["adapter", "weights"] and life.closed
    life.release()
    assert released == ["adapter", "weights"]  # once


def test_closing_during_a_request_releases_when_it_ends():
    released: list[str] = []
    life = Lifetime("lease", busy_advice=" (wait)")
    life.stack.callback(released.append, "pool")
    life.begin("generate()")
    with pytest.raises(errors.BusyError, match=r"already running a request; stream\(\) was rejected \(wait\)"):
        life.begin("stream()")
    life.close()
    assert released == [] and life.closed
    with pytest.raises(errors.ClosedError, match="closed"):
        life.begin("generate()")
    life.end()
    assert released == ["pool"]


def test_an_unreachable_lease_releases_its_contexts_and_weights(llama_path):
    base = llm.load(llama_path, context=CTX)
    native = base._weights.native
    lease = base.with_optimizer(prefix_cache_entries=1)
    lease.generate("the cat", max_tokens=2)
    assert native.live_contexts() >= 1
    ref = weakref.ref(lease)
    del lease
    gc.collect()
    assert ref() is None and native.live_contexts() == 0
    base.close()


def test_text_with_a_lone_surrogate_is_refused_by_its_path_before_the_tokenizer(model):
    """No UTF-8 encoder takes a lone surrogate: each entry point names where it is (was a UnicodeEncodeError)."""
    cases = [
        (lambda: model.generate("hi \ud800", max_tokens=2), "messages[0].content"),
        (lambda: model.chat([{"role": "user", "content": "ok"}, {"role": "assistant", "content": "\udfff"},
                             {"role": "user", "content": "ok"}], max_tokens=2), "messages[1].content"),
        (lambda: model.complete("\udc00 raw", max_tokens=2), "prompt"),
        (lambda: model.generate("hi", max_tokens=2, stop=["x", "\ud800"]), "stop[1]"),
        (lambda: model.embed(["fine", "bad \ud800"]), "texts[1]"),
        (lambda: model.tokenize("\ud800"), None),
    ]
    for call, param in cases:
        with pytest.raises(errors.InvalidRequestError) as info:
            call()
        assert info.value.param == param and "surrogate" in str(info.value)
    assert model.generate("hi", max_tokens=2).usage.completion_tokens >= 1
