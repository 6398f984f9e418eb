"""Fuzzing the GGUF inspector (issue 18): hostile headers get a typed error, fast, without big allocations.

The files are built byte by byte (``tests/fixtures/raw_gguf.py``) from the
smallest model and adapter headers that ``inspect_model`` / ``inspect_adapter``
accept, then mutated structurally: header counts, key and string lengths,
value and array item types (nested arrays included), array lengths up to
2**64-1, tensor dimensions, types and offsets past the end of the file,
truncation at every offset, byte flips and splices. Every call must return or
raise the documented typed error (:class:`InvalidArtifactError` and its
subclasses for models, :class:`AdapterError` for adapters) within a time
bound; a header claiming an astronomically large array must be refused
without allocating for it; and ``llm.load()`` must never hand a rejected file
to llama.cpp. Hypothesis runs derandomized with fixed example counts, so CI
runs are reproducible; ``fuzz/`` holds the coverage-guided (atheris) targets.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest
from gguf import GGUFReader
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from aner_nb import llm
from aner_nb.llm import _engine
from aner_nb.llm import adapters as adapters_module
from aner_nb.llm.adapters import check_targets, load_adapter, write_manifest
from aner_nb.llm.artifact import AdapterFacts, ModelFacts, inspect_adapter, inspect_model, sha256_file
from aner_nb.llm.errors import AdapterError, InvalidArtifactError, LLMError
from fixtures import raw_gguf as rg
from fixtures.bounds import bounded

MEMORY_BOUND = 16 * 2**20
HUGE = (2**31, 2**32 - 1, 2**32, 2**60, 2**63 - 1, 2**63, 2**64 - 1)

FUZZ = settings(
    max_examples=1000, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def check_inspectors(path: Path) -> tuple[object, object]:
    """The fuzz property: each inspector returns its facts or raises its typed error, in bounded time."""
    model, error = bounded(inspect_model, path)
    if error is not None:
        assert isinstance(error, InvalidArtifactError), f"inspect_model raised {error!r}"
        assert str(path) in str(error) or "GGUF" in str(error)
        model = error
    else:
        assert isinstance(model, ModelFacts) and model.file_size == path.stat().st_size
        assert model.layers >= 1 and model.heads >= 1 and model.vocab_size >= 0
    adapter, error = bounded(inspect_adapter, path)
    if error is not None:
        assert isinstance(error, AdapterError), f"inspect_adapter raised {error!r}"
        adapter = error
    else:
        assert isinstance(adapter, AdapterFacts) and adapter.pairs
    return model, adapter


# ----------------------------------------------------------------------------- strategies

u64 = st.one_of(st.sampled_from((0, 1, 7, 8, 64, 1000, *HUGE)), st.integers(0, 2**64 - 1))
u32 = st.one_of(st.integers(0, 16), st.sampled_from((41, 2**31, 2**32 - 1)), st.integers(0, 2**32 - 1))
value_type = st.one_of(st.integers(0, 13), u32)


@st.composite
def array_payload(draw, depth: int = 0) -> bytes:
    """An array's item type, declared count and some elements; item arrays nest up to 3 deep."""
    item = draw(value_type)
    count = draw(st.one_of(st.integers(0, 6), u64))
    if item == rg.ARRAY and depth < 3:
        items = b"".join(draw(st.lists(array_payload(depth + 1), max_size=3)))
    elif item == rg.STRING:
        items = b"".join(rg.string(s, draw(st.one_of(st.none(), u64)))
                         for s in draw(st.lists(st.binary(max_size=8), max_size=4)))
    else:
        items = draw(st.binary(max_size=48))
    return struct.pack("<IQ", item, count) + items


@st.composite
def value_payload(draw, vtype: int) -> bytes:
    if vtype == rg.STRING:
        return rg.string(draw(st.binary(max_size=16)), draw(st.one_of(st.none(), u64)))
    if vtype == rg.ARRAY:
        return draw(array_payload())
    return draw(st.binary(max_size=12))  # right-sized scalars, short ones and junk


@st.composite
def mutated_layout(
    draw, bases: tuple[rg.Layout, ...] = (rg.minimal_model(), rg.minimal_adapter()), fewest: int = 1
) -> rg.Layout:
    """The minimal model or adapter with ``fewest``..4 structural mutations."""
    lay = draw(st.sampled_from(bases))
    kvs, tensors = list(lay.kvs), list(lay.tensors)
    for _ in range(draw(st.integers(fewest, 4))):
        what = draw(st.sampled_from((
            "n_kv", "n_tensors", "version", "key_length", "value_type", "value", "new_kv", "duplicate_kv",
            "alignment", "n_dims", "dims", "ggml_type", "offset", "tensor_name", "duplicate_tensor",
            "data", "tail",
        )))
        i = draw(st.integers(0, len(kvs) - 1)) if kvs else 0
        j = draw(st.integers(0, len(tensors) - 1)) if tensors else 0
        if what == "n_kv":
            lay = dataclasses.replace(lay, n_kv=draw(st.one_of(st.integers(0, len(kvs) + 3), u64)))
        elif what == "n_tensors":
            lay = dataclasses.replace(lay, n_tensors=draw(st.one_of(st.integers(0, len(tensors) + 3), u64)))
        elif what == "version":
            lay = dataclasses.replace(lay, version=draw(st.one_of(st.sampled_from((1, 2, 3, 4)), u32)))
        elif what == "key_length" and kvs:
            kvs[i] = dataclasses.replace(kvs[i], key_length=draw(u64))
        elif what == "value_type" and kvs:
            kvs[i] = dataclasses.replace(kvs[i], vtype=draw(value_type))
        elif what == "value" and kvs:
            kvs[i] = dataclasses.replace(kvs[i], payload=draw(value_payload(kvs[i].vtype)))
        elif what == "new_kv":
            vtype = draw(value_type)
            key = draw(st.sampled_from((b"general.alignment", b"general.type", b"split.count", b"split.no",
                                        b"tokenizer.ggml.tokens", b"llama.block_count", b"adapter.lora.alpha",
                                        b"tokenizer.chat_template", b"llama.attention.sliding_window")))
            kvs.insert(i, rg.KV(draw(st.one_of(st.just(key), st.binary(max_size=12))), vtype,
                                draw(value_payload(vtype))))
        elif what == "duplicate_kv" and kvs:
            kvs.append(kvs[i])
        elif what == "alignment":
            kvs.append(rg.KV(b"general.alignment", draw(value_type), struct.pack("<Q", draw(u64))[:draw(st.integers(0, 8))]))
        elif what == "n_dims" and tensors:
            tensors[j] = dataclasses.replace(tensors[j], n_dims=draw(st.one_of(st.integers(0, 8), u32)))
        elif what == "dims" and tensors:
            tensors[j] = dataclasses.replace(tensors[j], dims=tuple(draw(st.lists(u64, min_size=1, max_size=5))))
        elif what == "ggml_type" and tensors:
            tensors[j] = dataclasses.replace(tensors[j], ggml_type=draw(u32))
        elif what == "offset" and tensors:
            tensors[j] = dataclasses.replace(tensors[j], offset=draw(u64))
        elif what == "tensor_name" and tensors:
            tensors[j] = dataclasses.replace(tensors[j], name=draw(st.binary(max_size=80)))
        elif what == "duplicate_tensor" and tensors:
            tensors.append(tensors[j])
        elif what == "data":
            lay = dataclasses.replace(lay, data=lay.data[: draw(st.integers(0, len(lay.data)))])
        elif what == "tail":
            lay = dataclasses.replace(lay, tail=draw(st.binary(max_size=64)))
    return dataclasses.replace(lay, kvs=tuple(kvs), tensors=tuple(tensors))


# ------------------------------------------------------------------------------ the seeds


@pytest.mark.parametrize("layout, inspect", [(rg.minimal_model, inspect_model), (rg.minimal_adapter, inspect_adapter)])
def test_seed_files_are_accepted_and_read_alike_by_gguf(tmp_path, layout, inspect):
    """The fuzzing starts from files both this inspector and gguf's own reader accept."""
    path = tmp_path / "seed.gguf"
    path.write_bytes(rg.build(layout()))
    facts = inspect(path)
    reader = GGUFReader(path)
    assert {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors} == dict(
        facts.tensors if isinstance(facts, ModelFacts) else
        [(n + s, d) for n, a, b in facts.pairs for s, d in ((".lora_a", a), (".lora_b", b))]
    )
    assert facts.tensor_bytes == sum(int(t.n_bytes) for t in reader.tensors)


# ------------------------------------------------------------------------------ properties


@FUZZ
@given(layout=mutated_layout())
def test_structural_mutations_raise_only_typed_errors(tmp_path, layout):
    path = tmp_path / "mutated.gguf"
    path.write_bytes(rg.build(layout))
    check_inspectors(path)


@FUZZ
@given(seed=st.sampled_from(("model", "adapter")), data=st.data())
def test_byte_flips_and_splices_raise_only_typed_errors(tmp_path, seed, data):
    raw = bytearray(rg.build(rg.minimal_model() if seed == "model" else rg.minimal_adapter()))
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        op = data.draw(st.sampled_from(("flip", "set", "insert", "delete", "u64")))
        if op == "flip":
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            raw[pos] = data.draw(st.integers(0, 255))
        elif op == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del raw[pos : pos + data.draw(st.integers(1, 16))]
        else:  # overwrite a (possible) length or count field with an edge value
            raw[pos : pos + 8] = struct.pack("<Q", data.draw(st.sampled_from(HUGE)))
    path = tmp_path / "flipped.gguf"
    path.write_bytes(bytes(raw))
    check_inspectors(path)


@pytest.mark.parametrize("layout", [rg.minimal_model, rg.minimal_adapter])
def test_truncation_at_every_offset_is_a_typed_error(tmp_path, layout):
    raw = rg.build(layout())
    path = tmp_path / "cut.gguf"
    for cut in range(len(raw)):
        path.write_bytes(raw[:cut])
        model, adapter = check_inspectors(path)
        assert isinstance(model, InvalidArtifactError) and isinstance(adapter, AdapterError), cut


# ------------------------------------------------------------------- huge claims, no allocation


def _claims(value: int) -> dict[str, rg.Layout]:
    """The minimal model with one size field claiming ``value``, each in turn."""
    m = rg.minimal_model()
    kvs, t = list(m.kvs), m.tensors[0]

    def with_kv(index: int, kv: rg.KV) -> rg.Layout:
        return dataclasses.replace(m, kvs=(*kvs[:index], kv, *kvs[index + 1:]))

    tokens = kvs.index(next(k for k in kvs if k.key == b"tokenizer.ggml.tokens"))
    return {
        "n_kv": dataclasses.replace(m, n_kv=value),
        "n_tensors": dataclasses.replace(m, n_tensors=value),
        "key_length": with_kv(0, dataclasses.replace(kvs[0], key_length=value)),
        "string_length": with_kv(1, rg.KV(b"general.name", rg.STRING, rg.string(b"x", value))),
        "u8_array": with_kv(tokens, rg.kv_array("tokenizer.ggml.tokens", rg.U8, bytes(64), value)),
        "f64_array": with_kv(tokens, rg.kv_array("tokenizer.ggml.scores", rg.F64, bytes(64), value)),
        "string_array": with_kv(tokens, rg.kv_array("tokenizer.ggml.tokens", rg.STRING, bytes(64), value)),
        "string_in_array": with_kv(tokens, rg.kv_array("tokenizer.ggml.tokens", rg.STRING,
                                                       rg.string(b"a") + rg.string(b"b", value), 2)),
        "nested_array": with_kv(tokens, rg.kv_array("tokenizer.ggml.tokens", rg.ARRAY,
                                                    struct.pack("<IQ", rg.U8, value), value)),
        "n_dims": dataclasses.replace(m, tensors=(dataclasses.replace(t, n_dims=value & 0xFFFFFFFF),)),
        "dims": dataclasses.replace(m, tensors=(dataclasses.replace(t, dims=(32, value)),)),
        "offset": dataclasses.replace(m, tensors=(dataclasses.replace(t, offset=value),)),
    }


@pytest.mark.parametrize("value", [2**60, 2**64 - 1])
@pytest.mark.parametrize("site", list(_claims(1)))
def test_huge_claims_are_refused_without_allocating(tmp_path, site, value):
    """A header claiming a 2**60-element array (or key, string, count...) is refused, not allocated."""
    path = tmp_path / f"{site}.gguf"
    path.write_bytes(rg.build(_claims(value)[site]) + bytes(2**20))  # a megabyte to run into
    tracemalloc.start()
    try:
        _, error = bounded(inspect_model, path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(error, InvalidArtifactError), error
    assert peak < MEMORY_BOUND, f"{site}: {peak} bytes traced"


def _many_kvs(n: int) -> bytes:
    """The minimal model plus ``n`` distinct metadata entries (a 7-digit key and a u8: 20 bytes each)."""
    m = rg.minimal_model()
    entry = struct.Struct("<Q7sIB")
    blob = b"".join(entry.pack(7, b"%07d" % i, rg.U8, 0) for i in range(n))
    return rg.build(dataclasses.replace(m, n_kv=len(m.kvs) + n, kv_blob=blob))


def test_huge_honest_headers_are_bounded_in_time_and_memory(tmp_path):
    """Counts that fit the file still cannot make one call slow or big: the header's size is capped."""
    cases = {
        # 1.5 million distinct entries, 30 MB of header
        "kv_count": _many_kvs(1_500_000),
        # eight million empty strings in one array, 64 MB
        "string_array": rg.build(dataclasses.replace(rg.minimal_model(), kvs=(
            *rg.MODEL_KVS, rg.kv_array("tokenizer.ggml.merges", rg.STRING, bytes(8 * 8_000_000), 8_000_000)))),
        # a 40 MB metadata string
        "long_string": rg.build(dataclasses.replace(rg.minimal_model(), kvs=(
            *rg.MODEL_KVS, rg.kv_string("tokenizer.huggingface.json", "x" * 40_000_000)))),
    }
    for site, raw in cases.items():
        path = tmp_path / f"{site}.gguf"
        path.write_bytes(raw)
        del raw
        tracemalloc.start()
        try:
            _, error = bounded(inspect_model, path, seconds=10)  # generous: tracemalloc slows Python down
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert error is None or isinstance(error, InvalidArtifactError), f"{site}: {error!r}"
        assert peak < MEMORY_BOUND, f"{site}: {peak} bytes traced"
        bounded(inspect_model, path)  # untraced: the time bound itself
        path.unlink()


# ------------------------------------------------------------- llama.cpp never sees a rejected file


@pytest.fixture
def engine_calls(monkeypatch):
    """Record every attempt to hand a file to llama.cpp (the native load refuses to run)."""
    calls: list[str] = []

    class Refused(Exception):
        pass

    def native_model(path, **_kwargs):
        calls.append(os.fspath(path))
        raise Refused(path)

    monkeypatch.setattr(_engine, "NativeModel", native_model)
    lib = _engine._llama()
    monkeypatch.setattr(lib, "llama_model_load_from_file", lambda path, *a: calls.append(path) or None)
    return calls, Refused


def _rejected_files(tmp_path: Path) -> dict[str, Path]:
    m = rg.minimal_model()
    t = m.tensors[0]
    files = {
        "huge_kv_count": dataclasses.replace(m, n_kv=2**60),
        "huge_array": dataclasses.replace(m, kvs=(*m.kvs, rg.kv_array("x", rg.F32, b"", 2**60))),
        "nested_array": dataclasses.replace(m, kvs=(*m.kvs, rg.kv_array("x", rg.ARRAY, struct.pack("<IQ", rg.U8, 0), 1))),
        "bad_value_type": dataclasses.replace(m, kvs=(*m.kvs, rg.KV(b"x", 13, b""))),
        "string_past_end": dataclasses.replace(m, kvs=(*m.kvs, rg.KV(b"x", rg.STRING, rg.string(b"x", 2**40)))),
        "offset_past_end": dataclasses.replace(m, tensors=(dataclasses.replace(t, offset=2**20),)),
        "dims_past_end": dataclasses.replace(m, tensors=(dataclasses.replace(t, dims=(8, 2**40)),)),
        "unknown_ggml_type": dataclasses.replace(m, tensors=(dataclasses.replace(t, ggml_type=2**31),)),
        "truncated": dataclasses.replace(m, data=m.data[:-1]),
        "adapter": rg.minimal_adapter(),
    }
    out = {}
    for name, layout in files.items():
        out[name] = tmp_path / f"{name}.gguf"
        out[name].write_bytes(rg.build(layout))
    return out


def test_load_never_hands_a_rejected_file_to_llama_cpp(tmp_path, engine_calls):
    calls, refused = engine_calls
    for name, path in _rejected_files(tmp_path).items():
        with pytest.raises(InvalidArtifactError) as info:
            llm.load(path, context=64, cpu_extra_buffers="off", warmup=False, progress=False)
        assert type(info.value) is type(pytest.raises(InvalidArtifactError, inspect_model, path).value), name
    assert calls == []
    # the seam works: an accepted file does reach the (refused) native load
    good = tmp_path / "good.gguf"
    good.write_bytes(rg.build(rg.minimal_model()))
    with pytest.raises(refused):
        llm.load(good, context=64, cpu_extra_buffers="off", warmup=False, progress=False)
    assert calls == [os.fspath(good)]


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(layout=mutated_layout(bases=(rg.minimal_model(),), fewest=0))
def test_load_of_any_mutated_file_opens_llama_cpp_only_when_the_inspector_accepts(tmp_path, engine_calls, layout):
    calls, refused = engine_calls
    calls.clear()
    path = tmp_path / "mutated.gguf"
    path.write_bytes(rg.build(layout))
    _, error = bounded(inspect_model, path)
    event("model accepted" if error is None else "model rejected")
    try:
        llm.load(path, context=64, cpu_extra_buffers="off", warmup=False, progress=False)
    except refused:
        assert error is None and calls == [os.fspath(path)]
    except LLMError as exc:
        assert calls == []
        if error is not None:
            assert type(exc) is type(error)
    else:
        pytest.fail("the native load was refused, load() cannot have succeeded")
    if error is not None:
        assert calls == []


@pytest.fixture(scope="module")
def base_weights(tmp_path_factory):
    """A stand-in for SharedWeights: the facts and fingerprint of a model with blk.0.attn_q.weight [8, 8]."""
    m = rg.minimal_model()
    m = dataclasses.replace(m, tensors=(*m.tensors, rg.TensorInfo(b"blk.0.attn_q.weight", (8, 8), offset=128)),
                            data=m.data + bytes(256))
    path = tmp_path_factory.mktemp("base") / "base.gguf"
    path.write_bytes(rg.build(m))
    return SimpleNamespace(facts=inspect_model(path), fingerprint=sha256_file(path, progress=False), native=object())


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(layout=mutated_layout(bases=(rg.minimal_adapter(),), fewest=0))
def test_load_adapter_opens_llama_cpp_only_when_every_check_passes(tmp_path, monkeypatch, base_weights, layout):
    """A manifest that names the mutated file by its true hash still cannot get a rejected adapter loaded."""
    calls: list[str] = []

    class Refused(Exception):
        pass

    def native_adapter(model, path):
        calls.append(path)
        raise Refused(path)

    monkeypatch.setattr(adapters_module, "NativeAdapter", native_adapter)
    adapter = tmp_path / "fuzzed.gguf"
    adapter.write_bytes(rg.build(layout))
    manifest = write_manifest(adapter, base_sha256=base_weights.fingerprint, architecture="llama")
    facts, error = bounded(inspect_adapter, adapter)
    if error is None:
        try:
            check_targets(facts, base_weights.facts.tensor_shapes())
            if facts.architecture != "llama":
                error = AdapterError("architecture")
        except AdapterError as exc:
            error = exc
    event("adapter accepted" if error is None else "adapter rejected")
    try:
        load_adapter(base_weights, manifest)
    except Refused:
        assert error is None and calls == [os.path.realpath(adapter)]
    except AdapterError:
        assert error is not None and calls == []
    else:
        pytest.fail("the native load was refused, load_adapter() cannot have succeeded")


# ------------------------------------------------------------------ what the fuzzing found


def _model_with(*extra: rg.KV, arch: str = "llama", tensors=None) -> rg.Layout:
    m = rg.minimal_model()
    kvs = tuple(rg.kv_string("general.architecture", arch) if k.key == b"general.architecture" else
                rg.KV(k.key.replace(b"llama.", arch.encode() + b"."), k.vtype, k.payload) for k in m.kvs)
    replaced = {k.key for k in extra}
    kvs = tuple(k for k in kvs if k.key not in replaced) + extra
    return dataclasses.replace(m, kvs=kvs, tensors=m.tensors if tensors is None else tensors)


FOUND = {
    # split.no was passed to int(): a string raised ValueError, an array TypeError, inf OverflowError
    "split_no_string": (_model_with(rg.kv_u32("split.count", 2), rg.kv_string("split.no", "x")), "a shard"),
    "split_no_array": (_model_with(rg.kv_u32("split.count", 2), rg.kv_array("split.no", rg.U8, b"\1", 1)), "a shard"),
    "split_no_inf": (_model_with(rg.kv_u32("split.count", 2), rg.kv_f32("split.no", float("inf"))), "a shard"),
    # a 2**32-1 block count made the sliding-window layer list take minutes and gigabytes
    "block_count": (_model_with(rg.kv_u32("gemma3.block_count", 2**32 - 1),
                                rg.kv_u32("gemma3.attention.sliding_window", 512), arch="gemma3"), "at most 512"),
    # dimensions llama.cpp reads as negative int64 were admitted when another dimension was 0
    "dims_int64": (_model_with(tensors=(rg.TensorInfo(b"token_embd.weight", (2**64 - 32, 0)),)), "beyond what ggml"),
    # llama.cpp refuses tensor names of GGML_MAX_NAME (64) bytes or more
    "tensor_name": (_model_with(tensors=(rg.TensorInfo(b"t" * 64, (8, 4)),)), "at most 63"),
    "huge_template": (_model_with(rg.kv_string("tokenizer.chat_template", "x" * (2**20 + 1))), "chat_template is"),
}


@pytest.mark.parametrize("case", list(FOUND))
def test_regressions_found_by_fuzzing(tmp_path, case):
    layout, needle = FOUND[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(rg.build(layout))
    _, error = bounded(inspect_model, path)
    assert isinstance(error, InvalidArtifactError), repr(error)
    assert needle in str(error)


def test_long_metadata_strings_are_skipped_not_decoded(tmp_path):
    """An embedded tokenizer.huggingface.json (megabytes) stays in the file; the rest is read as usual."""
    path = tmp_path / "hf-json.gguf"
    path.write_bytes(rg.build(_model_with(rg.kv_string("tokenizer.huggingface.json", "{" + " " * 3_000_000 + "}"))))
    facts = inspect_model(path)
    assert (facts.name, facts.vocab_size, facts.bos_token) == ("fuzz-seed", 4, "<s>")
