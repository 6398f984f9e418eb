"""llm.models(): GGUF files found in the stores other tools keep, named as those tools name them.

Each store is laid out in a temporary HOME the way its tool writes it (the
Hugging Face hub cache's snapshots pointing at blobs, LM Studio's
publisher/repo folders, Ollama's manifests naming sha256 blobs), with tiny
fixture models; the listing, the admission verdicts and name resolution are
checked against what was laid out.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from aner_nb import llm
from aner_nb.llm import catalog
from aner_nb.llm.errors import InvalidArtifactError, ModelNotFoundError
from fixtures.models import write_unsupported_arch_model

EMPTY_ENV: dict[str, str] = {}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def home(tmp_path: Path, llama_path: Path, qwen2_path: Path) -> Path:
    home = tmp_path / "home"
    # ~/models: a plain folder, named by file stem.
    (home / "models" / "sub").mkdir(parents=True)
    shutil.copy(llama_path, home / "models" / "sub" / "tiny-llama.gguf")
    write_unsupported_arch_model(home / "models" / "state-space.gguf", arch="mamba")
    (home / "models" / "notes.txt").write_text("not a model")
    # Hugging Face hub cache: snapshots/<rev>/<file> are symlinks to blobs/<sha256>; two revisions
    # share the blob (listed once), refs/main names the newer one.
    repo = home / ".cache" / "huggingface" / "hub" / "models--TinyOrg--Tiny-Qwen-GGUF"
    (repo / "blobs").mkdir(parents=True)
    blob = repo / "blobs" / _sha256(qwen2_path)
    shutil.copy(qwen2_path, blob)
    for rev in ("aaaa1111", "bbbb2222"):
        (repo / "snapshots" / rev).mkdir(parents=True)
        os.symlink(os.path.relpath(blob, repo / "snapshots" / rev), repo / "snapshots" / rev / "tiny-qwen-q8_0.gguf")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbbb2222")
    # LM Studio: ~/.lmstudio/models/<publisher>/<repo>/<file>.
    lms = home / ".lmstudio" / "models" / "tiny-pub" / "Tiny-Llama-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(llama_path, lms / "tiny-llama-f16.gguf")
    # Ollama: manifests/<host>/<namespace>/<model>/<tag> -> blobs/sha256-<hex>.
    store = home / ".ollama" / "models"
    (store / "blobs").mkdir(parents=True)
    digest = _sha256(qwen2_path)
    shutil.copy(qwen2_path, store / "blobs" / f"sha256-{digest}")
    for namespace, model, tag in (("library", "tinyqwen", "0.5b"), ("someone", "tinyqwen-ft", "latest")):
        manifest = store / "manifests" / "registry.ollama.ai" / namespace / model / tag
        manifest.parent.mkdir(parents=True)
        manifest.write_text(json.dumps({
            "schemaVersion": 2,
            "layers": [
                {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1},
                {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 1},
            ],
        }))
    broken = store / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    return home


def entries(home: Path, env: dict[str, str] = EMPTY_ENV) -> dict[tuple[str, str], catalog.ModelEntry]:
    return {(e.store, e.name): e for e in catalog.find_models(env=env, home=home) if e.store != "aner_nb"}


def test_each_store_is_found_and_named_as_its_tool_names_it(home, llama_path, qwen2_path):
    found = entries(home)
    assert set(found) == {
        ("folder", "tiny-llama"),
        ("folder", "state-space"),
        ("huggingface", "TinyOrg/Tiny-Qwen-GGUF/tiny-qwen-q8_0.gguf"),
        ("lm-studio", "tiny-pub/Tiny-Llama-GGUF/tiny-llama-f16.gguf"),
        ("ollama", "tinyqwen:0.5b"),
        ("ollama", "someone/tinyqwen-ft:latest"),
    }
    hf = found["huggingface", "TinyOrg/Tiny-Qwen-GGUF/tiny-qwen-q8_0.gguf"]
    assert "snapshots/bbbb2222" in hf.path  # the revision refs/main names, the shared blob once
    ollama = found["ollama", "tinyqwen:0.5b"]
    assert Path(ollama.path).name == f"sha256-{_sha256(qwen2_path)}"
    facts = llm.inspect_model(llama_path)
    tiny = found["folder", "tiny-llama"]
    assert (tiny.architecture, tiny.context, tiny.chat_template, tiny.admitted, tiny.reason) == (
        "llama", facts.context_length, True, True, "")
    assert tiny.size == llama_path.stat().st_size
    assert found["ollama", "tinyqwen:0.5b"].architecture == "qwen2"


@pytest.mark.parametrize("hostile", ["layers_not_objects", "deeply_nested", "not_an_object", "ref_not_utf8", "ref_huge"])
def test_a_hostile_file_in_another_tools_store_hides_nothing_else(home, hostile):
    """Another program writes these stores: one bad manifest or ref skips that entry only, never raises."""
    manifests = home / ".ollama" / "models" / "manifests" / "registry.ollama.ai" / "library"
    bad = manifests / "hostile" / "latest"
    bad.parent.mkdir(parents=True)
    refs = home / ".cache" / "huggingface" / "hub" / "models--TinyOrg--Tiny-Qwen-GGUF" / "refs" / "main"
    if hostile == "layers_not_objects":
        bad.write_text(json.dumps({"layers": [1, "x", None, [2]]}))
    elif hostile == "deeply_nested":
        bad.write_text("[" * 100_000)  # under the manifest cap, deeper than the JSON parser recurses
    elif hostile == "not_an_object":
        bad.write_text(json.dumps(["layers"]))
    elif hostile == "ref_not_utf8":
        refs.write_bytes(b"\xff\xfe")
    else:
        refs.write_text("b" * 10_000)
    found = entries(home)
    assert ("ollama", "tinyqwen:0.5b") in found and ("huggingface", "TinyOrg/Tiny-Qwen-GGUF/tiny-qwen-q8_0.gguf") in found
    assert not any("hostile" in name for _, name in found)


def test_a_non_admitted_architecture_is_listed_with_the_reason(home):
    entry = entries(home)["folder", "state-space"]
    assert entry.architecture == "mamba" and not entry.admitted
    with pytest.raises(InvalidArtifactError) as refused:
        llm.inspect_model(entry.path)
    assert entry.reason == str(refused.value) and "mamba" in entry.reason


def test_env_folders_and_hub_cache_override(home, tmp_path, llama_path):
    extra = tmp_path / "elsewhere"
    extra.mkdir()
    shutil.copy(llama_path, extra / "from-env.gguf")
    moved = tmp_path / "hub"
    shutil.move(str(home / ".cache" / "huggingface" / "hub"), moved)
    found = entries(home, {"ANER_NB_MODELS": str(extra), "HF_HUB_CACHE": str(moved)})
    assert ("folder", "from-env") in found
    assert ("huggingface", "TinyOrg/Tiny-Qwen-GGUF/tiny-qwen-q8_0.gguf") in found
    assert ("huggingface", "TinyOrg/Tiny-Qwen-GGUF/tiny-qwen-q8_0.gguf") not in entries(home)


def test_the_frame_has_one_row_per_file_with_typed_columns(home):
    frame = llm.models(env=EMPTY_ENV, home=home)
    assert list(frame.columns) == list(catalog.ModelEntry.__dataclass_fields__)
    assert len(frame[frame.store != "aner_nb"]) == 6
    assert str(frame["context"].dtype) == "Int64" and frame["admitted"].dtype == bool


def test_the_packaged_demo_model_is_listed():
    names = {e.name for e in catalog.find_models(env=EMPTY_ENV, home="/nonexistent") if e.store == "aner_nb"}
    assert "SmolLM2-135M-Instruct" in names


def test_names_resolve_to_their_files(home, qwen2_path):
    resolve = lambda name: catalog.resolve_model(name, env=EMPTY_ENV, home=home)  # noqa: E731
    assert resolve("tinyqwen:0.5b") == entries(home)["ollama", "tinyqwen:0.5b"].path
    assert resolve("TINY-LLAMA") == str(home / "models" / "sub" / "tiny-llama.gguf")  # exact, any case
    assert resolve("state-sp") == str(home / "models" / "state-space.gguf")  # a unique part
    assert resolve(str(qwen2_path)) == str(qwen2_path)  # a path stays a path
    assert resolve("missing/dir/model.gguf") == "missing/dir/model.gguf"  # the loader names the missing file


def test_ambiguous_and_missing_names_are_typed_errors_listing_candidates(home):
    with pytest.raises(ModelNotFoundError) as ambiguous:
        catalog.resolve_model("tinyqwen", env=EMPTY_ENV, home=home)
    assert set(ambiguous.value.candidates) == {
        "tinyqwen:0.5b [ollama]", "someone/tinyqwen-ft:latest [ollama]"}
    assert "tinyqwen:0.5b [ollama]" in str(ambiguous.value)
    with pytest.raises(ModelNotFoundError, match="no model of that name") as missing:
        catalog.resolve_model("no-such-model", env=EMPTY_ENV, home=home)
    assert "tiny-llama" in str(missing.value)  # what exists is listed
    assert isinstance(missing.value, InvalidArtifactError)


def test_load_takes_a_store_name(home, monkeypatch, qwen2_path):
    monkeypatch.setenv("HOME", str(home))
    for name in ("HF_HUB_CACHE", "HF_HOME", "OLLAMA_MODELS", "ANER_NB_MODELS"):
        monkeypatch.delenv(name, raising=False)
    with llm.load("tinyqwen:0.5b", context=256, warmup=False) as model:
        assert model.architecture == "qwen2"
        assert model.fingerprint == _sha256(qwen2_path)
        assert model.generate("hi", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(ModelNotFoundError):
        llm.load("tinyqwen", context=256)
