"""Measured-evidence rules of the timings: queue time counts, -1 means "not measured", never 0.

- ``first_token_duration`` and ``total_duration`` run from the call, so a
  request that waited in the batching queue reports that wait inside them
  (``queue_duration`` still reports it alone).
- A one-token answer had no timed decode: ``decode_duration`` is -1, not 0.
- ``usage`` carries the timings' counts unchanged (no -1 turned into 0).
"""

from __future__ import annotations

import threading

import pytest

from aner_nb import llm
from aner_nb.llm.response import NOT_MEASURED


@pytest.fixture(scope="module")
def model(llama_path):
    with llm.load(llama_path, context=512) as m:
        yield m


def test_one_token_answer_has_no_decode_duration(model):
    r = model.generate("the cat sat on", max_tokens=1)
    t = r.timings
    assert t.generated_tokens == 1
    assert t.decode_duration == NOT_MEASURED
    assert r.tokens_per_second() == -1.0
    assert t.first_token_duration >= t.prompt_eval_duration > 0
    two = model.generate("the cat sat on", max_tokens=2).timings
    if two.generated_tokens == 2:  # no end-of-generation token on the first step
        assert two.decode_duration > 0


def test_usage_copies_the_measured_counts(model):
    r = model.generate("the cat sat on", max_tokens=3)
    assert r.usage.cached_input_tokens == r.timings.cached_input_tokens == 0
    zero = model.generate("validate only", max_tokens=0)
    assert zero.usage.cached_input_tokens == zero.timings.cached_input_tokens == 0
    assert zero.usage.completion_tokens == 0 and zero.timings.first_token_duration == NOT_MEASURED
    with model.with_optimizer(prefix_cache_entries=1) as cached:
        cached.generate("a shared prefix of some length, then a question", max_tokens=2)
        hit = cached.generate("a shared prefix of some length, then a question", max_tokens=2)
        assert hit.usage.cached_input_tokens == hit.timings.cached_input_tokens > 0


def test_first_token_and_total_include_the_time_spent_queued(model):
    """With one sequence slot, the second request waits for the first; its clocks include that wait."""
    release = threading.Event()
    results: dict[str, llm.Response] = {}
    with model.with_batching(1) as serving:
        first = serving.stream("the cat sat on the mat and then", max_tokens=24)
        pieces = iter(first)
        next(pieces)  # the first request holds the only sequence now

        def second():
            results["second"] = serving.generate("a dog ran", max_tokens=4)
            release.set()

        waiter = threading.Thread(target=second)
        waiter.start()
        for _ in pieces:  # finish the first; the second is admitted after it
            pass
        waiter.join(timeout=60)
        assert release.is_set()
    t = results["second"].timings
    assert t.queue_duration > 0
    assert t.first_token_duration >= t.queue_duration + t.prompt_eval_duration
    assert t.total_duration >= t.first_token_duration
