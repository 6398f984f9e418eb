"""LoRA adapters proven by a checked manifest: ``model.with_adapter(manifest_path)``.

A manifest is a JSON object with exactly five fields::

    {"schema": "aner.llm.adapter/1",
     "base_sha256": "<sha256 of the base model file>",
     "adapter_sha256": "<sha256 of the adapter file>",
     "architecture": "llama",
     "adapter_file": "my-adapter.gguf"}

``adapter_file`` is a plain file name in the manifest's folder. Every rule is
checked before llama.cpp opens the adapter, in this order: the manifest's
fields, ``base_sha256`` against the lease's fingerprint, ``architecture``
against the base, the adapter path (no separators, no ``..``, no symlink out
of the folder), the adapter bytes against ``adapter_sha256``, the GGUF header
(``general.type = adapter``, ``adapter.type = lora``, its architecture) and
finally that every lora_a/lora_b pair targets a base tensor of matching
shape. Each failure is an :class:`AdapterError` whose ``field`` names the
manifest field, GGUF key or tensor at fault. After llama.cpp has loaded the
adapter its bytes are hashed again, so a file swapped during the load is
caught (``ArtifactChangedError``), as for models.

The checks are pure functions over plain data (``parse_manifest``,
``resolve_adapter_file``, ``check_base``, ``check_targets``);
:func:`load_adapter` runs them and returns a :class:`SharedAdapter`, the
reference-counted owner that the leases and sessions using it share.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ._engine import NativeAdapter
from .artifact import AdapterFacts, inspect_adapter, sha256_file
from .errors import AdapterError, ArtifactChangedError, InvalidArtifactError

__all__ = [
    "SCHEMA",
    "MANIFEST_FIELDS",
    "AdapterManifest",
    "AdapterInfo",
    "SharedAdapter",
    "parse_manifest",
    "read_manifest",
    "resolve_adapter_file",
    "check_base",
    "check_targets",
    "load_adapter",
    "write_manifest",
]

SCHEMA = "aner.llm.adapter/1"
MANIFEST_FIELDS = ("schema", "base_sha256", "adapter_sha256", "architecture", "adapter_file")
MAX_MANIFEST_BYTES = 64 * 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")  # fullmatch: hashlib's hexdigest form only
_SEPARATORS = ("/", "\\")


@dataclass(frozen=True)
class AdapterManifest:
    """A manifest whose five fields passed the format checks (not yet the base or the bytes)."""

    schema: str
    base_sha256: str
    adapter_sha256: str
    architecture: str
    adapter_file: str
    folder: str  # the manifest's folder, resolved; adapter_file lives here

    def as_dict(self) -> dict[str, str]:
        return {f: getattr(self, f) for f in MANIFEST_FIELDS}


@dataclass(frozen=True)
class AdapterInfo:
    """What an adapter lease applies: plain data for ``model.adapter`` and dashboards."""

    name: str
    adapter_file: str
    adapter_sha256: str
    base_sha256: str
    architecture: str
    alpha: float
    rank: int
    targets: tuple[str, ...]
    tensor_bytes: int


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise AdapterError(f"manifest field {key!r} appears twice; each field must appear once", field=key)
        out[key] = value
    return out


def parse_manifest(text: str | bytes, *, folder: str = ".", source: str = "manifest") -> AdapterManifest:
    """Validate a manifest's JSON text: exactly the five fields, each well-formed."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise AdapterError(f"{source} must be JSON text (str or bytes), got {type(text).__name__}", field="manifest")
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except AdapterError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{source} is not valid JSON: {exc}", field="manifest") from None
    except RecursionError:  # json's decoder recurses once per nested array or object
        raise AdapterError(f"{source} nests arrays or objects too deeply to be a manifest", field="manifest") from None
    if not isinstance(data, dict):
        raise AdapterError(
            f"{source} must be a JSON object with the fields {', '.join(MANIFEST_FIELDS)}; got {type(data).__name__}",
            field="manifest",
        )
    extra = [k for k in data if k not in MANIFEST_FIELDS]
    missing = [k for k in MANIFEST_FIELDS if k not in data]
    for wrong, problem, rule in ((extra, "has unknown", "allowed"), (missing, "is missing", "required")):
        if wrong:
            raise AdapterError(
                f"{source} {problem} field(s) {', '.join(map(repr, wrong))}; {rule} fields are exactly "
                + ", ".join(MANIFEST_FIELDS),
                field=wrong[0],
            )
    for key in MANIFEST_FIELDS:
        if not isinstance(data[key], str) or not data[key]:
            raise AdapterError(f"{source}: {key} must be a non-empty string, got {data[key]!r}", field=key)
    if data["schema"] != SCHEMA:
        raise AdapterError(f"{source}: schema must be {SCHEMA!r}, got {data['schema']!r}", field="schema")
    for key in ("base_sha256", "adapter_sha256"):
        if not _SHA256.fullmatch(data[key]):
            raise AdapterError(
                f"{source}: {key} must be 64 hexadecimal characters, lowercase (a SHA-256 hexdigest as "
                f"hashlib writes it), got {data[key]!r}",
                field=key,
            )
    _check_basename(data["adapter_file"], source)
    return AdapterManifest(
        schema=SCHEMA,
        base_sha256=data["base_sha256"],
        adapter_sha256=data["adapter_sha256"],
        architecture=data["architecture"],
        adapter_file=data["adapter_file"],
        folder=folder,
    )


def _check_basename(name: str, source: str) -> None:
    if any(sep in name for sep in _SEPARATORS) or name in (".", "..") or "\x00" in name or os.path.isabs(name):
        raise AdapterError(
            f"{source}: adapter_file must be a plain file name in the manifest's folder (no path separators, "
            f"no '..'), got {name!r}",
            field="adapter_file",
        )
    try:
        os.fsencode(name)  # JSON can carry lone surrogates, which no file name on this system has
    except UnicodeEncodeError:
        raise AdapterError(
            f"{source}: adapter_file {name!r} cannot be a file name here (it does not encode to the file system's "
            "encoding)",
            field="adapter_file",
        ) from None


def read_manifest(path: "str | os.PathLike[str]") -> AdapterManifest:
    """Read and validate a manifest file (at most 64 KiB of JSON)."""
    try:
        p = os.fspath(path)
    except TypeError:
        raise AdapterError(f"manifest path must be a str or os.PathLike, got {type(path).__name__}", field="manifest") from None
    try:
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            raise AdapterError(f"manifest path {p} is not a regular file; expected a JSON file", field="manifest")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise AdapterError(
                f"manifest {p} is {st.st_size} bytes; a manifest is at most {MAX_MANIFEST_BYTES} bytes", field="manifest"
            )
        with open(p, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise AdapterError(f"manifest file not found: {p}", field="manifest") from None
    except OSError as exc:
        raise AdapterError(f"cannot read manifest {p}: {exc.strerror or exc}", field="manifest") from None
    folder = os.path.realpath(os.path.dirname(os.path.abspath(p)))
    return parse_manifest(raw, folder=folder, source=f"manifest {os.path.basename(p)}")


def resolve_adapter_file(manifest: AdapterManifest) -> str:
    """The adapter's resolved path; it must stay inside the manifest's folder after symlinks."""
    _check_basename(manifest.adapter_file, "manifest")
    folder = os.path.realpath(manifest.folder)
    real = os.path.realpath(os.path.join(folder, manifest.adapter_file))
    if real == folder or os.path.commonpath([folder, real]) != folder:
        raise AdapterError(
            f"adapter_file {manifest.adapter_file!r} resolves outside the manifest's folder (through a symlink); "
            "the adapter must be a file inside the folder that holds the manifest",
            field="adapter_file",
        )
    try:
        st = os.stat(real)
    except OSError:
        raise AdapterError(
            f"adapter_file {manifest.adapter_file!r} was not found in the manifest's folder", field="adapter_file"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise AdapterError(f"adapter_file {manifest.adapter_file!r} is not a regular file", field="adapter_file")
    return real


def check_base(manifest: AdapterManifest, *, fingerprint: str, architecture: str) -> None:
    """The manifest must name this base: its SHA-256 and its architecture."""
    if manifest.base_sha256 != fingerprint.lower():
        raise AdapterError(
            f"base_sha256 {manifest.base_sha256[:16]}... does not match this lease's fingerprint "
            f"{fingerprint[:16]}...; the adapter was made for another base model (allowed: the fingerprint of "
            "the lease with_adapter is called on)",
            field="base_sha256",
        )
    if manifest.architecture != architecture:
        raise AdapterError(
            f"architecture {manifest.architecture!r} does not match the base model's architecture "
            f"{architecture!r}",
            field="architecture",
        )


def check_targets(adapter: AdapterFacts, base: Mapping[str, tuple[int, ...]]) -> None:
    """Every lora_a/lora_b pair must target a base tensor with matching shape (llama.cpp's rules).

    Shapes are ggml ``ne``: a base matrix is [in, out], lora_a [in, rank],
    lora_b [rank, out]. ``token_embd`` ([n_embd, n_vocab]) is the exception:
    its pair is stored swapped, lora_a [rank, n_vocab] and lora_b [rank, n_embd].
    """
    for target, a, b in adapter.pairs:
        shape = base.get(target)
        if shape is None:
            raise AdapterError(
                f"adapter tensor {target + '.lora_a'!r} targets {target!r}, which the base model does not have",
                field=target,
            )
        if len(shape) != 2:
            raise AdapterError(f"adapter target {target!r} is a {len(shape)}-D base tensor; LoRA needs a matrix", field=target)
        if target.startswith("token_embd."):
            # The embedding lookup reads the LoRA with A and B swapped (llama.cpp: llm_build_inp_embd).
            ok = shape[0] == b[1] and shape[1] == a[1] and a[0] == b[0]
        else:
            ok = shape[0] == a[0] and shape[1] == b[1] and a[1] == b[0]
        if not ok:
            raise AdapterError(
                f"adapter pair {target!r} does not fit the base tensor: lora_a {list(a)} and lora_b {list(b)} "
                f"against base {list(shape)} (ggml order; allowed: lora_a [in, rank], lora_b [rank, out] with "
                "the base [in, out])",
                field=target,
            )


class SharedAdapter:
    """A loaded adapter shared by the leases and sessions that apply it; freed by the last one.

    Freeing the native adapter frees the contexts still applying it first;
    the weights are released by the leases after this.
    """

    def __init__(self, native: NativeAdapter, manifest: AdapterManifest, facts: AdapterFacts) -> None:
        self.native = native
        self.manifest = manifest
        self.facts = facts
        self._users = 0
        self._lock = threading.Lock()

    @property
    def sha256(self) -> str:
        return self.manifest.adapter_sha256

    @property
    def info(self) -> AdapterInfo:
        f = self.facts
        return AdapterInfo(
            name=f.name, adapter_file=self.manifest.adapter_file, adapter_sha256=self.sha256,
            base_sha256=self.manifest.base_sha256, architecture=f.architecture, alpha=f.alpha, rank=f.rank,
            targets=f.targets, tensor_bytes=f.tensor_bytes,
        )

    def retain(self) -> None:
        with self._lock:
            if not self.native.alive:
                raise RuntimeError("adapter was already freed")
            self._users += 1

    def discard(self) -> None:
        """Free the adapter if no lease or session ever retained it (a failed derivation)."""
        with self._lock:
            unused = self._users == 0
        if unused:
            self.native.free()

    def release(self) -> None:
        """Drop one user; the last one frees the adapter (after its contexts)."""
        with self._lock:
            self._users -= 1
            last = self._users <= 0
        if last:
            self.native.free()


def load_adapter(weights: Any, manifest_path: "str | os.PathLike[str]") -> SharedAdapter:
    """Check a manifest and its adapter against ``weights`` (a SharedWeights), then load it.

    The returned adapter has no users yet: the lease built on it retains it.
    """
    manifest = read_manifest(manifest_path)
    facts = weights.facts
    check_base(manifest, fingerprint=weights.fingerprint, architecture=facts.architecture)
    path = resolve_adapter_file(manifest)
    digest = _sha256(path)
    if digest != manifest.adapter_sha256:
        raise AdapterError(
            f"adapter_sha256 {manifest.adapter_sha256[:16]}... does not match the bytes of "
            f"{manifest.adapter_file!r} (sha256 {digest[:16]}...); the adapter file is not the one the manifest "
            "names",
            field="adapter_sha256",
        )
    adapter = inspect_adapter(path)
    if adapter.architecture != manifest.architecture:
        raise AdapterError(
            f"{manifest.adapter_file!r} declares general.architecture {adapter.architecture!r} but the manifest's "
            f"architecture is {manifest.architecture!r}; they must match the base ({facts.architecture!r})",
            field="architecture",
        )
    check_targets(adapter, facts.tensor_shapes())
    native = NativeAdapter(weights.native, path)
    try:
        after = _sha256(path)
        if after != digest:
            raise ArtifactChangedError(
                f"{manifest.adapter_file!r} changed while loading: sha256 {digest[:16]}... before, "
                f"{after[:16]}... after; the adapter was discarded"
            )
    except BaseException:
        native.free()
        raise
    return SharedAdapter(native, manifest, adapter)


def _sha256(path: str) -> str:
    try:
        return sha256_file(path, progress=False)
    except InvalidArtifactError as exc:
        raise AdapterError(f"adapter_file: {exc}", field="adapter_file") from None


def write_manifest(
    adapter_path: "str | os.PathLike[str]",
    *,
    base_sha256: str,
    architecture: str,
    manifest_path: "str | os.PathLike[str] | None" = None,
) -> Path:
    """Write the manifest of an adapter file (hashing it) next to it; returns the manifest path.

    ``base_sha256`` is the base lease's ``fingerprint``. The default manifest
    name is ``<adapter stem>.manifest.json`` in the adapter's folder.
    """
    adapter = Path(adapter_path)
    target = Path(manifest_path) if manifest_path is not None else adapter.with_name(adapter.stem + ".manifest.json")
    if os.path.realpath(target.parent) != os.path.realpath(adapter.parent):
        raise AdapterError(
            f"the manifest must be written in the adapter's folder ({adapter.parent}), got {target.parent}",
            field="adapter_file",
        )
    data = {
        "schema": SCHEMA,
        "base_sha256": base_sha256,
        "adapter_sha256": sha256_file(adapter, progress=False),
        "architecture": architecture,
        "adapter_file": adapter.name,
    }
    parse_manifest(json.dumps(data), folder=str(adapter.parent))  # the same rules as reading it
    target.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return target
