"""Saved KV state: the identity stamp, the bounded file format, atomic writes, and the engine's
per-sequence state round trip (``NativeContext.seq_state_bytes`` / ``seq_state_load``) checked
against a cold run of the same tokens."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aner_nb.llm import _engine, kv_identity
from aner_nb.llm.errors import EngineError, LLMError, StateMismatchError
from aner_nb.llm.kv_identity import KVIdentity, pack, read_file, unpack, unpack_full, write_atomic

IDENTITY = KVIdentity(
    model_sha256="a" * 64,
    adapter_sha256=None,
    type_k="f16",
    type_v="f16",
    n_ctx=256,
    n_seq_max=1,
    kv_unified=True,
    flash_attention="auto",
    n_swa=0,
    swa_full=False,
    build="llama-cpp-python 0.3.36; version 0.25.3; commit test",
)
TOKENS = (1, 2, 3, 40000, 7)
PAYLOAD = bytes(range(256)) * 3
SMALL = pack(IDENTITY, TOKENS, PAYLOAD[:40], meta={"messages": [{"role": "user", "content": "hé"}]})


def reason_of(data: bytes, expected: KVIdentity = IDENTITY) -> str:
    with pytest.raises(StateMismatchError) as info:
        unpack(data, expected)
    assert isinstance(info.value, LLMError)
    assert info.value.reason in kv_identity.REASONS
    return info.value.reason


def test_round_trip_returns_tokens_payload_and_meta() -> None:
    data = pack(IDENTITY, TOKENS, PAYLOAD, meta={"trusted": [0, 2]})
    assert unpack(data, IDENTITY) == (TOKENS, PAYLOAD)
    full = unpack_full(data, IDENTITY)
    assert full.identity == IDENTITY and full.meta == {"trusted": [0, 2]}
    assert unpack(pack(IDENTITY, (), b"x"), IDENTITY) == ((), b"x")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model_sha256": "b" * 64}, "foreign_model"),
        ({"adapter_sha256": "c" * 64}, "foreign_adapter"),
        ({"build": "llama-cpp-python 0.3.37"}, "foreign_build"),
        ({"type_k": "q8_0"}, "foreign_kv_type"),
        ({"type_v": "q4_0"}, "foreign_kv_type"),
        ({"n_ctx": 512}, "layout"),
        ({"n_seq_max": 2}, "layout"),
        ({"kv_unified": False}, "layout"),
        ({"flash_attention": "on"}, "layout"),
        ({"n_swa": 512}, "layout"),
        ({"swa_full": True}, "layout"),
        ({"state": "all_cells"}, "layout"),
    ],
)
def test_each_identity_field_mismatch_names_its_reason(change: dict, reason: str) -> None:
    written = dataclasses.replace(IDENTITY, **change)
    assert reason_of(pack(written, TOKENS, PAYLOAD), IDENTITY) == reason
    # and the other way round: a file of this identity on a context of the other
    assert reason_of(pack(IDENTITY, TOKENS, PAYLOAD), written) == reason


def test_model_mismatch_is_reported_before_the_other_differences() -> None:
    other = dataclasses.replace(IDENTITY, model_sha256="b" * 64, build="other", type_k="q8_0")
    assert reason_of(pack(other, TOKENS, PAYLOAD)) == "foreign_model"


def _reheader(data: bytes, edit) -> bytes:
    """The same file with its header JSON edited by ``edit`` and the header digest recomputed."""
    import hashlib

    _, n = struct.unpack_from("<8sI", data)
    doc = json.loads(data[12 : 12 + n])
    edit(doc)
    header = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    return struct.pack("<8sI", kv_identity.MAGIC, len(header)) + header + hashlib.sha256(header).digest() + data[12 + n + 32 :]


def test_the_state_field_is_optional_for_old_files_and_checked_when_present() -> None:
    """A header written before ``state`` existed reads as a per-sequence state; a mistyped value is corrupt,
    an unknown one names the layout."""
    old = _reheader(SMALL, lambda d: d["identity"].pop("state"))
    assert unpack_full(old, IDENTITY).identity == IDENTITY and IDENTITY.state == "sequence"
    assert reason_of(_reheader(SMALL, lambda d: d["identity"].update(state=7))) == "corrupt"
    assert reason_of(_reheader(SMALL, lambda d: d["identity"].update(state="x" * 4096))) == "layout"


def test_newer_format_is_its_own_reason() -> None:
    assert reason_of(_reheader(SMALL, lambda d: d.update(format=kv_identity.FORMAT_VERSION + 1))) == "newer_format"
    # a newer format may change every other field: the version is checked first
    assert reason_of(_reheader(SMALL, lambda d: d.update(format=99, identity="new"))) == "newer_format"


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(format=0),
        lambda d: d.update(format="1"),
        lambda d: d.update(format=True),
        lambda d: d.pop("body_xxh3_128"),
        lambda d: d.update(body_sha256="0" * 64),  # a format 1 field in a format 2 header
        lambda d: d.update(extra=1),
        lambda d: d.update(identity=[]),
        lambda d: d["identity"].update(n_ctx="256"),
        lambda d: d["identity"].update(kv_unified=1),
        lambda d: d["identity"].pop("build"),
        lambda d: d.update(n_tokens=-1),
        lambda d: d.update(n_tokens=kv_identity.MAX_TOKENS + 1),
        lambda d: d.update(meta_bytes=kv_identity.MAX_META_BYTES + 1),
        lambda d: d.update(payload_bytes=kv_identity.DEFAULT_MAX_PAYLOAD_BYTES + 1),
        lambda d: d.update(body_xxh3_128="0" * 32),
        lambda d: d.update(body_xxh3_128="0" * 64),
        lambda d: d.update(body_xxh3_128=None),
    ],
)
def test_malformed_headers_are_corrupt(edit) -> None:
    assert reason_of(_reheader(SMALL, edit)) == "corrupt"


def _format_1(data: bytes) -> bytes:
    """The same file as format 1 wrote it: ``body_sha256`` over tokens, meta and payload."""
    import hashlib

    _, n = struct.unpack_from("<8sI", data)
    body = data[12 + n + 32 :]

    def edit(doc: dict) -> None:
        assert doc.pop("logits_bytes") == 0  # formats 1 and 2 had no logits
        del doc["body_xxh3_128"]
        doc.update(format=1, body_sha256=hashlib.sha256(body).hexdigest())

    return _reheader(data, edit)


def test_format_1_files_are_still_read_and_checked() -> None:
    data = pack(IDENTITY, TOKENS, PAYLOAD, meta={"trusted": [1]})
    old = _format_1(data)
    assert json.loads(old[12 : 12 + struct.unpack_from("<8sI", old)[1]])["format"] == 1
    full = unpack_full(old, IDENTITY)
    assert (full.tokens, bytes(full.payload), full.meta) == (TOKENS, PAYLOAD, {"trusted": [1]})
    assert reason_of(old[:-1] + bytes([old[-1] ^ 1])) == "corrupt"  # its SHA-256 is checked
    # and a format 1 header with the format 2 checksum field is malformed
    assert reason_of(_reheader(data, lambda d: d.update(format=1))) == "corrupt"


def test_format_2_files_are_still_read_and_have_no_logits() -> None:
    data = pack(IDENTITY, TOKENS, PAYLOAD, meta={"trusted": [1]})
    old = _reheader(data, lambda d: (d.pop("logits_bytes"), d.update(format=2)))
    full = unpack_full(old, IDENTITY)
    assert (full.tokens, bytes(full.payload), full.meta, full.logits) == (TOKENS, PAYLOAD, {"trusted": [1]}, None)
    # format 2 knew no logits_bytes; format 3 must name it
    assert reason_of(_reheader(data, lambda d: d.update(format=2))) == "corrupt"
    assert reason_of(_reheader(data, lambda d: d.pop("logits_bytes"))) == "corrupt"


LOGITS = np.linspace(-3.0, 5.0, 97, dtype="<f4")


def test_last_row_logits_round_trip_and_are_checksummed(tmp_path: Path) -> None:
    """A whole prompt's entry keeps the float32 row of its last token; every byte of it is in the checksum."""
    data = pack(IDENTITY, TOKENS, PAYLOAD, logits=LOGITS)
    full = unpack_full(data, IDENTITY)
    assert bytes(full.payload) == PAYLOAD and bytes(full.logits) == LOGITS.tobytes()
    in_place = kv_identity.pack_in_place(
        IDENTITY, TOKENS, len(PAYLOAD) + 9, lambda view: _fill(view, PAYLOAD), logits=LOGITS
    )
    assert bytes(in_place) == data  # the in-place writer and pack agree byte for byte
    write_atomic(tmp_path / "x.kv", data)
    assert bytes(read_file(tmp_path / "x.kv", IDENTITY).logits) == LOGITS.tobytes()
    start = data.index(LOGITS.tobytes())
    for i in (start, start + 4 * 50 + 2, start + LOGITS.nbytes - 1):
        assert reason_of(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]) == "corrupt"
    assert reason_of(data[:-1]) == "truncated"


def _fill(view: memoryview, payload: bytes) -> int:
    view[: len(payload)] = payload
    return len(payload)


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(logits_bytes=-4),
        lambda d: d.update(logits_bytes=kv_identity.MAX_LOGITS_BYTES + 4),
        lambda d: d.update(logits_bytes=6),  # not whole float32 values
        lambda d: d.update(logits_bytes="388"),
        lambda d: d.update(logits_bytes=True),
    ],
)
def test_malformed_logits_sizes_are_corrupt(edit) -> None:
    assert reason_of(_reheader(pack(IDENTITY, TOKENS, PAYLOAD, logits=LOGITS), edit)) == "corrupt"


def test_the_writer_refuses_logits_the_reader_would_refuse() -> None:
    for bad in (b"", b"abc", np.zeros(kv_identity.MAX_LOGITS_BYTES // 4 + 1, dtype="<f4")):
        with pytest.raises(ValueError, match="float32"):
            pack(IDENTITY, TOKENS, PAYLOAD, logits=bad)


def test_a_flipped_payload_bit_anywhere_is_corrupt() -> None:
    data = pack(IDENTITY, TOKENS, PAYLOAD)
    for i in (len(data) - len(PAYLOAD), len(data) - len(PAYLOAD) // 2, len(data) - 1):
        assert reason_of(data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1 :]) == "corrupt"


def test_caps_are_checked_before_the_body_is_needed() -> None:
    # A header that declares a huge payload is refused from the header alone (no allocation of that size).
    huge = _reheader(SMALL, lambda d: d.update(payload_bytes=kv_identity.DEFAULT_MAX_PAYLOAD_BYTES + 1))
    assert reason_of(huge[: 12 + struct.unpack_from("<8sI", huge)[1] + 32]) == "corrupt"
    # the caller's own cap applies too
    with pytest.raises(StateMismatchError) as info:
        unpack(pack(IDENTITY, TOKENS, PAYLOAD), IDENTITY, max_payload_bytes=len(PAYLOAD) - 1)
    assert info.value.reason == "corrupt"
    # a declared header length above the cap
    assert reason_of(struct.pack("<8sI", kv_identity.MAGIC, kv_identity.MAX_HEADER_BYTES + 1) + b"{}") == "corrupt"
    assert reason_of(struct.pack("<8sI", kv_identity.MAGIC, 0)) == "corrupt"


def test_the_writer_refuses_what_the_reader_would() -> None:
    with pytest.raises(ValueError):
        pack(IDENTITY, [2**31], b"x")
    with pytest.raises(ValueError):
        pack(IDENTITY, [0] * (kv_identity.MAX_TOKENS + 1), b"x")


def test_truncation_at_every_offset_is_truncated() -> None:
    for cut in range(len(SMALL)):
        assert reason_of(SMALL[:cut]) == "truncated", cut


def test_trailing_bytes_and_every_flipped_byte_are_refused() -> None:
    assert reason_of(SMALL + b"\0") == "corrupt"
    for i in range(len(SMALL)):
        flipped = bytearray(SMALL)
        flipped[i] ^= 0x5A
        # the 4 length bytes can turn a flip into "ends early"; everything else is a checksum or magic failure
        assert reason_of(bytes(flipped)) in ("corrupt", "truncated"), i


def test_not_bytes_is_corrupt() -> None:
    with pytest.raises(StateMismatchError) as info:
        unpack("text", IDENTITY)  # type: ignore[arg-type]
    assert info.value.reason == "corrupt"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_fuzzed_bytes_raise_only_the_typed_error(data: bytes) -> None:
    try:
        unpack(data, IDENTITY)
    except StateMismatchError as exc:
        assert exc.reason in kv_identity.REASONS
    else:  # pragma: no cover - a random valid file would need a SHA-256 preimage
        pytest.fail("random bytes were accepted")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(SMALL) - 1), st.binary(min_size=1, max_size=8), st.booleans())
def test_fuzzed_edits_of_a_valid_file_raise_only_the_typed_error(at: int, patch: bytes, insert: bool) -> None:
    data = SMALL[:at] + patch + SMALL[at + (0 if insert else len(patch)) :]
    if data == SMALL:
        return
    with pytest.raises(StateMismatchError) as info:
        unpack(data, IDENTITY)
    assert info.value.reason in kv_identity.REASONS


def test_read_file_checks_the_header_first(tmp_path: Path) -> None:
    path = tmp_path / "state.kv"
    write_atomic(path, pack(IDENTITY, TOKENS, PAYLOAD, meta=[1]))
    out = read_file(path, IDENTITY)
    assert (out.tokens, out.payload, out.meta) == (TOKENS, PAYLOAD, [1])
    foreign = dataclasses.replace(IDENTITY, model_sha256="f" * 64)
    with pytest.raises(StateMismatchError) as info:
        read_file(path, foreign)
    assert info.value.reason == "foreign_model"
    data = path.read_bytes()
    for cut in (0, 5, 12, 40, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(StateMismatchError) as info:
            read_file(path, IDENTITY)
        assert info.value.reason == "truncated", cut
    path.write_bytes(data + b"junk")
    with pytest.raises(StateMismatchError) as info:
        read_file(path, IDENTITY)
    assert info.value.reason == "corrupt"
    with pytest.raises(FileNotFoundError):
        read_file(tmp_path / "missing.kv", IDENTITY)


def test_write_atomic_replaces_whole_files_and_leaves_no_temporaries(tmp_path: Path) -> None:
    path = tmp_path / "x.kv"
    write_atomic(path, b"old")
    write_atomic(path, b"new contents")
    assert path.read_bytes() == b"new contents"
    assert [p.name for p in tmp_path.iterdir()] == ["x.kv"]
    with pytest.raises(OSError):
        write_atomic(tmp_path / "no-such-dir" / "x.kv", b"data")


def test_write_atomic_failure_removes_the_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_identity.os, "fsync", full_disk)
    with pytest.raises(OSError):
        write_atomic(tmp_path / "x.kv", b"data")
    assert list(tmp_path.iterdir()) == []


def _writer(path: str, seed: int, rounds: int) -> None:
    data = pack(dataclasses.replace(IDENTITY, n_ctx=seed), list(range(seed)), bytes([seed]) * (50_000 + seed))
    for _ in range(rounds):
        write_atomic(path, data)


def test_two_processes_writing_one_path_leave_one_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "shared.kv"
    # Child processes by subprocess, not multiprocessing: an IPython shell an earlier test made replaces
    # __main__ with a module spawn cannot re-import.
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_kv_identity import _writer; " \
           "_writer(sys.argv[1], int(sys.argv[2]), 40)"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), str(seed)]) for seed in (3, 5)]
    seen = set()
    while any(p.poll() is None for p in procs):
        if path.exists():
            data = path.read_bytes()
            n_ctx = json.loads(data[12 : 12 + struct.unpack_from("<8sI", data)[1]])["identity"]["n_ctx"]
            tokens, payload = unpack(data, dataclasses.replace(IDENTITY, n_ctx=n_ctx))  # never a torn file
            assert payload == bytes([n_ctx]) * (50_000 + n_ctx) and tokens == tuple(range(n_ctx))
            seen.add(n_ctx)
    for p in procs:
        assert p.wait(timeout=120) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.kv"]
    data = path.read_bytes()
    assert any(unpack_ok(data, seed) for seed in (3, 5))


def unpack_ok(data: bytes, seed: int) -> bool:
    try:
        return unpack(data, dataclasses.replace(IDENTITY, n_ctx=seed)) == (tuple(range(seed)), bytes([seed]) * (50_000 + seed))
    except StateMismatchError:
        return False


# -- the engine's per-sequence state, against a cold run ---------------------------------------------------
def _prefill(ctx: _engine.NativeContext, batch: _engine.Batch, tokens: list[int], start: int) -> None:
    batch.clear()
    for i, t in enumerate(tokens):
        batch.add(t, start + i)
    assert ctx.decode(batch) == 0


def _next_logits(ctx: _engine.NativeContext, batch: _engine.Batch, token: int, pos: int) -> np.ndarray:
    batch.clear()
    batch.add(token, pos, logits=True)
    assert ctx.decode(batch) == 0
    return ctx.logits(0).copy()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_seq_state_round_trip_gives_the_cold_logits(fixture_models: dict, one_thread, family: str) -> None:
    model = _engine.NativeModel(str(fixture_models[family]))
    params = _engine.ContextParams(n_ctx=256, n_batch=64, n_ubatch=64)
    batch = _engine.Batch(64)
    contexts: list[_engine.NativeContext] = []
    try:
        tokens = model.tokenize("the quick brown fox jumps over the lazy dog " * 8)[:90]
        assert len(tokens) == 90
        cold = _engine.NativeContext(model, params)
        warm = _engine.NativeContext(model, params)
        restored = _engine.NativeContext(model, params)
        contexts += [cold, warm, restored]
        # the oracle: the same tokens evaluated in the same batches, no state involved
        _prefill(cold, batch, tokens[:60], 0)
        _prefill(cold, batch, tokens[60:89], 60)
        want = _next_logits(cold, batch, tokens[89], 89)

        _prefill(warm, batch, tokens[:60], 0)
        _prefill(warm, batch, tokens[60:89], 60)
        state = warm.seq_state_bytes(0)
        assert len(state) > 0
        identity = KVIdentity.for_context(warm, model_sha256="m" * 64, adapter_sha256=None, build=_engine.engine_build())
        assert identity.n_swa == model.n_swa and identity.partial_reuse == (family == "llama")
        tokens_back, payload = unpack(pack(identity, tokens[:89], state), identity)
        assert tokens_back == tuple(tokens[:89]) and payload == state

        restored.clear()
        assert restored.seq_state_load(0, payload) == len(state)
        assert restored.seq_pos_max(0) == 88
        got = _next_logits(restored, batch, tokens[89], 89)
        np.testing.assert_array_equal(got, want)
        # the uncleared context continues to the same logits as well
        np.testing.assert_array_equal(_next_logits(warm, batch, tokens[89], 89), want)

        # Trimming a restored state: a model without a window keeps every position; a sliding-window
        # state holds only its last window (measured: with or without swa_full), so a trim is refused.
        restored.clear()
        restored.seq_state_load(0, payload)
        if identity.partial_reuse:
            assert restored.seq_pos_min(0) == 0 and restored.trim(0, 50)
            identity.check_reuse(89, 50)
            oracle = _engine.NativeContext(model, params)
            contexts.append(oracle)
            _prefill(oracle, batch, tokens[:50], 0)
            np.testing.assert_array_equal(
                _next_logits(restored, batch, tokens[50], 50), _next_logits(oracle, batch, tokens[50], 50)
            )
        else:
            assert restored.seq_pos_min(0) == 89 - model.n_swa
            assert not restored.trim(0, 50)
            for keep in (50, 87):
                with pytest.raises(StateMismatchError) as info:
                    identity.check_reuse(89, keep)
                assert info.value.reason == "sliding_window"
        identity.check_reuse(89, 89)
        identity.check_reuse(89, 88)
        restored.clear()
        restored.seq_state_load(0, payload)
        assert identity.restored_ok(89, restored.seq_pos_min(0), restored.seq_pos_max(0))
        assert not identity.restored_ok(90, restored.seq_pos_min(0), restored.seq_pos_max(0))

        # Replaying the last token (a fully cached prompt) on a restored state: the cold logits of that position.
        oracle = _engine.NativeContext(model, params)
        contexts.append(oracle)
        _prefill(oracle, batch, tokens[:60], 0)
        _prefill(oracle, batch, tokens[60:88], 60)
        replay_want = _next_logits(oracle, batch, tokens[88], 88)
        for keep, exact in ((88, True), (87, identity.partial_reuse)):
            restored.clear()
            restored.seq_state_load(0, payload)
            assert restored.seq_rm(0, keep, -1) and restored.seq_pos_max(0) == keep - 1
            if keep < 88:
                _prefill(restored, batch, tokens[keep:88], keep)
            got = _next_logits(restored, batch, tokens[88], 88)
            # below the last token a sliding-window state has lost cells its window needs: llama.cpp's
            # removal succeeds, yet the logits differ (what check_reuse refuses)
            assert np.array_equal(got, replay_want) == exact, keep
    finally:
        for ctx in contexts:
            ctx.free()
        batch.free()
        model.free()


def test_a_full_swa_cache_keeps_a_sequence_state_untrimmable_but_a_state_of_all_cells_trimmable(
    fixture_models: dict, one_thread
) -> None:
    """llama.cpp's per-sequence state of a sliding-window model drops the cells outside the last window
    even from a full SWA cache, so it cannot be cut below it; the state of every cell (``all_cells``) puts
    each cell back in its own cell, so a restored prefix cut anywhere continues with the logits of the
    context that was saved, trimmed live as far."""
    model = _engine.NativeModel(str(fixture_models["gemma3"]))
    batch = _engine.Batch(64)
    contexts = []
    try:
        params = _engine.ContextParams(n_ctx=256, n_batch=64, n_ubatch=64, swa_full=True)
        whole_params = dataclasses.replace(params, saves_all_cells=True)  # nothing llama.cpp computes changes
        tokens = model.tokenize("the quick brown fox jumps over the lazy dog " * 8)[:90]
        live, restored = _engine.NativeContext(model, params), _engine.NativeContext(model, params)
        source, whole = (_engine.NativeContext(model, whole_params) for _ in range(2))
        contexts += [live, restored, source, whole]
        for ctx in (live, source):  # the same tokens in the same batches
            _prefill(ctx, batch, tokens[:60], 0)
            _prefill(ctx, batch, tokens[60:89], 60)
        assert live.seq_pos_min(0) == 0  # the live full-size cache still has every position
        restored.seq_state_load(0, live.seq_state_bytes(0))
        assert restored.seq_pos_min(0) == 89 - model.n_swa and not restored.trim(0, 50)
        identity = KVIdentity.for_context(restored, model_sha256="m" * 64, adapter_sha256=None, build="b")
        assert identity.swa_full and identity.state == "sequence" and not identity.partial_reuse
        identity = KVIdentity.for_context(whole, model_sha256="m" * 64, adapter_sha256=None, build="b")
        assert identity.swa_full and identity.state == "all_cells" and identity.partial_reuse
        state = source.seq_state_bytes(0)
        assert len(state) > len(live.seq_state_bytes(0))  # the cells the window no longer sees are in it
        for keep in (89, 70, 50, 31):
            whole.seq_rm(0, 0, -1)
            assert whole.seq_state_load(0, state) == len(state)
            assert (whole.seq_pos_min(0), whole.seq_pos_max(0)) == (0, 88) and whole.trim(0, keep)
            assert live.trim(0, keep)  # the oracle: the evaluated context itself, cut as far
            for pos in range(keep, 89):
                got, want = _next_logits(whole, batch, tokens[pos], pos), _next_logits(live, batch, tokens[pos], pos)
                assert np.array_equal(got, want), (keep, pos)
        with pytest.raises(EngineError, match="sequence 0 only"):
            whole.seq_state_size(1)
        with pytest.raises(EngineError, match="one sequence"):
            _engine.NativeContext(model, dataclasses.replace(whole_params, n_seq_max=2))
    finally:
        for ctx in contexts:
            ctx.free()
        batch.free()
        model.free()


def test_seq_state_load_refuses_garbage(fixture_models: dict, one_thread) -> None:
    model = _engine.NativeModel(str(fixture_models["llama"]))
    ctx = _engine.NativeContext(model, _engine.ContextParams(n_ctx=64, n_batch=32, n_ubatch=32))
    try:
        for garbage in (b"", b"\xff" * 64, b"\x01\x00\x00\x00"):
            with pytest.raises(EngineError):
                ctx.seq_state_load(0, garbage)
            assert ctx.seq_pos_max(0) == -1
    finally:
        ctx.free()
        model.free()


# -- the demo Gemma (sliding window 512): a 1,600-token prefix restored, with today's latency-context settings --
def _prefill_chunks(ctx: _engine.NativeContext, batch: _engine.Batch, tokens: list[int], start: int = 0) -> None:
    for at in range(0, len(tokens), batch.capacity):
        _prefill(ctx, batch, tokens[at : at + batch.capacity], start + at)


def _greedy(ctx: _engine.NativeContext, batch: _engine.Batch, tokens: list[int], start: int, n: int) -> list[int]:
    """Evaluate ``tokens`` from ``start`` (the last one with logits), then ``n`` greedy tokens."""
    _prefill_chunks(ctx, batch, tokens[:-1], start)
    out = [int(np.argmax(_next_logits(ctx, batch, tokens[-1], start + len(tokens) - 1)))]
    while len(out) < n:
        out.append(int(np.argmax(_next_logits(ctx, batch, out[-1], start + len(tokens) + len(out) - 1))))
    return out


@pytest.mark.demo
@pytest.mark.parametrize("swa_full", [False, True])
def test_gemma_prefix_restored_past_the_window_gives_the_cold_greedy_output(one_thread, swa_full: bool) -> None:
    from aner_nb.demo_model import gemma_model_path

    model = _engine.NativeModel(str(gemma_model_path()))
    params = _engine.ContextParams(n_ctx=4096, n_batch=512, n_ubatch=128, swa_full=swa_full, saves_all_cells=swa_full)
    batch = _engine.Batch(512)
    contexts: list[_engine.NativeContext] = []
    try:
        assert model.n_swa == 512
        ledger = " ".join(f"Entry {i}: account {i * 37 % 101} paid {i * 13 % 97} units." for i in range(160))
        prefix = model.tokenize(f"<start_of_turn>user\nLedger: {ledger}", add_special=True)[:1600]
        question = model.tokenize(" Which account paid the most?<end_of_turn>\n<start_of_turn>model\n")
        assert len(prefix) == 1600
        cold, warm, restored = (_engine.NativeContext(model, params) for _ in range(3))
        contexts += [cold, warm, restored]
        # the oracle: prefix then question, cold; the stored prefix: the same prefix in the same batches
        _prefill_chunks(cold, batch, prefix)
        want = _greedy(cold, batch, question, len(prefix), 8)
        _prefill_chunks(warm, batch, prefix)
        identity = KVIdentity.for_context(warm, model_sha256="g" * 64, adapter_sha256=None, build=_engine.engine_build())
        # with swa_full a one-sequence context saves every cell; without, a sequence's (the window's) cells
        whole = identity.state == "all_cells"
        assert whole == swa_full
        data = pack(identity, prefix, warm.seq_state_bytes(0))
        tokens, payload = unpack(data, identity)
        assert tokens == tuple(prefix) and identity.partial_reuse == swa_full
        assert identity.min_keep(1600) == (0 if swa_full else 1599)

        restored.seq_state_load(0, payload)
        assert identity.restored_ok(1600, restored.seq_pos_min(0), restored.seq_pos_max(0))
        assert restored.seq_pos_min(0) == (0 if swa_full else 1600 - 512)  # a sequence's state: the window's cells
        assert _greedy(restored, batch, question, len(prefix), 8) == want  # continued from the saved end

        # A prompt equal to the stored prefix replays its last token (keep 1599): the oracle is the live
        # context that wrote the state doing the same (a prefix-cache hit today). A cold run of 1,599 tokens
        # batches its last chunk differently (63 rows, not 64): its logits differ in the last bits, and on
        # this ledger its top two tokens are that close with swa_full, so no cold token is compared here.
        assert warm.seq_rm(0, 1599, -1)
        replay_want = _next_logits(warm, batch, prefix[-1], 1599)
        restored.clear()
        restored.seq_state_load(0, payload)
        identity.check_reuse(1600, 1599)
        assert restored.seq_rm(0, 1599, -1) and restored.seq_pos_max(0) == 1598
        got = _next_logits(restored, batch, prefix[-1], 1599)
        np.testing.assert_array_equal(got, replay_want)
        if whole:  # cut far below the window: the same cells as the live context cut as far
            restored.clear()
            restored.seq_state_load(0, payload)
            identity.check_reuse(1600, 700)
            assert restored.trim(0, 700) and warm.trim(0, 700)
            for pos in range(700, 708):
                got, want_row = _next_logits(restored, batch, prefix[pos], pos), _next_logits(warm, batch, prefix[pos], pos)
                np.testing.assert_array_equal(got, want_row)
    finally:
        for ctx in contexts:
            ctx.free()
        batch.free()
        model.free()


def test_engine_build_names_the_binding_and_ggml() -> None:
    import llama_cpp

    build = _engine.engine_build()
    assert build.startswith(f"llama-cpp-python {llama_cpp.__version__}; version ") and "; commit " in build
    assert "?" not in build and _engine.engine_build() is build


@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=40),
    payload=st.binary(min_size=1, max_size=3000),
    short=st.integers(0, 1200),
)
def test_pack_in_place_writes_the_bytes_pack_writes(tokens, payload, short):
    """The in-place packer (one buffer, the state copied straight into it) against ``pack``, the oracle,
    including a copy that writes fewer bytes than it was given room for (a payload size with fewer digits)."""
    def fill(view: memoryview) -> int:
        view[: len(payload)] = payload
        return len(payload)

    size = len(payload) + short  # llama.cpp's size may exceed what it then copies
    blob = kv_identity.pack_in_place(IDENTITY, tokens, size, fill)
    assert isinstance(blob, bytearray) and bytes(blob) == pack(IDENTITY, tokens, payload)
    assert unpack(blob, IDENTITY) == (tuple(tokens), memoryview(payload))


def test_pack_in_place_refuses_a_copy_of_nothing_or_too_much():
    with pytest.raises(ValueError, match="wrote 0 of 8"):
        kv_identity.pack_in_place(IDENTITY, [1], 8, lambda view: 0)
    with pytest.raises(ValueError, match="wrote 9 of 8"):
        kv_identity.pack_in_place(IDENTITY, [1], 8, lambda view: 9)
    with pytest.raises(ValueError, match="exceed"):
        kv_identity.pack_in_place(IDENTITY, [1] * (kv_identity.MAX_TOKENS + 1), 8, lambda view: 8)


def test_cache_files_are_written_atomically_without_fsync_and_saved_sessions_with_it(tmp_path, monkeypatch) -> None:
    """The prefix tiers' files skip fsync (a torn file fails its checks; durability is not worth a
    writeback per retained prompt); ``write_atomic`` itself, which ``session.save`` uses, syncs the file
    and its directory. Either way no temporary file is left and the content is whole."""
    import os

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    kv_identity.write_cache_file(tmp_path / "a.kv", SMALL)
    assert synced == [] and (tmp_path / "a.kv").read_bytes() == SMALL
    kv_identity.write_atomic(tmp_path / "b.kv", SMALL)
    assert len(synced) == 2 and (tmp_path / "b.kv").read_bytes() == SMALL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.kv", "b.kv"]


# Another program copies a shorter file over the state file, in place, after the reader opened and sized it and
# before the body is checked: a mapped body is then pages past the end of the file (SIGBUS on access), a read
# body is the reader's own copy.
CUT_SHORT = """
import os
from aner_nb.llm import kv_identity as kv
real = kv._finish


def cut_short_then_finish(header, body, total):
    os.truncate(CUT_PATH, 4096)
    return real(header, body, total)


kv._finish = cut_short_then_finish
"""

RACE = r"""
import sys
from aner_nb.llm import kv_identity as kv
from test_kv_identity import IDENTITY
CUT_PATH, mapped = sys.argv[1], sys.argv[2] == "mapped"
kv.write_atomic(CUT_PATH, kv.pack(IDENTITY, list(range(10)), b"\x01" * (1 << 20)), durable=False)
""" + CUT_SHORT + r"""
got = kv.read_file(CUT_PATH, IDENTITY, mapped=mapped)
print("READ", len(got.payload))
"""


def _child(script: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, env=env)


def test_a_file_cut_short_while_it_is_read_unmapped_keeps_the_readers_copy(tmp_path: Path) -> None:
    """The race, in a child: read into memory the answer is whole; mapped, the process dies of SIGBUS (which is
    why only the tiers' own files, always replaced whole by a rename and never in place, are mapped)."""
    script = tmp_path / "race.py"
    script.write_text(RACE)
    unmapped = _child(script, str(tmp_path / "a.kv"), "read")
    assert unmapped.returncode == 0 and unmapped.stdout.split() == ["READ", str(1 << 20)], unmapped.stderr[-2000:]
    mapped = _child(script, str(tmp_path / "b.kv"), "mapped")
    assert mapped.returncode == -signal.SIGBUS, (mapped.returncode, mapped.stderr[-500:])


SESSION_RACE = r"""
import sys
from aner_nb import llm
model = llm.load(sys.argv[1], context=256, progress=False, warmup=False)
chat = model.session()
first = chat.send("hello", max_tokens=2)
CUT_PATH = str(chat.save(sys.argv[2]))
chat.close()
""" + CUT_SHORT + r"""
resumed = model.session(resume=CUT_PATH)
print("RESUMED", len(resumed.messages))
"""


def test_a_session_file_cut_short_while_it_is_resumed_does_not_take_the_process_down(llama_path, tmp_path) -> None:
    """``session(resume=path)`` names a user's file, which may be copied over in place at any time: it is read,
    not mapped, so the race above leaves the resumed session whole (mapped, it was SIGBUS)."""
    script = tmp_path / "session_race.py"
    script.write_text(SESSION_RACE)
    done = _child(script, str(llama_path), str(tmp_path / "chat.session"))
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["RESUMED", "2"], (done.returncode, done.stderr[-2000:])
