"""LoRA adapters with checked manifests (DESIGN.md "Immutable profiles", issue 9).

Real llama.cpp execution on the tiny llama fixture and LoRA GGUFs written by
``fixtures.models.write_lora_adapter``. Every rejection is an ``AdapterError``
whose ``field`` and message name what was wrong, raised before llama.cpp
loads the adapter, with the base lease unaffected.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from fixtures.models import write_lora_adapter, write_not_gguf
from test_parity import greedy_tokens
from aner_nb import llm
from aner_nb.llm import _engine, adapters as adapters_module, errors
from aner_nb.llm.adapters import SCHEMA, check_targets, parse_manifest, write_manifest
from aner_nb.llm.artifact import inspect_adapter

CTX = 256
PROMPT = "hello there"
N = 8


@pytest.fixture(scope="module")
def base(llama_path):
    with llm.load(llama_path, context=CTX) as m:
        yield m


@pytest.fixture(scope="module")
def base_tokens(base):
    return base.generate(PROMPT, max_tokens=N).tokens


def make_manifest(
    folder: Path, base: Any, *, adapter: Path | None = None, fields: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (), name: str = "adapter.gguf", **adapter_kwargs: Any,
) -> Path:
    """Write an adapter (unless ``adapter`` is given) and a correct manifest, then apply the edits."""
    folder.mkdir(parents=True, exist_ok=True)
    if adapter is None:
        adapter = write_lora_adapter(folder / name, **adapter_kwargs)
    data = {
        "schema": SCHEMA,
        "base_sha256": base.fingerprint,
        "adapter_sha256": llm.sha256_file(adapter, progress=False),
        "architecture": base.architecture,
        "adapter_file": adapter.name,
    }
    data.update(fields or {})
    for key in drop:
        del data[key]
    path = folder / "adapter.manifest.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def no_native_load(monkeypatch):
    """Fail the test if llama.cpp is asked to load an adapter."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("llama.cpp was asked to load an adapter that should have been rejected")

    monkeypatch.setattr(adapters_module, "NativeAdapter", refuse)


def assert_base_unaffected(base, base_tokens) -> None:
    assert not base.closed and not base.supports("adapter") and base.adapter is None
    assert base.profile.adapter is None
    assert base._weights.native.live_adapters() == 0
    assert base.generate(PROMPT, max_tokens=N).tokens == base_tokens


# -- outputs ---------------------------------------------------------------------
def test_adapter_changes_greedy_output(base, base_tokens, tmp_path):
    with base.with_adapter(make_manifest(tmp_path, base)) as tuned:
        first = tuned.generate(PROMPT, max_tokens=N)
        assert first.tokens != base_tokens
        assert tuned.generate(PROMPT, max_tokens=N).tokens == first.tokens  # deterministic, pooled context
        assert tuned.fingerprint == base.fingerprint  # the same weights
    assert_base_unaffected(base, base_tokens)


def test_all_zero_adapter_leaves_output_identical(base, base_tokens, tmp_path):
    with base.with_adapter(make_manifest(tmp_path, base, zero=True)) as tuned:
        assert tuned.supports("adapter")
        assert tuned.generate(PROMPT, max_tokens=N).tokens == base_tokens


def test_module_form_and_adapter_info(base, tmp_path):
    manifest = make_manifest(tmp_path, base)
    with llm.with_adapter(base, str(manifest)) as tuned:
        info = tuned.adapter
        assert info.adapter_file == "adapter.gguf" and info.rank == 4 and info.alpha == 8.0
        assert info.base_sha256 == base.fingerprint and info.architecture == "llama"
        assert "blk.0.attn_q.weight" in info.targets and len(info.targets) == 6
        assert tuned.profile.adapter == info.adapter_sha256 and base.profile.adapter is None
        assert f"adapter={info.adapter_sha256[:12]}" in repr(tuned)
        assert str(tmp_path) not in repr(tuned)


# -- an independent oracle: llama-cpp-python's own LoRA path --------------------------------------
def llama_cpp_lora_tokens(model_path, adapter, prompt_tokens, max_tokens, *, n_threads, n_threads_batch):
    """Greedy tokens of ``llama_cpp.Llama(model_path, lora_path=adapter)`` for the same prompt token ids
    and settings as an ordinary lease of this module (context CTX, batch 512 / micro-batch 128, the
    lease's threads, flash attention off, adapter scale 1), as tests/test_parity.py's reference."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(
        model_path=str(model_path), lora_path=str(adapter), lora_scale=1.0, n_ctx=CTX, n_batch=512,
        n_ubatch=128, n_threads=n_threads, n_threads_batch=n_threads_batch, flash_attn=False, swa_full=False,
        n_gpu_layers=0, verbose=False,
    )
    try:
        return greedy_tokens(ref, prompt_tokens, max_tokens)
    finally:
        ref.close()


ORACLE_PROMPTS = ["hello there", "the cat sat on the mat and", "Summarize: apples, pears and plums are fruit."]


def test_adapter_greedy_tokens_equal_llama_cpp_python_with_the_same_lora(llama_path, tmp_path):
    """Not only "differs from the base": the adapter lease, its batching lease and llama-cpp-python's
    ``Llama(lora_path=...)`` give the same greedy tokens for the same prompt token ids and settings."""
    max_tokens = 16
    with llm.load(llama_path, context=CTX, flash_attention="off") as plain_base:
        manifest = make_manifest(tmp_path, plain_base)
        adapter = tmp_path / "adapter.gguf"
        with plain_base.with_adapter(manifest) as tuned, tuned.with_batching(2) as serving:
            for prompt in ORACLE_PROMPTS:
                response = tuned.generate(prompt, max_tokens=max_tokens)
                t = response.timings
                expected = llama_cpp_lora_tokens(
                    llama_path, adapter, tuned.prompt_tokens(prompt), max_tokens,
                    n_threads=t.threads, n_threads_batch=t.prefill_threads,
                )
                assert len(expected) > 4, prompt  # a real comparison, not two empty outputs
                assert list(response.tokens) == expected, prompt
                assert list(plain_base.generate(prompt, max_tokens=max_tokens).tokens) != expected, prompt
                batched = serving.generate(prompt, max_tokens=max_tokens)
                assert batched.timings.threads == t.threads  # the same engine settings as the reference
                assert list(batched.tokens) == expected, prompt
            # two requests sharing the batching lease's steps, each still equal to the oracle
            many = serving.generate_many(ORACLE_PROMPTS[:2], max_tokens=max_tokens)
            for prompt, r in zip(ORACLE_PROMPTS[:2], many):
                assert list(r.tokens) == llama_cpp_lora_tokens(
                    llama_path, adapter, tuned.prompt_tokens(prompt), max_tokens,
                    n_threads=r.timings.threads, n_threads_batch=r.timings.prefill_threads,
                ), prompt


# -- rejections ------------------------------------------------------------------
REJECTIONS = [
    # (id, make_manifest kwargs, field, message needle)
    ("wrong-base-hash", {"fields": {"base_sha256": "0" * 64}}, "base_sha256", "base_sha256"),
    ("wrong-adapter-hash", {"fields": {"adapter_sha256": "f" * 64}}, "adapter_sha256", "adapter_sha256"),
    ("extra-field", {"fields": {"note": "hi"}}, "note", "'note'"),
    ("missing-field", {"drop": ("architecture",)}, "architecture", "'architecture'"),
    ("missing-two", {"drop": ("schema", "adapter_file")}, "schema", "'adapter_file'"),
    ("wrong-schema", {"fields": {"schema": "aner.llm.adapter/2"}}, "schema", "aner.llm.adapter/1"),
    ("bad-hex", {"fields": {"adapter_sha256": "xyz"}}, "adapter_sha256", "64 hexadecimal"),
    ("non-string", {"fields": {"architecture": 3}}, "architecture", "non-empty string"),
    ("traversal-dotdot", {"fields": {"adapter_file": "../adapter.gguf"}}, "adapter_file", "no path separators"),
    ("traversal-subdir", {"fields": {"adapter_file": "sub/adapter.gguf"}}, "adapter_file", "plain file name"),
    ("traversal-backslash", {"fields": {"adapter_file": "..\\adapter.gguf"}}, "adapter_file", "plain file name"),
    ("traversal-absolute", {"fields": {"adapter_file": "/etc/passwd"}}, "adapter_file", "plain file name"),
    ("traversal-parent", {"fields": {"adapter_file": ".."}}, "adapter_file", "no '..'"),
    ("missing-adapter", {"fields": {"adapter_file": "absent.gguf"}}, "adapter_file", "not found"),
    ("architecture-manifest", {"fields": {"architecture": "qwen2"}}, "architecture", "'qwen2'"),
    ("architecture-file", {"arch": "qwen2"}, "architecture", "general.architecture 'qwen2'"),
    ("shape-mismatch", {"n_ff": 96}, "blk.0.ffn_up.weight", "does not fit the base tensor"),
    ("unknown-target", {"n_layer": 3}, "blk.2.attn_q.weight", "base model does not have"),
    ("half-pair", {"omit": ("blk.1.attn_v.weight.lora_b",)}, "blk.1.attn_v.weight.lora_b", "missing"),
    ("not-lora", {"adapter_type": "control_vector"}, "adapter.type", "'lora'"),
]


@pytest.mark.parametrize("kwargs,field,needle", [r[1:] for r in REJECTIONS], ids=[r[0] for r in REJECTIONS])
def test_rejections_name_the_field(base, base_tokens, tmp_path, no_native_load, kwargs, field, needle):
    manifest = make_manifest(tmp_path, base, **kwargs)
    with pytest.raises(errors.AdapterError) as info:
        base.with_adapter(manifest)
    assert info.value.field == field
    assert needle in str(info.value)
    assert isinstance(info.value, errors.InvalidArtifactError)
    assert_base_unaffected(base, base_tokens)


def test_model_file_passed_as_adapter_is_rejected(base, base_tokens, llama_path, tmp_path, no_native_load):
    model_copy = tmp_path / "model.gguf"
    shutil.copyfile(llama_path, model_copy)
    with pytest.raises(errors.AdapterError, match="general.type") as info:
        base.with_adapter(make_manifest(tmp_path, base, adapter=model_copy))
    assert info.value.field == "general.type" and "not an adapter" in str(info.value)
    assert_base_unaffected(base, base_tokens)


def test_non_gguf_adapter_is_rejected(base, base_tokens, tmp_path, no_native_load):
    junk = write_not_gguf(tmp_path / "junk.gguf")
    with pytest.raises(errors.AdapterError, match="not a GGUF file") as info:
        base.with_adapter(make_manifest(tmp_path, base, adapter=junk))
    assert info.value.field == "adapter_file"
    assert_base_unaffected(base, base_tokens)


def test_symlink_escaping_the_folder_is_rejected(base, base_tokens, tmp_path, no_native_load):
    outside = write_lora_adapter(tmp_path / "outside.gguf")
    folder = tmp_path / "manifests"
    folder.mkdir()
    (folder / "adapter.gguf").symlink_to(outside)
    with pytest.raises(errors.AdapterError, match="outside the manifest's folder") as info:
        base.with_adapter(make_manifest(folder, base, adapter=folder / "adapter.gguf"))
    assert info.value.field == "adapter_file"
    assert_base_unaffected(base, base_tokens)


def test_symlink_inside_the_folder_is_allowed(base, tmp_path):
    real = write_lora_adapter(tmp_path / "real.gguf")
    (tmp_path / "alias.gguf").symlink_to(real)
    with base.with_adapter(make_manifest(tmp_path, base, adapter=tmp_path / "alias.gguf")) as tuned:
        assert tuned.supports("adapter")


@pytest.mark.parametrize(
    "text,field,needle",
    [
        ("{not json", "manifest", "not valid JSON"),
        ("[1, 2]", "manifest", "JSON object"),
        ('{"schema": "a", "schema": "b"}', "schema", "appears twice"),
    ],
)
def test_manifest_format_rules(base, tmp_path, no_native_load, text, field, needle):
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(errors.AdapterError, match=needle) as info:
        base.with_adapter(path)
    assert info.value.field == field


def test_missing_or_oversized_manifest(base, tmp_path, no_native_load):
    with pytest.raises(errors.AdapterError, match="not found"):
        base.with_adapter(tmp_path / "absent.json")
    with pytest.raises(errors.AdapterError, match="not a regular file"):
        base.with_adapter(tmp_path)
    big = tmp_path / "big.json"
    big.write_text(" " * (adapters_module.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(errors.AdapterError, match="at most"):
        base.with_adapter(big)


def test_adapter_changed_while_loading_is_detected(base, base_tokens, tmp_path, monkeypatch):
    manifest = make_manifest(tmp_path, base)
    loaded = []
    real = _engine.NativeAdapter

    def load_then_tamper(model, path, **kwargs):
        native = real(model, path, **kwargs)
        loaded.append(native)
        with open(path, "ab") as f:
            f.write(b"\0" * 32)
        return native

    monkeypatch.setattr(adapters_module, "NativeAdapter", load_then_tamper)
    with pytest.raises(errors.ArtifactChangedError, match="changed while loading"):
        base.with_adapter(manifest)
    assert not loaded[0].alive and loaded[0].free_calls == 1
    assert_base_unaffected(base, base_tokens)


# -- profiles and combinations ------------------------------------------------------
def test_one_adapter_per_effective_model(base, tmp_path):
    manifest = make_manifest(tmp_path, base)
    with base.with_adapter(manifest) as tuned:
        assert tuned.supports("adapter") and not base.supports("adapter")
        with pytest.raises(errors.ConfigurationError, match="one adapter per effective model"):
            tuned.with_adapter(manifest)
        with tuned.with_optimizer(prefix_cache_entries=1) as fast:
            with pytest.raises(errors.ConfigurationError, match="one adapter per effective model"):
                fast.with_adapter(manifest)
    assert not tuned.supports("adapter")  # closed leases support nothing
    with pytest.raises(errors.ClosedError):
        tuned.with_adapter(manifest)


def test_derived_leases_and_sessions_apply_the_adapter(base, base_tokens, tmp_path):
    with base.with_adapter(make_manifest(tmp_path, base)) as tuned:
        expected = tuned.generate(PROMPT, max_tokens=N).tokens
        assert expected != base_tokens
        with tuned.with_optimizer(prefix_cache_entries=1, speculative_tokens=2) as fast:
            assert fast.supports("adapter") and fast.profile.adapter == tuned.profile.adapter
            assert fast.generate(PROMPT, max_tokens=N).tokens == expected
            assert fast.generate(PROMPT, max_tokens=N).tokens == expected  # prefix-cache hit, same adapter
        with tuned.with_context_pool(0) as unpooled:
            assert unpooled.generate(PROMPT, max_tokens=N).tokens == expected
        with tuned.session() as session:
            assert session.send(PROMPT, max_tokens=N).tokens == expected
        with tuned.with_batching(2) as serving:  # the shared context applies the adapter too
            assert serving.kind == "throughput" and serving.supports("adapter") and serving.adapter == tuned.adapter
            assert serving.generate(PROMPT, max_tokens=N).tokens == expected
            many = serving.generate_many([PROMPT, "another prompt"], max_tokens=N)
            assert many[0].tokens == expected and many[1].tokens == tuned.generate("another prompt", max_tokens=N).tokens
    with base.with_optimizer(prefix_cache_entries=1) as fast_base:  # an adapter on a latency profile
        with fast_base.with_adapter(make_manifest(tmp_path / "b", base)) as fast_tuned:
            assert fast_tuned.profile.optimizer.prefix_cache_entries == 1
            assert fast_tuned.generate(PROMPT, max_tokens=N).tokens == expected
        assert fast_base.generate(PROMPT, max_tokens=N).tokens == base_tokens


# -- lifetime --------------------------------------------------------------------
def test_close_frees_contexts_then_adapter_then_weights(llama_path, tmp_path, monkeypatch):
    freed: list[str] = []
    real_free = _engine._free_once

    def record(free_fn, ptr, what):
        freed.append(what.split()[0])
        return real_free(free_fn, ptr, what)

    monkeypatch.setattr(_engine, "_free_once", record)
    m = llm.load(llama_path, context=CTX)
    tuned = m.with_adapter(make_manifest(tmp_path, m))
    tuned.generate(PROMPT, max_tokens=2)
    m.generate(PROMPT, max_tokens=2)
    native_model, native_adapter = m._weights.native, tuned._adapter.native
    m.close()  # the base lease goes first: the weights stay for the adapter lease
    assert native_model.alive and native_adapter.alive
    assert tuned.generate(PROMPT, max_tokens=2).usage.completion_tokens >= 1
    freed.clear()
    tuned.close()
    order = [w for w in freed if w != "batch"]
    assert order == ["context", "adapter", "model"], order
    assert native_adapter.free_calls == 1 and native_model.free_calls == 1


def test_unreachable_adapter_lease_frees_its_adapter(base, tmp_path):
    tuned = base.with_adapter(make_manifest(tmp_path, base))
    tuned.generate(PROMPT, max_tokens=2)
    native = tuned._adapter.native
    assert native.live_contexts() == 1
    del tuned
    gc.collect()
    assert not native.alive and native.free_calls == 1 and native.live_contexts() == 0
    assert base._weights.native.alive and base._weights.native.live_adapters() == 0


def test_session_keeps_the_adapter_until_it_closes(base, tmp_path):
    tuned = base.with_adapter(make_manifest(tmp_path, base))
    expected = tuned.generate(PROMPT, max_tokens=N).tokens
    session = tuned.session()
    native = tuned._adapter.native
    tuned.close()
    assert native.alive
    assert session.send(PROMPT, max_tokens=N).tokens == expected
    session.close()
    assert not native.alive and native.free_calls == 1


def test_model_free_releases_adapters_before_the_model(llama_path, tmp_path):
    """Engine safety net: freeing the model frees contexts, then adapters, then the model."""
    model = _engine.NativeModel(str(llama_path))
    adapter = _engine.NativeAdapter(model, str(write_lora_adapter(tmp_path / "a.gguf")))
    ctx = _engine.NativeContext(model, _engine.ContextParams(n_ctx=64, n_batch=32, n_ubatch=32, adapter=adapter))
    assert adapter.live_contexts() == 1 and model.live_adapters() == 1
    model.free()
    assert not ctx.alive and not adapter.alive and adapter.free_calls == 1 and model.free_calls == 1
    assert not adapter.free() and adapter.free_calls == 1  # exactly once


def test_load_close_cycles_do_not_leak(base, tmp_path):
    import psutil

    manifest = make_manifest(tmp_path, base)
    proc = psutil.Process()
    for _ in range(3):  # warm up allocator and caches
        with base.with_adapter(manifest) as tuned:
            tuned.generate(PROMPT, max_tokens=2)
    gc.collect()
    before = proc.memory_info().rss
    natives = []
    for _ in range(30):
        with base.with_adapter(manifest) as tuned:
            tuned.generate(PROMPT, max_tokens=2)
            natives.append(tuned._adapter.native)
    gc.collect()
    grown = proc.memory_info().rss - before
    assert all(n.free_calls == 1 and not n.alive and n.live_contexts() == 0 for n in natives)
    assert base._weights.native.live_adapters() == 0
    assert grown < 10 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 30 adapter load/close cycles"


# -- pure checks -------------------------------------------------------------------
def test_inspect_adapter_facts(fixture_models):
    facts = inspect_adapter(fixture_models["lora"])
    assert facts.architecture == "llama" and facts.adapter_type == "lora"
    assert facts.rank == 4 and facts.alpha == 8.0 and len(facts.pairs) == 6
    name, a, b = facts.pairs[0]
    assert name == "blk.0.attn_q.weight" and a == (64, 4) and b == (4, 64)  # ggml ne: [in, rank], [rank, out]
    with pytest.raises(errors.UnsupportedModelError, match="with_adapter"):
        llm.inspect_model(fixture_models["lora"])  # an adapter is still not a model


def test_base_tensor_shapes_come_from_the_header(base):
    shapes = base.facts.tensor_shapes()
    assert shapes["blk.0.ffn_up.weight"] == (64, 128)  # ggml ne: [n_embd, n_ff]
    assert shapes["token_embd.weight"][0] == 64


def test_check_targets_token_embd_is_transposed(fixture_models):
    facts = inspect_adapter(fixture_models["lora"])
    base = {"token_embd.weight": (64, 310)}
    swapped = facts.__class__(**{**facts.__dict__, "pairs": (("token_embd.weight", (4, 310), (4, 64)),)})
    check_targets(swapped, base)
    straight = facts.__class__(**{**facts.__dict__, "pairs": (("token_embd.weight", (64, 4), (4, 310)),)})
    with pytest.raises(errors.AdapterError, match="does not fit"):
        check_targets(straight, base)


def test_parse_manifest_digests_are_lowercase_hex():
    fields = {"schema": SCHEMA, "base_sha256": "a" * 64, "adapter_sha256": "b" * 64,
              "architecture": "llama", "adapter_file": "x.gguf"}
    m = parse_manifest(json.dumps(fields))
    assert m.base_sha256 == "a" * 64 and m.as_dict()["adapter_file"] == "x.gguf"
    for bad in ("A" * 64, "a" * 63 + "F", "a" * 64 + "\n"):  # hashlib's hexdigest is lowercase, no newline
        with pytest.raises(errors.AdapterError, match="64 hexadecimal characters, lowercase") as info:
            parse_manifest(json.dumps({**fields, "base_sha256": bad}))
        assert info.value.field == "base_sha256"


def test_write_manifest_round_trip(base, tmp_path):
    adapter = write_lora_adapter(tmp_path / "mine.gguf")
    path = write_manifest(adapter, base_sha256=base.fingerprint, architecture=base.architecture)
    assert path == tmp_path / "mine.manifest.json"
    assert set(json.loads(path.read_text())) == set(adapters_module.MANIFEST_FIELDS)
    with base.with_adapter(path) as tuned:
        assert tuned.adapter.adapter_file == "mine.gguf"
    other = tmp_path / "elsewhere"
    other.mkdir()
    with pytest.raises(errors.AdapterError, match="adapter's folder"):
        write_manifest(adapter, base_sha256=base.fingerprint, architecture="llama", manifest_path=other / "m.json")
    assert os.listdir(other) == []


def test_a_batching_adapter_lease_releases_its_context_then_its_adapter_hold(base, tmp_path):
    native = base._weights.native
    adapters, contexts = native.live_adapters(), native.live_contexts()
    tuned = base.with_adapter(make_manifest(tmp_path, base))
    serving = tuned.with_batching(2)
    serving.generate(PROMPT, max_tokens=2)
    tuned.close()  # the batching lease keeps its own hold on the adapter
    assert native.live_adapters() == adapters + 1
    assert serving.generate(PROMPT, max_tokens=2).finish_reason in ("stop", "length")
    serving.close()
    assert native.live_adapters() == adapters and native.live_contexts() == contexts
