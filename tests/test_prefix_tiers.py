"""Prefix tiers behind live KV: host RAM and disk (pure policy, then the tiny llama fixture).

Every request that a tier serves must give the output of the cold run; every
stored entry that does not match (corrupt, truncated, another model, adapter,
build or KV type, a full or read-only directory) is skipped, counted by
reason, and the request runs cold.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from aner_nb import llm
from aner_nb.llm import kv_identity
from aner_nb.llm.errors import ConfigurationError
from aner_nb.llm.prefix_store import check_tiers_allowed
from aner_nb.llm.prefix_tiers import (
    TIER_CODES, DiskTier, RamTier, TierConfig, file_name, is_stored_prefix, longest_stored_prefix,
    lru_evictions, parse_file_name, pinned_lengths, token_digest,
)
from fixtures.models import write_lora_adapter, write_tiny_model

CTX = 512
LONG = "Evidence: " + " ".join(f"item{i} weighs {i * 7 % 13} units;" for i in range(8))
QUESTIONS = ["Which item is heaviest?", "Name two items.", "How many items are there?"]


# -- pure policy ------------------------------------------------------------------
def test_file_names_carry_length_and_digest():
    name = file_name((1, 2, 3))
    assert parse_file_name(name) == (3, token_digest((1, 2, 3))[:40])
    assert parse_file_name(".tmp") is None and parse_file_name("x.kv") is None
    assert token_digest((1, 2)) != token_digest((2, 1))


def test_longest_stored_prefix_by_exact_tokens():
    stored = [(1, 2), (1, 2, 3, 4), (1, 9), (1, 2, 3, 4, 5, 6, 7)]
    assert longest_stored_prefix(stored, (1, 2, 3, 4, 5)) == (1, 2, 3, 4)
    assert longest_stored_prefix(stored, (1, 2, 3, 4, 5), min_tokens=5) is None
    assert longest_stored_prefix(stored, (7,)) is None
    assert is_stored_prefix((1, 2), (1, 2)) and not is_stored_prefix((), (1,))


def test_lru_evictions_take_the_oldest_unpinned_first():
    assert lru_evictions([10, 10, 10], 25) == [0]
    assert lru_evictions([10, 10, 10], 25, pinned=[True, False, False]) == [1]
    assert lru_evictions([10, 10, 10], 5, pinned=[True, False, False]) == [1, 2, 0]
    assert lru_evictions([], 0) == []


def test_pinned_lengths_system_part_and_checkpoint():
    assert pinned_lengths(100, 300, trivial=3) == (100,)
    assert pinned_lengths(5000, 6000, checkpoint=4096) == (4096, 5000)
    assert pinned_lengths(100, 100) == ()  # never the whole prompt
    assert pinned_lengths(3, 300, trivial=3) == ()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100), max_size=12), st.integers(0, 400), st.lists(st.booleans(), max_size=12))
def test_lru_evictions_fit_the_budget_and_remove_no_more_than_needed(sizes, budget, pinned):
    out = lru_evictions(sizes, budget, pinned=pinned)
    assert len(set(out)) == len(out)
    rest = sum(s for i, s in enumerate(sizes) if i not in out)
    assert rest <= budget
    if out:  # putting back the last victim would break the budget
        assert rest + sizes[out[-1]] > budget


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple), st.integers(1, 50)), max_size=10),
    st.integers(1, 120),
    st.lists(st.integers(0, 2), max_size=8).map(tuple),
)
def test_ram_tier_bounds_bytes_and_finds_the_longest_prefix(puts, budget, prompt):
    ram = RamTier(budget)
    live: dict[tuple[int, ...], int] = {}
    for tokens, size in puts:
        out = ram.put(tokens, b"x" * size)
        live[tokens] = size
        for k, _ in out:
            live.pop(k, None)
        assert ram.bytes == sum(live.values()) <= budget
        assert set(ram.keys()) == set(live)
    best = ram.longest(prompt)
    assert best == longest_stored_prefix(list(live), prompt)


def test_disk_tier_is_bounded_and_lru_by_mtime(tmp_path):
    disk = DiskTier(tmp_path, 250, kv_identity.write_cache_file)
    for i in range(4):
        assert disk.write((i, 1, 2), b"y" * 100) == 100
        os.utime(disk.path_for((i, 1, 2)), (1000 + i, 1000 + i))
        disk.enforce()
        assert disk.bytes <= 250
    assert not disk.has((0, 1, 2)) and not disk.has((1, 1, 2)) and disk.has((3, 1, 2))
    assert disk.write((9,), b"z" * 251) == 0  # larger than the whole tier: not stored
    assert disk.candidates((3, 1, 2, 7)) == [(3, disk.path_for((3, 1, 2)))]


def test_tier_settings_are_validated(tmp_path):
    with pytest.raises(ConfigurationError, match="prefix_cache_entries"):
        llm.OptimizerSettings(prefix_cache_ram_bytes=1 << 20)
    with pytest.raises(ConfigurationError, match="prefix_cache_ram_bytes"):
        llm.OptimizerSettings(prefix_cache_entries=1, prefix_cache_ram_bytes=-1)
    with pytest.raises(ConfigurationError, match="prefix_cache_dir"):
        llm.OptimizerSettings(prefix_cache_entries=1, prefix_cache_dir="")
    s = llm.OptimizerSettings(prefix_cache_entries=1, prefix_cache_dir=tmp_path)
    assert s.prefix_cache_dir == str(tmp_path) and llm.OptimizerSettings().prefix_cache_dir is None


def test_sliding_window_without_full_cache_is_refused():
    with pytest.raises(ConfigurationError, match="full sliding-window cache"):
        check_tiers_allowed(TierConfig(ram_bytes=1), n_swa=512, swa_full=False)
    check_tiers_allowed(TierConfig(ram_bytes=1), n_swa=512, swa_full=True)
    check_tiers_allowed(TierConfig(), n_swa=512, swa_full=False)


# -- the tiny llama fixture -------------------------------------------------------
@pytest.fixture(scope="module")
def base(llama_path, one_thread):
    with llm.load(llama_path, context=CTX) as m:
        yield m


def ask(lease, question: str):
    return lease.generate(f"{LONG}\n{question}", max_tokens=8)


@pytest.fixture(scope="module")
def cold(base):
    with base.with_optimizer(prefix_cache_entries=1) as plain:
        return {q: ask(plain, q).tokens for q in QUESTIONS}


def test_evicted_prefix_restored_from_ram(base, cold):
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_ram_bytes=64 << 20) as fast:
        first = ask(fast, QUESTIONS[0])
        assert first.tokens == cold[QUESTIONS[0]] and first.timings.prefix_cache_tier == TIER_CODES["cold"]
        other = fast.generate("Something else entirely, with no shared evidence at all.", max_tokens=4)  # evicts
        assert other.timings.prefix_tier_bytes_written > 0
        again = ask(fast, QUESTIONS[1])
        t = again.timings
        assert again.tokens == cold[QUESTIONS[1]]
        assert t.prefix_cache_tier == TIER_CODES["ram"] and t.prefix_restored_tokens > 20
        assert t.prefix_restored_tokens == again.usage.cached_input_tokens and t.prefix_tier_bytes_read > 0
        assert t.prefix_restore_duration >= 0
        stats = fast._state.pool.store.stats.snapshot()
        assert stats["hits"] == {"ram": 1} and stats["skips"] == {}


def test_live_hit_reports_the_live_tier(base, cold):
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_ram_bytes=64 << 20) as fast:
        ask(fast, QUESTIONS[0])
        r = ask(fast, QUESTIONS[1])
        assert r.tokens == cold[QUESTIONS[1]] and r.timings.prefix_cache_tier == TIER_CODES["live"]


def test_a_short_match_keeps_the_long_entry_in_ram_before_cutting_it(base, cold):
    """A request sharing only a short head with the one live entry reuses that head, but the entry's
    longer prefix goes to the RAM tier first, so asking over it again restores it (not the head alone)."""
    head = "Shared header for every topic.\n"
    with base.with_optimizer(prefix_cache_entries=1) as plain:
        want = plain.generate(head + LONG + "\n" + QUESTIONS[0], max_tokens=8).tokens
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_ram_bytes=64 << 20) as fast:
        fast.generate(head + LONG + "\n" + QUESTIONS[1], max_tokens=8)
        short = fast.generate(head + "A different, much shorter topic.", max_tokens=4)
        assert short.timings.prefix_cache_tier == TIER_CODES["live"]  # the head came from live KV
        assert short.timings.prefix_tier_bytes_written > 0  # the long entry was kept before the cut
        again = fast.generate(head + LONG + "\n" + QUESTIONS[0], max_tokens=8)
        assert again.tokens == want
        assert again.timings.prefix_cache_tier == TIER_CODES["ram"]
        assert again.timings.prefix_restored_tokens > short.usage.cached_input_tokens + 64


def test_a_stored_entry_must_save_min_restore_gain_tokens_over_the_live_one(base):
    """Loading an entry copies its whole state: against a live context that keeps part of the prompt, a
    stored entry serves only when it keeps at least MIN_RESTORE_GAIN tokens more; the answer is the same
    either way (both are exact)."""
    from aner_nb.llm.prefix_pool import common_prefix_length
    from aner_nb.llm.prefix_store import MIN_RESTORE_GAIN

    head = "Shared header for every topic.\n"
    stored = head + LONG + "\n" + QUESTIONS[0]
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_ram_bytes=64 << 20) as fast:
        shape = fast.reuse_shape
        fast.generate(stored, max_tokens=4)
        fast.generate(head + "A different, much shorter topic.", max_tokens=4)  # the long entry goes to RAM
        kept = fast._state.pool.retained_tokens()[-1]
        entry = fast._state.pool.store.ram.best(base.prompt_tokens(stored), min_common=1)[0]
        words = LONG.split()
        tiers = set()
        for n_words in (1, 2, 3, 4, 6, 9, 14, 20, 30):
            prompt = head + " ".join(words[:n_words]) + " Something unrelated follows."
            tokens = base.prompt_tokens(prompt)
            live = shape.restore_point(common_prefix_length(kept, tokens), len(tokens), len(kept))
            ram = shape.restore_point(common_prefix_length(entry, tokens), len(tokens), len(entry))
            with base.with_optimizer(prefix_cache_entries=1) as plain:
                want = plain.generate(prompt, max_tokens=4).tokens
            r = fast.generate(prompt, max_tokens=4)
            assert r.tokens == want
            tier = "ram" if ram >= live + MIN_RESTORE_GAIN else "live"
            assert r.timings.prefix_cache_tier == TIER_CODES[tier], (n_words, live, ram)
            tiers.add(tier)
            kept = fast._state.pool.retained_tokens()[-1]  # this prompt is the live entry now
        assert tiers == {"live", "ram"}


def test_tiers_off_leave_the_fields_unmeasured(base):
    with base.with_optimizer(prefix_cache_entries=1) as fast:
        t = ask(fast, QUESTIONS[0]).timings
        assert t.prefix_cache_tier == -1 and t.prefix_restored_tokens == -1


def test_ram_tier_bytes_bound_holds(base):
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_ram_bytes=64 << 20) as probe:
        ask(probe, QUESTIONS[0])
        probe.generate("Unrelated words only.", max_tokens=2)
        one = probe._state.pool.store.ram_bytes
    assert one > 0
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_ram_bytes=int(one * 1.5)) as fast:
        for i in range(4):
            fast.generate(f"Topic {i}: " + LONG, max_tokens=2)
            store = fast._state.pool.store
            assert store.ram_bytes <= int(one * 1.5) and store.ram_entries <= 1


def test_evicted_prefix_restored_from_disk(base, cold, tmp_path):
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_dir=tmp_path) as fast:
        ask(fast, QUESTIONS[0])
        assert fast._state.pool.store.flush(timeout=60)  # disk writes leave the request's thread
        assert len(list(tmp_path.glob("*.kv"))) == 1  # written through on retention
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_dir=tmp_path) as fresh:  # an empty pool
        r = ask(fresh, QUESTIONS[2])
        assert r.tokens == cold[QUESTIONS[2]]
        assert r.timings.prefix_cache_tier == TIER_CODES["disk"] and r.timings.prefix_restored_tokens > 20
        assert fresh._state.pool.store.stats.snapshot()["hits"] == {"disk": 1}


def test_a_prefix_still_queued_for_disk_is_served_from_the_queue(base, cold, tmp_path, monkeypatch):
    import threading

    release = threading.Event()
    real = kv_identity.write_atomic

    def slow_disk(path, data, **kw):  # the writer thread waits here: the write stays queued
        assert release.wait(120)
        real(path, data, **kw)

    monkeypatch.setattr(kv_identity, "write_atomic", slow_disk)
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_dir=tmp_path) as fast:
        store = fast._state.pool.store
        try:
            ask(fast, QUESTIONS[0])  # returns at once although its write-through has not reached the disk
            assert not list(tmp_path.glob("*.kv")) and store.snapshot()["queued_disk_bytes"] > 0
            fast.generate("Something else entirely, with no shared evidence at all.", max_tokens=4)  # evicts
            again = ask(fast, QUESTIONS[1])
            assert again.tokens == cold[QUESTIONS[1]]
            assert again.timings.prefix_cache_tier == TIER_CODES["disk"] and again.timings.prefix_restored_tokens > 20
        finally:
            release.set()
        assert store.flush(timeout=60) and store.snapshot()["queued_disk_bytes"] == 0
        assert store.stats.snapshot()["hits"] == {"disk": 1}
    assert len(list(tmp_path.glob("*.kv"))) >= 2 and not list(tmp_path.glob("*.tmp"))  # close waited for the writes


def test_an_entry_demoted_while_its_write_through_is_queued_is_not_serialised_again(base, cold, tmp_path, monkeypatch):
    """The RAM tier takes the queued write's bytes (the same prefix, the same KV): one state copy per
    retained prompt, not one more when the pool evicts it; the restore from RAM still equals the cold run."""
    import threading

    from aner_nb.llm import _engine

    release = threading.Event()
    real_write, real_copy = kv_identity.write_atomic, _engine.NativeContext.seq_state_copy
    copies = []

    def slow_disk(path, data, **kw):
        assert release.wait(120)
        real_write(path, data, **kw)

    def counted(self, seq, into, **kw):
        copies.append(seq)
        return real_copy(self, seq, into, **kw)

    monkeypatch.setattr(kv_identity, "write_atomic", slow_disk)
    monkeypatch.setattr(_engine.NativeContext, "seq_state_copy", counted)
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_ram_bytes=1 << 30, prefix_cache_dir=tmp_path) as fast:
        store = fast._state.pool.store
        try:
            ask(fast, QUESTIONS[0])
            (kept,) = fast._state.pool.retained_tokens()
            (whole,) = store.writer.pending_keys()  # the whole prompt, with its last row's logits
            assert len(copies) == 1 and whole[: len(kept)] == kept and len(whole) > len(kept)
            fast.generate("Something else entirely, with no shared evidence at all.", max_tokens=4)  # evicts
            assert len(copies) == 2  # the new prompt's own write-through only
            assert store.ram.keys() == [whole] and store.ram.get(whole) is store.writer.pending(whole)
            again = ask(fast, QUESTIONS[1])
            assert again.tokens == cold[QUESTIONS[1]] and again.timings.prefix_cache_tier == TIER_CODES["ram"]
        finally:
            release.set()
        assert store.flush(timeout=60)


# -- faults: every request equals the cold run, nothing wrong is restored, each case is counted ------
def fill(base, directory: Path, question: str = QUESTIONS[0]) -> Path:
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_dir=directory) as writer:
        ask(writer, question)
    files = sorted(directory.glob("*.kv"))
    assert len(files) == 1
    return files[0]


def fresh_request(base, directory: Path, cold, question: str = QUESTIONS[2], **kwargs):
    """A new lease (empty pool) over ``directory``: its answer, timings and the tiers' counters."""
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_dir=directory, **kwargs) as lease:
        r = ask(lease, question)
        assert lease._state.pool.store.flush(timeout=60)  # its write (or failed write) is counted
        stats = lease._state.pool.store.stats.snapshot()
    assert r.tokens == cold[question]
    return r, stats


def rewrite_identity(path: Path, **changes) -> None:
    """Re-stamp a valid file as if another configuration had written it (a well-formed foreign file)."""
    data = path.read_bytes()
    header_len = int.from_bytes(data[8:12], "little")
    identity = kv_identity.KVIdentity.from_json(json.loads(data[12:12 + header_len])["identity"])
    full = kv_identity.unpack_full(data, identity)
    path.write_bytes(kv_identity.pack(dataclasses.replace(identity, **changes), full.tokens, full.payload))


@pytest.mark.parametrize("fault, reason", [
    ("corrupt", "corrupt"), ("truncated", "truncated"), ("build", "foreign_build"),
    ("kv_type", "foreign_kv_type"), ("model", "foreign_model"), ("garbage", "corrupt"),
])
def test_a_bad_file_is_skipped_counted_and_the_request_runs_cold(base, cold, tmp_path, fault, reason):
    path = fill(base, tmp_path)
    data = path.read_bytes()
    if fault == "corrupt":
        path.write_bytes(data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
    elif fault == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif fault == "build":
        rewrite_identity(path, build="llama-cpp-python 0.0.1; version 0; commit deadbeef")
    elif fault == "kv_type":
        rewrite_identity(path, type_k="q8_0", type_v="q8_0")
    elif fault == "model":
        rewrite_identity(path, model_sha256="0" * 64)
    else:
        path.write_bytes(b"\x00" * 100)
    r, stats = fresh_request(base, tmp_path, cold)
    assert r.timings.prefix_cache_tier == TIER_CODES["cold"] and r.usage.cached_input_tokens == 0
    assert stats["skips"] == {reason: 1} and stats["hits"] == {} and stats["misses"] == 1
    # the skipped file was replaced by this lease's own; the next fresh lease restores it
    r2, stats2 = fresh_request(base, tmp_path, cold, QUESTIONS[1])
    assert r2.timings.prefix_cache_tier == TIER_CODES["disk"] and stats2["hits"] == {"disk": 1}


@pytest.mark.parametrize("what", ["fifo_kv", "fifo_tok", "link_to_fifo", "directory"])
def test_a_tier_entry_that_is_no_regular_file_is_never_opened(base, cold, tmp_path, what):
    """Another program's FIFO named like a tier file blocked a plain open forever, and every later request with
    it; a link or a directory is no state either. Such entries are passed over, and the request runs cold."""
    path = fill(base, tmp_path)
    target = path.with_suffix(".tok") if what == "fifo_tok" else path
    target.unlink()
    if what == "directory":
        target.mkdir()
    elif what == "link_to_fifo":
        os.mkfifo(tmp_path / "elsewhere")
        target.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(target)
    answers: list = []
    worker = threading.Thread(target=lambda: answers.append(fresh_request(base, tmp_path, cold)), daemon=True)
    worker.start()
    worker.join(120)  # a hang guard, not a timing: the open used to wait for a writer that never comes
    assert not worker.is_alive(), "the request waited on the FIFO"
    r, _ = answers[0]
    assert r.timings.prefix_cache_tier == TIER_CODES["cold"] and r.usage.cached_input_tokens == 0
    os.mkfifo(tmp_path / "probe.fifo")
    for other in (tmp_path / "probe.fifo", tmp_path):
        with pytest.raises(OSError, match="not a regular file"):
            kv_identity.open_regular(other)


# -- a whole prompt asked again: stored with its last row's logits, it evaluates nothing ---------------
def test_a_prompt_asked_again_after_a_restart_evaluates_nothing(base, cold, tmp_path):
    """The first token comes from the stored row: the cold run's logprobs bit for bit, then the same decode."""
    fill(base, tmp_path)
    prompt, opts = f"{LONG}\n{QUESTIONS[0]}", dict(max_tokens=8, logprobs=True, top_logprobs=4)
    with base.with_optimizer(prefix_cache_entries=1) as plain:
        want = plain.generate(prompt, **opts)
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_dir=tmp_path) as fresh:
        r = fresh.generate(prompt, **opts)
        assert fresh._state.pool.store.flush(timeout=60)
        stats = fresh._state.pool.store.stats.snapshot()
    t = r.timings
    assert r.tokens == want.tokens == cold[QUESTIONS[0]] and r.logprobs == want.logprobs
    assert t.prefix_cache_tier == TIER_CODES["disk"] and t.evaluated_prompt_tokens == 0
    assert t.prefix_restored_tokens == r.usage.cached_input_tokens == r.usage.prompt_tokens
    assert stats["hits"] == {"disk": 1} and stats["skips"] == {}
    assert len(list(tmp_path.glob("*.kv"))) == 1  # asked again, nothing new is written


@pytest.mark.parametrize("opts", [
    dict(temperature=0.9, seed=11, top_k=40),
    dict(temperature=0.7, seed=3, repeat_penalty=1.3, min_p=0.02),
])
def test_a_sampled_first_token_from_stored_logits_is_the_cold_runs(base, tmp_path, opts):
    """A sampler chain applied to the stored row (``Sampler.sample_row``) draws what llama.cpp's own
    ``llama_sampler_sample`` drew from the context's row in the cold run, and the chain's state follows."""
    prompt = f"{LONG}\n{QUESTIONS[0]}"
    fill(base, tmp_path)
    with base.with_optimizer(prefix_cache_entries=1) as plain:
        want = [plain.generate(prompt, max_tokens=8, **opts).tokens for _ in range(2)]
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_dir=tmp_path) as fresh:
        r = fresh.generate(prompt, max_tokens=8, **opts)
    assert want[0] == want[1]  # seeded: the cold run is repeatable
    assert r.timings.evaluated_prompt_tokens == 0 and r.tokens == want[0]


@pytest.mark.parametrize("bad", ["short", "nan", "inf"])
def test_stored_logits_that_are_not_one_finite_row_are_skipped(base, cold, tmp_path, bad):
    """A well-formed file (its checksum matches) whose logits are not one finite float per vocabulary entry
    is never used, not even for its body: counted as corrupt, the request runs cold, the file is replaced."""
    path = fill(base, tmp_path)
    data = path.read_bytes()
    header_len = int.from_bytes(data[8:12], "little")
    identity = kv_identity.KVIdentity.from_json(json.loads(data[12:12 + header_len])["identity"])
    full = kv_identity.unpack_full(data, identity)
    row = np.frombuffer(full.logits, dtype="<f4").copy()
    assert row.size == base._weights.native.n_vocab and np.isfinite(row).all()
    if bad == "short":
        row = row[:-1]
    else:
        row[7] = np.nan if bad == "nan" else np.inf
    forged = kv_identity.pack(identity, full.tokens, full.payload, logits=row)
    for question in QUESTIONS[0], QUESTIONS[2]:  # the same prompt, and one that would reuse the body
        directory = tmp_path / f"for-{QUESTIONS.index(question)}"
        directory.mkdir()
        (directory / path.name).write_bytes(forged)
        (directory / path.with_suffix(".tok").name).write_bytes(path.with_suffix(".tok").read_bytes())
        r, stats = fresh_request(base, directory, cold, question)
        assert r.timings.prefix_cache_tier == TIER_CODES["cold"] and stats["skips"] == {"corrupt": 1}
    # the lease replaced the file it skipped with its own: the next one is served from it
    r, stats = fresh_request(base, tmp_path / "for-0", cold, QUESTIONS[0])
    assert r.timings.prefix_cache_tier == TIER_CODES["disk"] and r.timings.evaluated_prompt_tokens == 0


def test_a_longer_prompt_reuses_only_the_body_of_a_whole_prompt_entry(base, tmp_path):
    """The rows after a whole prompt's body were its tail, evaluated in a call of their own: a prompt that
    continues it restores at most the body, as it would from a live entry, and answers as the cold run does."""
    text = f"{LONG}\n{QUESTIONS[0]}"
    longer = text + " Answer with the item's name and its weight in units."
    whole = base.tokenize(text)
    assert base.tokenize(longer)[: len(whole)] == whole  # the stored prompt is a prefix of the longer one
    with base.with_optimizer(prefix_cache_entries=1) as plain:
        want = plain.complete(longer, max_tokens=8)
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_dir=tmp_path) as writer:
        writer.complete(text, max_tokens=8)
        shape = writer.reuse_shape
    (path,) = tmp_path.glob("*.kv")
    assert parse_file_name(path.name)[0] == len(whole)  # stored whole
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_dir=tmp_path) as fresh:
        r = fresh.complete(longer, max_tokens=8)
    body = shape.retained_rows(len(whole), len(whole))
    assert r.timings.prefix_cache_tier == TIER_CODES["disk"] and 0 < r.timings.prefix_restored_tokens <= body
    assert r.tokens == want.tokens


def test_stored_logits_serve_a_whole_cached_prompt_only(base):
    """The runner takes a first token from stored logits only when every prompt position is cached."""
    from aner_nb.llm.context_pool import new_slot
    from aner_nb.llm.requests import request_settings
    from aner_nb.llm.runner import Job, run_request

    native = base._weights.native
    row = np.zeros(native.n_vocab, dtype=np.float32)
    slot = new_slot(native, base._params)
    try:
        for n_cached in (0, 3):  # stored logits with positions left to evaluate: refused before any decode
            job = Job((1, 2, 3, 4), request_settings({"max_tokens": 2}), 0, n_cached=n_cached, cached_logits=row)
            with pytest.raises(ValueError, match="whole cached prompt"):
                next(run_request(native, slot.ctx, slot.batch, job))
        with pytest.raises(ValueError, match="at least one prompt token"):
            next(run_request(native, slot.ctx, slot.batch, Job((1, 2), request_settings({}), 0, n_cached=2)))
    finally:
        slot.free()


def test_a_file_of_another_model_is_never_restored(base, cold, tmp_path):
    other_path = write_tiny_model(tmp_path / "other.gguf", "llama", seed=5)
    tiers = tmp_path / "tiers"
    with llm.load(other_path, context=CTX) as other:
        fill(other, tiers)  # same tokenizer: the same prompt tokens, so the same file name
    r, stats = fresh_request(base, tiers, cold)
    assert r.timings.prefix_cache_tier == TIER_CODES["cold"] and stats["skips"] == {"foreign_model": 1}


def test_a_file_of_another_adapter_is_never_restored(base, cold, tmp_path):
    from test_adapters import make_manifest

    manifest = make_manifest(tmp_path / "adapter", base)
    tiers = tmp_path / "tiers"
    with base.with_adapter(manifest) as adapted:
        fill(adapted, tiers)
    r, stats = fresh_request(base, tiers, cold)
    assert r.timings.prefix_cache_tier == TIER_CODES["cold"] and stats["skips"] == {"foreign_adapter": 1}


def test_a_full_or_unwritable_directory_is_counted_and_harmless(base, cold, tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    r, stats = fresh_request(base, blocked, cold)
    assert stats["skips"] == {"write_failed": 1} and r.timings.prefix_cache_tier == TIER_CODES["cold"]

    def full(path, data, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_identity, "write_atomic", full)
    r, stats = fresh_request(base, tmp_path / "full", cold)
    assert stats["skips"] == {"write_failed": 1} and not list((tmp_path / "full").glob("*.kv"))


def test_disk_bytes_bound_holds(base, tmp_path):
    one = fill(base, tmp_path / "probe").stat().st_size
    bound = int(one * 2.5)
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_dir=tmp_path / "d", prefix_cache_disk_bytes=bound) as fast:
        for i in range(5):
            fast.generate(f"Topic {i}: " + LONG, max_tokens=2)
            assert fast._state.pool.store.flush(timeout=60)
            total = sum(p.stat().st_size for p in (tmp_path / "d").iterdir())
            assert total <= bound
    assert len(list((tmp_path / "d").glob("*.kv"))) == 2


CHILD = textwrap.dedent("""
    import json, sys
    from aner_nb import llm
    model, directory, prompt = sys.argv[1:4]
    with llm.load(model, context=%d) as m, m.with_optimizer(prefix_cache_entries=1, prefix_cache_dir=directory) as f:
        r = f.generate(prompt, max_tokens=8)
        print(json.dumps({"tokens": list(r.tokens), "tier": r.timings.prefix_cache_tier,
                          "restored": r.timings.prefix_restored_tokens}))
""" % CTX)


def run_children(llama_path, directory: Path, prompts: list[str]) -> list[dict]:
    env = {**os.environ, "ANER_NB_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(llama_path), str(directory), p], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for p in prompts
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-2000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_disk_tier_survives_a_new_process_and_two_writers(llama_path, cold, tmp_path):
    # two processes write the same prefix at once; the directory holds one whole file, no temporaries
    writers = run_children(llama_path, tmp_path, [f"{LONG}\n{QUESTIONS[0]}"] * 2)
    assert all(w["tokens"] == list(cold[QUESTIONS[0]]) for w in writers)
    assert len(list(tmp_path.glob("*.kv"))) == 1 and not list(tmp_path.glob("*.tmp"))
    # a fresh process (a restarted kernel) restores it and answers as the cold run does
    (reader,) = run_children(llama_path, tmp_path, [f"{LONG}\n{QUESTIONS[2]}"])
    assert reader["tokens"] == list(cold[QUESTIONS[2]])
    assert reader["tier"] == TIER_CODES["disk"] and reader["restored"] > 20


# -- batching leases: the shared-prefix streams have the same tiers ----------------------------
def test_batching_shared_prefix_restored_from_ram_and_disk(base, cold, tmp_path):
    opts = dict(prefix_cache_entries=1, prefix_cache_ram_bytes=64 << 20, prefix_cache_dir=tmp_path)
    with base.with_batching(2, **opts) as batch:
        first = ask(batch, QUESTIONS[0])
        assert first.tokens == cold[QUESTIONS[0]] and first.timings.prefix_cache_tier == TIER_CODES["cold"]
        batch.generate("Something else entirely, with no shared evidence at all.", max_tokens=4)  # evicts
        again = ask(batch, QUESTIONS[1])
        assert again.tokens == cold[QUESTIONS[1]]
        assert again.timings.prefix_cache_tier == TIER_CODES["ram"] and again.timings.prefix_restored_tokens > 20
        assert again.usage.cached_input_tokens == again.timings.prefix_restored_tokens
    with base.with_batching(2, **opts) as fresh:  # a new lease: nothing live, nothing in RAM
        r = ask(fresh, QUESTIONS[2])
        assert r.tokens == cold[QUESTIONS[2]] and r.timings.prefix_cache_tier == TIER_CODES["disk"]


# -- the same names on every surface ----------------------------------------------------------
def test_magic_and_serve_flags_set_the_tiers(ip, llama_path, tmp_path):
    from aner_nb.api import cli

    ip.run_line_magic("llm", f"load {llama_path} --as tb --context {CTX}")
    ip.run_line_magic("llm", f"optimize tb --as tf --prefix-cache-entries 1 --prefix-cache-ram-bytes 1048576 "
                             f"--prefix-cache-dir {tmp_path} --prefix-cache-disk-bytes 2097152")
    opt = ip.user_ns["tf"].profile.optimizer
    assert (opt.prefix_cache_ram_bytes, opt.prefix_cache_dir, opt.prefix_cache_disk_bytes) == (1 << 20, str(tmp_path), 2 << 20)
    ip.run_line_magic("llm", f"batch tb --as tq --max-sequences 2 --prefix-cache-entries 1 --prefix-cache-dir {tmp_path}")
    assert ip.user_ns["tq"].profile.optimizer.prefix_cache_dir == str(tmp_path)
    p = cli.parser()
    args = cli.resolve(p, p.parse_args([str(llama_path), "--prefix-cache-entries", "1", "--prefix-cache-dir",
                                        str(tmp_path), "--prefix-cache-ram-bytes", "4096"]))
    cli.check(args)
    assert (args.prefix_cache_dir, args.prefix_cache_ram_bytes) == (str(tmp_path), 4096)
    bad = cli.resolve(p, p.parse_args([str(llama_path), "--prefix-cache-dir", str(tmp_path)]))
    with pytest.raises(ConfigurationError, match="prefix_cache_entries"):
        cli.check(bad)


# -- observability -----------------------------------------------------------------------------
def test_memory_summary_and_metrics_count_the_tiers(base, cold, tmp_path):
    from types import SimpleNamespace

    from aner_nb.api.metrics import _prefix_tier_metrics

    path = fill(base, tmp_path)
    path.write_bytes(path.read_bytes()[:100])  # truncated: one skip
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_ram_bytes=64 << 20, prefix_cache_dir=tmp_path) as fast:
        ask(fast, QUESTIONS[0])
        fast.generate("Unrelated words only.", max_tokens=2)  # demotes the evidence prefix into RAM
        r = ask(fast, QUESTIONS[1])
        assert r.tokens == cold[QUESTIONS[1]] and r.timings.prefix_cache_tier == TIER_CODES["ram"]
        stats = fast.prefix_tier_stats()
        summary = fast.memory_summary()
        families = {f.name: f for f in _prefix_tier_metrics([SimpleNamespace(name="m", model=fast)])}
    ram = [h for h in summary.resident if h.what.startswith("prefix RAM tier")]
    assert len(ram) == 1 and ram[0].bytes == stats["held_bytes"]["ram"] > 0
    assert any(h.what.startswith("prefix RAM tier") and h.bytes == 64 << 20 for h in summary.bounds)
    assert stats["skips"] == {"truncated": 1} and stats["hits"] == {"ram": 1}

    def value(name, **labels):
        return [s.value for s in families[name].samples if all(s.labels.get(k) == v for k, v in labels.items())
                and s.name.endswith("_total" if families[name].type == "counter" else "")]

    assert value("aner_prefix_tier_skips", reason="truncated") == [1]
    assert value("aner_prefix_tier_hits", tier="ram") == [1]
    assert value("aner_prefix_tier_misses") == [stats["misses"]]
    assert value("aner_prefix_tier_held_bytes", tier="ram")[0] > 0
    assert value("aner_prefix_tier_written_bytes", tier="disk")[0] > 0
    assert base.with_optimizer(prefix_cache_entries=1).prefix_tier_stats() is None


# -- pinned system prefixes ---------------------------------------------------------------------
def chat(lease, question: str):
    return lease.chat([{"role": "system", "content": LONG}, {"role": "user", "content": question}], max_tokens=6)


def test_the_system_prefix_is_pinned_apart_from_the_conversation_lru(base):
    from aner_nb.llm.prefix_store import system_prefix_length

    with base.with_optimizer(prefix_cache_entries=1) as plain:
        cold = {q: chat(plain, q).tokens for q in QUESTIONS}
        prepared = plain._prepare(
            ({"role": "system", "content": LONG}, {"role": "user", "content": QUESTIONS[0]}), llm.RequestSettings()
        )
    system = system_prefix_length(base._weights, prepared.messages, prepared.tokens)
    assert 20 < system < len(prepared.tokens)
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_ram_bytes=64 << 20) as probe:
        chat(probe, QUESTIONS[0])
        one = probe._state.pool.store.ram_bytes  # the pinned system prefix alone
    assert one > 0
    # room for the pin and about one conversation: conversations churn, the pin stays
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_ram_bytes=int(one * 2.5)) as fast:
        chat(fast, QUESTIONS[0])
        for i in range(3):
            fast.generate(f"Unrelated topic {i}: " + LONG[:200], max_tokens=2)
        store = fast._state.pool.store
        pinned = fast.reuse_shape.floor(system)  # a kept prefix ends on the shape's row block (retained_rows)
        assert tuple(prepared.tokens[:pinned]) in store.ram
        r = chat(fast, QUESTIONS[2])
        assert r.tokens == cold[QUESTIONS[2]]
        assert r.timings.prefix_cache_tier == TIER_CODES["ram"] and r.timings.prefix_restored_tokens == pinned
        assert store.ram_bytes <= int(one * 2.5)


def test_the_timings_line_names_the_tier(base, tmp_path):
    from aner_nb.widgets.timings import timings_line

    fill(base, tmp_path)
    with base.with_optimizer(prefix_cache_entries=1, prefix_cache_dir=tmp_path) as fresh:
        r = ask(fresh, QUESTIONS[1])
    assert "prefix from disk (" in timings_line(r)
    assert r.to_frame() is not None


# -- sliding-window models: a latency lease saves every cell, restored where it was evaluated ---------
def test_gemma_fixture_restores_exactly_from_ram_and_disk(fixture_models, one_thread, tmp_path):
    with llm.load(fixture_models["gemma3"], context=CTX) as gemma:
        n_swa = gemma._weights.native.n_swa
        assert n_swa > 0  # a sliding window shorter than the prefix
        with gemma.with_optimizer(prefix_cache_entries=1) as plain:
            cold = {q: ask(plain, q).tokens for q in QUESTIONS}
        with gemma.with_optimizer(prefix_cache_entries=1, prefix_cache_ram_bytes=64 << 20) as fast:  # RAM only
            ask(fast, QUESTIONS[0])
            fast.generate("Something else entirely, with no shared evidence at all.", max_tokens=2)
            r = ask(fast, QUESTIONS[0])  # the same prompt: its demoted entry holds the prompt's body
            assert r.tokens == cold[QUESTIONS[0]] and r.timings.prefix_cache_tier == TIER_CODES["ram"]
            assert r.timings.prefix_restored_tokens == fast.reuse_shape.reuse_limit(r.usage.prompt_tokens) > n_swa
            other = ask(fast, QUESTIONS[1])
            assert other.tokens == cold[QUESTIONS[1]]
        opts = dict(prefix_cache_entries=1, prefix_cache_ram_bytes=64 << 20, prefix_cache_dir=tmp_path)
        with gemma.with_optimizer(**opts) as writer:  # the disk tier: whole prompts with their last row's logits
            ask(writer, QUESTIONS[0])
        with gemma.with_optimizer(**opts) as fresh:
            r = ask(fresh, QUESTIONS[0])
            assert r.tokens == cold[QUESTIONS[0]] and r.timings.prefix_cache_tier == TIER_CODES["disk"]
            assert r.timings.prefix_restored_tokens == r.usage.prompt_tokens > n_swa
            assert r.timings.evaluated_prompt_tokens == 0
            r = ask(fresh, QUESTIONS[2])
            assert r.tokens == cold[QUESTIONS[2]]
