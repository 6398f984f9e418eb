"""Shared prefixes on batching leases: a common system prompt is evaluated once per lease.

The policy is checked as pure functions; on the fixtures every request that
starts from a copied prefix must produce exactly the tokens of the same
request run alone on an ordinary lease (sliding-window gemma3 included),
an entry must survive the cancellation of a request that used it, and two
batching leases must never share entries.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from aner_nb import llm
from aner_nb.llm import errors
from aner_nb.llm.prefix_pool import common_prefix_length
from aner_nb.llm.reuse import MIN_ROWS, restore_point
from aner_nb.llm.shared_prefix import PrefixEntry, SharedPrefixes, best_entry, retention_stream, waits_for
from test_batching import concurrently

CTX = 2048
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8
QUESTIONS = ["what is the cat doing", "hello there", "tell me a story", "why is the sky blue"]
MAX_TOKENS = 12


def conversation(question: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


# -- policy ---------------------------------------------------------------------------------------
def entry(seq, tokens, last_used, hits=0):
    return PrefixEntry(seq, tuple(tokens), last_used, hits)


def test_best_entry_takes_the_longest_common_prefix_and_leaves_the_tail():
    # a prompt's tail is always evaluated, and a partly cached prompt at least MIN_ROWS tokens before it (reuse)
    tail = list(range(100, 100 + MIN_ROWS))
    a, b = entry(4, [1, 2, 3, 4, 5], 1), entry(5, [1, 2, 3, 9], 2)
    assert best_entry([a, b], [1, 2, 3, 4, 7, *tail], trivial_prefix=1) == (a, 4)
    full = [1, 2, 3, 4, 5, 6, *tail]
    assert best_entry([entry(4, full, 1), b], full, trivial_prefix=1) == (entry(4, full, 1), 12)  # the tail again
    assert best_entry([a, b], [1, 2, 3, 4, 5], trivial_prefix=1) == (a, 0)  # too short to keep anything
    assert best_entry([a, b], [1, 2, 8, *tail], trivial_prefix=2) == (None, 0)  # template-only match
    c = entry(6, [1, 2, 3, 4, 6], 3)
    assert best_entry([a, c], [1, 2, 3, 4, 9, *tail], trivial_prefix=1) == (c, 4)  # same length: the most recent


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=5),
    st.lists(st.integers(0, 3), min_size=1, max_size=10),
    st.integers(0, 3),
)
def test_best_entry_matches_a_brute_force_search(held, prompt, trivial):
    entries = [entry(10 + i, t, i) for i, t in enumerate(held)]
    chosen, keep = best_entry(entries, prompt, trivial_prefix=trivial)
    longest = max(common_prefix_length(e.tokens, prompt) for e in entries)
    if longest <= trivial:
        assert (chosen, keep) == (None, 0)
    else:
        assert common_prefix_length(chosen.tokens, prompt) == longest
        assert keep == restore_point(longest, len(prompt))
        assert chosen.tokens[:keep] == tuple(prompt[:keep])


def test_retention_prefers_free_streams_then_evicts_an_entry_that_never_served_a_hit():
    shared, lone_old, lone_new = entry(4, [1, 2, 3], 1, hits=3), entry(5, [7, 8], 2), entry(6, [9, 9], 3)
    assert retention_stream([shared], [5, 6], free=[6, 5]) == 5
    assert retention_stream([shared, lone_old, lone_new], [5, 6], free=[]) == 5  # least recent without hits
    assert retention_stream([shared], [5, 6], free=[]) == 4  # only hit entries left: least recent
    assert retention_stream([shared], [1, 2], free=[5]) is None  # already held by an entry


def test_a_queued_prompt_waits_only_for_a_long_enough_gain():
    shared = list(range(200))
    prompt = shared + [900, 901]
    assert waits_for(prompt, [shared + [5]], best_match=0, cap=2048)
    assert not waits_for(prompt, [shared + [5]], best_match=190, cap=2048)  # the entry already gives most of it
    assert not waits_for(prompt, [shared + [5]], best_match=0, cap=32)  # the other keeps only 32 tokens
    assert not waits_for(prompt, [[7] + shared], best_match=0, cap=2048)  # no common prefix
    assert not waits_for(prompt, [], best_match=0, cap=2048)


def test_shared_prefixes_bookkeeping_counts_hits_and_replacements():
    p = SharedPrefixes([8, 9], max_tokens=4, trivial_prefix=1)
    assert p.placement([1]) is None  # not longer than the template's opening
    assert p.placement([1, 2, 3, 4, 5, 6]) == (8, (1, 2, 3, 4))  # capped at max_tokens
    p.store(8, (1, 2, 3, 4))
    assert p.placement([1, 2, 3]) is None  # held already
    found, keep = p.lookup([1, 2, 3, 4, 7, *range(100, 100 + MIN_ROWS)])
    assert found is not None and found.seq == 8 and keep == 4
    p.used(found, keep)
    p.store(9, (5, 6))
    assert p.placement([7, 7, 7]) == (9, (7, 7, 7))  # the entry without hits goes first
    assert (p.hits, p.reused_tokens, p.retained, p.capacity, p.held_tokens) == (1, 4, 2, 2, 6)


# -- on the fixtures ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_requests_starting_from_a_shared_prefix_equal_the_request_run_alone(fixture_models, arch):
    """A warm entry, then concurrent users with the same system prompt: identical tokens, the prefix
    copied instead of evaluated (gemma3's sliding window is shorter than the prompt)."""
    with llm.load(fixture_models[arch], context=CTX) as base:
        alone = [base.chat(conversation(q), max_tokens=MAX_TOKENS) for q in QUESTIONS]
        with base.with_batching(4, prefix_cache_entries=2) as serving:
            assert serving.supports("prefix_cache")
            first = serving.chat(conversation(QUESTIONS[0]), max_tokens=MAX_TOKENS)
            batched = concurrently(lambda i: serving.chat(conversation(QUESTIONS[i]), max_tokens=MAX_TOKENS), 4)
            stats = serving.stats()
        assert first.tokens == alone[0].tokens and first.timings.cached_input_tokens == 0
        assert first.timings.prefix_cache_hit == 0 and first.timings.prefix_cache_capacity == 2
        system_tokens = len(base._weights.native.tokenize(SYSTEM))  # the system text alone
        for a, b in zip(alone, batched):
            assert isinstance(b, llm.Response), b
            assert b.tokens == a.tokens and b.text == a.text
            t = b.timings
            assert t.cached_input_tokens >= system_tokens and t.prefix_cache_hit == 1 and t.context_pool_reused == 1
            assert t.evaluated_prompt_tokens == t.prompt_tokens - t.cached_input_tokens
        assert stats.prefix_cache_hits == 4 and stats.prefix_cache_reused_tokens >= 4 * system_tokens
        assert 1 <= stats.prefix_cache_entries <= 2 == stats.prefix_cache_capacity


def test_cold_concurrent_users_evaluate_the_common_prefix_once(fixture_models):
    """Four users arrive together at an empty cache: one evaluates the system prompt, the others wait
    for it or find it retained, so far fewer prompt tokens are evaluated than four prompts hold."""
    with llm.load(fixture_models["llama"], context=CTX) as base:
        alone = [base.chat(conversation(q), max_tokens=MAX_TOKENS) for q in QUESTIONS]
        with base.with_batching(4, prefix_cache_entries=1) as serving:
            batched = concurrently(lambda i: serving.chat(conversation(QUESTIONS[i]), max_tokens=MAX_TOKENS), 4)
        assert [b.tokens for b in batched] == [a.tokens for a in alone]
        evaluated = sum(b.timings.evaluated_prompt_tokens for b in batched)
        prompts = sum(a.timings.prompt_tokens for a in alone)
        assert sum(b.timings.prefix_cache_hit for b in batched) == 3
        assert evaluated < prompts / 2, (evaluated, prompts)


def test_an_entry_survives_the_cancelled_request_that_made_it_and_one_that_used_it(fixture_models):
    with llm.load(fixture_models["gemma3"], context=CTX) as base:
        alone = base.chat(conversation(QUESTIONS[1]), max_tokens=MAX_TOKENS)
        with base.with_batching(2, prefix_cache_entries=1) as serving:
            maker = serving.stream(conversation(QUESTIONS[0]), max_tokens=200)
            next(iter(maker))  # its prompt has been evaluated (and retained): cancel it mid-decode
            maker.cancel()
            assert maker.response is None or maker.response.finish_reason == "cancelled"
            user = serving.stream(conversation(QUESTIONS[2]), max_tokens=200)
            next(iter(user))
            user.cancel()
            after = serving.chat(conversation(QUESTIONS[1]), max_tokens=MAX_TOKENS)
            stats = serving.stats()
        assert after.tokens == alone.tokens and after.timings.cached_input_tokens > 0
        assert stats.prefix_cache_entries == 1 and stats.cancelled == 2 and stats.prefix_cache_hits == 2


def test_two_batching_leases_share_nothing(fixture_models):
    with llm.load(fixture_models["llama"], context=CTX) as base:
        with base.with_batching(2, prefix_cache_entries=2) as a, base.with_batching(2, prefix_cache_entries=2) as b:
            warm = a.chat(conversation(QUESTIONS[0]), max_tokens=MAX_TOKENS)
            again = a.chat(conversation(QUESTIONS[1]), max_tokens=MAX_TOKENS)
            other = b.chat(conversation(QUESTIONS[1]), max_tokens=MAX_TOKENS)
            assert warm.timings.cached_input_tokens == 0 and again.timings.cached_input_tokens > 0
            assert other.timings.cached_input_tokens == 0 and other.timings.prefix_cache_entries == 0
            assert other.tokens == again.tokens
            assert b.stats().prefix_cache_hits == 0


def test_without_entries_nothing_is_retained_and_timings_say_so(fixture_models):
    with llm.load(fixture_models["llama"], context=CTX) as base, base.with_batching(2) as serving:
        r1 = serving.chat(conversation(QUESTIONS[0]), max_tokens=4)
        r2 = serving.chat(conversation(QUESTIONS[1]), max_tokens=4)
        assert r2.timings.cached_input_tokens == 0 and r2.timings.context_pool_reused == -1
        assert r1.timings.prefix_cache_capacity == 0 and not serving.supports("prefix_cache")
        s = serving.stats()
        assert (s.prefix_cache_capacity, s.prefix_cache_entries, s.prefix_cache_hits) == (0, 0, 0)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prefix_cache_entries": 17}, "prefix_cache_entries"),
        ({"prefix_cache_entries": -1}, "prefix_cache_entries"),
        ({"prefix_cache_entries": 1, "prefix_cache_tokens": 0}, "prefix_cache_tokens"),
        ({"prefix_cache_entries": True}, "prefix_cache_entries"),
    ],
)
def test_shared_prefix_settings_are_validated(fixture_models, kwargs, param):
    with llm.load(fixture_models["llama"], context=CTX) as base:
        with pytest.raises(errors.ConfigurationError) as info:
            base.with_batching(2, **kwargs)
        assert info.value.param == param and param in str(info.value)
        assert base.generate("still usable", max_tokens=2).tokens  # the source lease is unaffected


# -- the notebook, the command line and the HTTP service ------------------------------------------
def test_the_batch_magic_takes_the_shared_prefix_flags(ip, llama_path):
    ip.run_line_magic("llm", f"load {llama_path} --as base --context {CTX}")
    ip.run_line_magic("llm", "batch base --as shared --max-sequences 2 --prefix-cache-entries 3 --prefix-cache-tokens 64")
    shared = ip.user_ns["shared"]
    stats = shared.stats()
    assert stats.prefix_cache_capacity == 3 and shared.supports("prefix_cache")
    assert shared.profile.optimizer.prefix_cache_tokens == 64
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="prefix_cache_entries"):
        ip.run_line_magic("llm", "batch base --as bad --max-sequences 2 --prefix-cache-entries 99")
    assert "bad" not in ip.user_ns
    ip.run_line_magic("llm", "close shared")


def test_serve_reads_the_shared_prefix_options_from_flags_and_environment(monkeypatch):
    from aner_nb.api import cli

    monkeypatch.setenv("ANER_NB_PREFIX_CACHE_ENTRIES", "4")
    p = cli.parser()
    args = cli.resolve(p, p.parse_args(["m.gguf", "--prefix-cache-tokens", "1500"]))
    assert (args.prefix_cache_entries, args.prefix_cache_tokens) == (4, 1500)
    assert "--prefix-cache-entries" in p.format_help() and "ANER_NB_PREFIX_CACHE_TOKENS" in p.format_help()
    monkeypatch.setenv("ANER_NB_PREFIX_CACHE_ENTRIES", "17")
    with pytest.raises(SystemExit):
        cli.resolve(p, p.parse_args(["m.gguf"]))


def test_an_openai_client_sees_cached_tokens_and_metrics_count_hits(fixture_models):
    openai = pytest.importorskip("openai")
    import httpx

    from aner_nb import api

    with llm.load(fixture_models["llama"], context=CTX) as base, \
            base.with_batching(2, prefix_cache_entries=1) as serving:
        alone = [base.chat(conversation(q), max_tokens=MAX_TOKENS) for q in QUESTIONS[:2]]
        system_tokens = len(base._weights.native.tokenize(SYSTEM))  # the system text alone
        server = api.app("t").llm(path="/chat", model=serving).bind(host="127.0.0.1", port=0).start()
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
            answers = [
                client.chat.completions.create(model=serving.name, messages=conversation(q), max_tokens=MAX_TOKENS,
                                               temperature=0)
                for q in QUESTIONS[:2]
            ]
            metrics = httpx.get(f"{server.url}/metrics").text
        finally:
            server.stop()
    assert [a.choices[0].message.content for a in answers] == [r.text for r in alone]
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    assert answers[1].usage.prompt_tokens_details.cached_tokens >= system_tokens
    hits = [line for line in metrics.splitlines() if line.startswith("aner_prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) == 1.0, hits


def test_memory_summary_counts_the_shared_prefix_streams(fixture_models):
    with llm.load(fixture_models["llama"], context=CTX) as base:
        with base.with_batching(2) as plain, base.with_batching(2, prefix_cache_entries=2) as shared:
            shared.chat(conversation(QUESTIONS[0]), max_tokens=2)
            a, b = plain.memory_summary(), shared.memory_summary()
            ctx = shared._scheduler._ctx
            engine = sum(c.buffer_bytes for c in ctx.kv_buffers)  # what llama.cpp allocated, read back
    assert b.kv_bytes == 2 * a.kv_bytes  # four streams of the same size instead of two
    assert abs(b.kv_bytes - engine) <= 0.05 * engine
    held = {h.what.split(" (")[0]: h for h in b.resident}
    assert held["shared prefixes"].count == 1 and held["shared prefixes"].scope == "per lease"
    assert "2 shared-prefix streams" in b.kv_scope and not any(h.what.startswith("shared prefixes") for h in a.resident)


def test_an_entry_survives_a_request_that_failed_after_copying_it(fixture_models):
    from aner_nb.llm.faults import Fault, inject

    with llm.load(fixture_models["llama"], context=CTX) as base:
        alone = base.chat(conversation(QUESTIONS[2]), max_tokens=MAX_TOKENS)
        with base.with_batching(2, prefix_cache_entries=1) as serving:
            serving.chat(conversation(QUESTIONS[0]), max_tokens=MAX_TOKENS)  # makes the entry
            with inject(Fault("decode", result=-1)) as injection:  # the next step fails: llama_decode error
                with pytest.raises(errors.EngineError):
                    serving.chat(conversation(QUESTIONS[1]), max_tokens=MAX_TOKENS)
                assert injection.fired("decode") == 1
            after = serving.chat(conversation(QUESTIONS[2]), max_tokens=MAX_TOKENS)
            stats = serving.stats()
        assert after.tokens == alone.tokens and after.timings.prefix_cache_hit == 1
        assert stats.failed == 1 and stats.prefix_cache_hits == 2 and stats.prefix_cache_entries == 1
