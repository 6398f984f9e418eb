"""GGUF artifact inspection and hashing, before llama.cpp touches the file.

:func:`inspect_model` reads only the GGUF header (metadata key/values and
tensor infos) through a read-only memory map and returns :class:`ModelFacts`,
plain data for admission and KV-memory estimates. It rejects, with a typed
error naming the file and what is allowed:

* a missing path or one that is not a regular file, bytes that are not GGUF
  (wrong magic), unsupported GGUF versions, truncated or corrupted headers,
  tensor data extending past the end of the file (:class:`InvalidArtifactError`);
* split shards, multimodal projectors, adapters and architectures outside
  :data:`SUPPORTED_ARCHITECTURES` (:class:`UnsupportedModelError`).

:func:`inspect_adapter` reads a LoRA adapter's header with the same parser
and returns :class:`AdapterFacts` (architecture, alpha, the lora_a/lora_b
tensor pairs and their shapes); it rejects anything that is not a
``general.type = adapter`` / ``adapter.type = lora`` GGUF with
:class:`AdapterError`. ``ModelFacts.tensors`` keeps the base model's tensor
names and shapes so an adapter can be checked against it without reopening
the model file.

The header is read by :mod:`aner_nb.llm.gguf_header` (bounded in time and
memory whatever the file claims); this module admits what it reads.

:func:`sha256_file` streams a file through SHA-256 with an optional ``tqdm``
progress bar.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import AdapterError, InvalidArtifactError, UnsupportedModelError
from .gguf_header import (  # noqa: F401 - SUPPORTED_GGUF_VERSIONS, TensorTypes: re-exported
    MAX_DECODED_STRING,
    SUPPORTED_GGUF_VERSIONS,
    Header,
    LongString,
    StringArray,
    TensorShapes,
    TensorTypes,
    Truncated,
    open_gguf,
    regular_file,
)
from .memory import sliding_window_layers

# The reader, under the name tests patch (its ``string`` method counts decoded strings).
_Header = Header

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_GGUF_VERSIONS",
    "ModelFacts",
    "AdapterFacts",
    "TensorShapes",
    "inspect_model",
    "inspect_adapter",
    "header_metadata",
    "sha256_file",
]

# The admitted architectures (each has a fixture and a greedy parity test) and the sliding window
# llama.cpp's loader gives each (src/models/<arch>.cpp): {arch}.attention.sliding_window, with this
# default when the key is absent; None where every layer attends to the whole context whatever the
# file declares (llama, qwen2 and qwen3 ignore the key; llama.cpp disables Phi-3's window).
# "llama" covers Llama 2/3, Mistral and SmolLM: llama.cpp writes them all as llama.
_SLIDING_WINDOW_DEFAULTS: Mapping[str, int | None] = {
    "llama": None,
    "qwen2": None,
    "qwen3": None,
    "gemma2": 4096,  # alternating layers
    "gemma3": 0,     # no window unless the file declares one
    "phi3": None,
}
SUPPORTED_ARCHITECTURES = tuple(_SLIDING_WINDOW_DEFAULTS)
# Every n-th layer is full attention unless {arch}.attention.sliding_window_pattern says otherwise
# (llama.cpp's load_swa_pattern defaults in src/models/gemma2.cpp and gemma3.cpp).
_SWA_PATTERN_DEFAULTS: Mapping[str, int] = {"gemma2": 2, "gemma3": 6}
_SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_PROJECTOR_TYPES = ("mmproj", "clip", "projector")
_PROJECTOR_ARCHS = ("clip", "mmproj")
LORA_SUFFIXES = (".lora_a", ".lora_b")
_MAX_LAYERS = 512                # LLAMA_MAX_LAYERS: llama.cpp refuses larger block counts


@dataclass(frozen=True)
class ModelFacts:
    """What the GGUF header declares about a model; plain data, no file handles."""

    path: str
    file_size: int
    gguf_version: int
    architecture: str
    name: str
    context_length: int      # declared {arch}.context_length (training context)
    layers: int
    heads: int
    kv_heads: int
    embedding_length: int
    head_dim_k: int          # {arch}.attention.key_length, else embedding_length // heads
    head_dim_v: int          # {arch}.attention.value_length, else embedding_length // heads
    sliding_window: int      # the window llama.cpp applies to its sliding-window layers; 0: none
    vocab_size: int
    chat_template: str | None
    bos_token: str | None    # token texts, for rendering templates
    eos_token: str | None
    tensor_bytes: int        # sum of the tensors' data sizes
    tensors: TensorShapes = field(default=(), repr=False)  # names and ggml shapes
    tensor_types: TensorTypes = field(default=(), repr=False)  # names and ggml type names
    # Per-layer {arch}.attention.head_count_kv when the file gives a list (empty: kv_heads on every
    # layer), and the layers llama.cpp runs with the sliding window (its set_swa_pattern rule).
    kv_heads_per_layer: tuple[int, ...] = ()
    swa_layers: tuple[int, ...] = ()

    @property
    def output_type(self) -> str | None:
        """The ggml type of the output projection's weights (``token_embd`` when the embedding is tied).

        The output layer multiplies a vocabulary-sized matrix for every row
        that needs logits; its type decides which CPU kernel runs it.
        """
        types = dict(self.tensor_types)
        return types.get("output.weight", types.get("token_embd.weight"))

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{tensor name: ggml shape}`` of the model's tensors (ne[0] first)."""
        return dict(self.tensors)


@dataclass(frozen=True)
class AdapterFacts:
    """What a LoRA adapter GGUF declares; plain data, no file handles.

    ``pairs`` maps each base tensor the adapter targets to the ggml shapes of
    its ``lora_a`` (ne = [in, rank]) and ``lora_b`` (ne = [rank, out]) tensors.
    """

    path: str
    file_size: int
    gguf_version: int
    architecture: str
    name: str
    adapter_type: str
    alpha: float             # adapter.lora.alpha; 0.0 when absent (llama.cpp then uses scale 1)
    pairs: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    tensor_bytes: int

    @property
    def targets(self) -> tuple[str, ...]:
        """Names of the base tensors the adapter modifies."""
        return tuple(name for name, _, _ in self.pairs)

    @property
    def rank(self) -> int:
        """The largest LoRA rank among the pairs."""
        return max((a[1] for _, a, _ in self.pairs), default=0)


def _int(meta: dict[str, Any], key: str, path: str, default: int | None = None) -> int:
    value = meta.get(key)
    if value is None:
        if default is None:
            raise InvalidArtifactError(f"{path}: missing required metadata key {key!r}")
        return default
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        value = max(value)  # per-layer values: the largest bounds memory
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArtifactError(f"{path}: metadata {key!r} must be a non-negative integer, got {value!r}")
    return value


def _str(meta: dict[str, Any], key: str) -> str | None:
    value = meta.get(key)
    return value if isinstance(value, str) else None


def _admit(path: str, meta: dict[str, Any]) -> str:
    """Apply the admission rules that need metadata; return the architecture."""
    split_count = meta.get("split.count")
    if isinstance(split_count, int) and not isinstance(split_count, bool) and split_count > 1:
        shard = meta.get("split.no", 0)
        which = f"shard {shard + 1}" if isinstance(shard, int) and not isinstance(shard, bool) else "a shard"
        raise UnsupportedModelError(
            f"{path} is {which} of a split GGUF "
            f"(split.count = {split_count}); only single-file GGUF models are admitted: "
            "merge the shards first with `llama-gguf-split --merge FIRST-SHARD.gguf OUT.gguf`"
        )
    arch = _str(meta, "general.architecture")
    gtype = (_str(meta, "general.type") or "").lower()
    if gtype == "adapter":
        kind = _str(meta, "adapter.type") or "unknown"
        what = "a LoRA adapter" if kind == "lora" else f"an adapter (adapter.type = {kind!r})"
        raise UnsupportedModelError(
            f"{path} is {what}, not a model; load the base model and apply it with with_adapter(...)"
        )
    if gtype in _PROJECTOR_TYPES or (arch or "").lower() in _PROJECTOR_ARCHS:
        raise UnsupportedModelError(
            f"{path} is a multimodal projector (general.type = {gtype or None!r}, "
            f"architecture = {arch!r}); only text models are admitted"
        )
    if arch is None:
        raise InvalidArtifactError(f"{path}: missing required metadata key 'general.architecture'")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported; supported architectures: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return arch


def inspect_model(path: os.PathLike[str] | str) -> ModelFacts:
    """Read and admit a GGUF model's header; return its :class:`ModelFacts`.

    Only the header is touched (through a read-only memory map), so this is
    fast even for large files. Raises :class:`InvalidArtifactError` for files
    that are not readable single-file GGUF and :class:`UnsupportedModelError`
    for valid GGUF files this toolkit does not admit.
    """
    p, st = regular_file(path)
    shard = _SPLIT_NAME.search(os.path.basename(p))
    if shard and int(shard.group(2)) != 1:  # "-00001-of-00001" is a whole model
        raise UnsupportedModelError(
            f"{p} is named like a shard of a split GGUF (*-NNNNN-of-NNNNN.gguf); only single-file "
            "GGUF models are admitted: merge the shards first with "
            "`llama-gguf-split --merge FIRST-SHARD.gguf OUT.gguf`"
        )
    with open_gguf(p, st) as g:
        arch = _admit(p, g.meta)
        return _facts(p, g.size, g.version, arch, g.meta, g.tensor_bytes, g.tensors, g.tensor_types, g.header)


def header_metadata(path: os.PathLike[str] | str, keys: tuple[str, ...]) -> dict[str, Any]:
    """The scalar or string values of ``keys`` in a GGUF header, without admitting the model.

    The same bounded parse as :func:`inspect_model` (hostile headers are typed
    errors), for listings that describe files aner_nb does not admit; absent
    keys and array or oversized values are left out.
    """
    p, st = regular_file(path)
    with open_gguf(p, st) as g:
        return {k: g.meta[k] for k in keys if isinstance(g.meta.get(k), (str, int, float, bool))}


def _facts(
    path: str, size: int, version: int, arch: str, meta: dict[str, Any], tensor_bytes: int,
    tensors: TensorShapes, tensor_types: TensorTypes, h: Header,
) -> ModelFacts:
    layers, heads, n_embd = _block_shape(path, arch, meta)
    a = arch
    kv_heads = _int(meta, f"{a}.attention.head_count_kv", path, default=heads)
    head_dim_k = _int(meta, f"{a}.attention.key_length", path, default=n_embd // heads)
    head_dim_v = _int(meta, f"{a}.attention.value_length", path, default=n_embd // heads)
    context_length = _int(meta, f"{a}.context_length", path)
    sliding_window, swa_layers, kv_heads_per_layer = _attention_layout(path, arch, meta, layers)
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, StringArray):
        vocab_size = tokens.count
    else:
        vocab_size = _int(meta, f"{a}.vocab_size", path, default=0)
    template = _embedded_template(path, meta)
    return ModelFacts(
        path=path,
        file_size=size,
        gguf_version=version,
        architecture=arch,
        name=_str(meta, "general.name") or Path(path).stem,
        context_length=context_length,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        embedding_length=n_embd,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        sliding_window=sliding_window,
        vocab_size=vocab_size,
        chat_template=template,
        bos_token=_token_text(meta, tokens, "tokenizer.ggml.bos_token_id", h),
        eos_token=_token_text(meta, tokens, "tokenizer.ggml.eos_token_id", h),
        tensor_bytes=tensor_bytes,
        tensors=tensors,
        tensor_types=tensor_types,
        kv_heads_per_layer=kv_heads_per_layer,
        swa_layers=swa_layers,
    )


def _block_shape(path: str, a: str, meta: dict[str, Any]) -> tuple[int, int, int]:
    """``(block_count, attention.head_count, embedding_length)``, each at least 1, layers at most 512."""
    layers = _int(meta, f"{a}.block_count", path)
    n_embd = _int(meta, f"{a}.embedding_length", path)
    heads = _int(meta, f"{a}.attention.head_count", path)
    if layers < 1 or n_embd < 1 or heads < 1:
        raise InvalidArtifactError(
            f"{path}: block_count, embedding_length and attention.head_count must be >= 1, "
            f"got {layers}, {n_embd}, {heads}"
        )
    if layers > _MAX_LAYERS:
        raise InvalidArtifactError(f"{path}: {a}.block_count is {layers}; llama.cpp loads at most {_MAX_LAYERS} layers")
    return layers, heads, n_embd


def _attention_layout(
    path: str, arch: str, meta: dict[str, Any], layers: int
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(sliding_window, swa_layers, kv_heads_per_layer)`` as llama.cpp's loader reads them for ``arch``."""
    a = arch
    window_default = _SLIDING_WINDOW_DEFAULTS[arch]
    sliding_window = (
        0 if window_default is None
        else _int(meta, f"{a}.attention.sliding_window", path, default=window_default)
    )

    per_layer = meta.get(f"{a}.attention.head_count_kv")
    kv_heads_per_layer = (
        tuple(per_layer) if isinstance(per_layer, list) and len(per_layer) == layers
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in per_layer) else ()
    )
    pattern = meta.get(f"{a}.attention.sliding_window_pattern", _SWA_PATTERN_DEFAULTS.get(arch, 0))
    if not (isinstance(pattern, list) or (isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0)):
        raise InvalidArtifactError(
            f"{path}: metadata '{a}.attention.sliding_window_pattern' must be a non-negative integer or "
            f"a list of per-layer flags, got {pattern!r}"
        )
    return sliding_window, sliding_window_layers(layers, sliding_window, pattern), kv_heads_per_layer


def _token_text(meta: dict[str, Any], tokens: Any, key: str, h: Header) -> str | None:
    """The text of the token whose id ``meta[key]`` holds, or None (no vocabulary, bad id, unreadable)."""
    tid = meta.get(key)
    if isinstance(tokens, StringArray) and isinstance(tid, int) and not isinstance(tid, bool):
        try:
            return h.string_at(tokens, tid)
        except (Truncated, ValueError):
            return None
    return None


def _embedded_template(path: str, meta: dict[str, Any]) -> str | None:
    """``tokenizer.chat_template``, None when absent or empty; one too long to decode is an error."""
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, LongString):
        raise InvalidArtifactError(
            f"{path}: tokenizer.chat_template is {template.length} bytes; at most {MAX_DECODED_STRING} are admitted"
        )
    template = template if isinstance(template, str) else None
    return template if template else None


def inspect_adapter(path: os.PathLike[str] | str) -> AdapterFacts:
    """Read a LoRA adapter GGUF's header; return its :class:`AdapterFacts`.

    Raises :class:`AdapterError` (``field`` names the key or tensor) unless the
    file is a readable GGUF with ``general.type = adapter``, ``adapter.type =
    lora``, an architecture, and only complete, consistent ``lora_a``/``lora_b``
    2-D pairs (llama.cpp's own rules). Matching the pairs against a base model
    is :func:`aner_nb.llm.adapters.check_targets`.
    """
    try:
        p, st = regular_file(path, "adapter")
        with open_gguf(p, st, "adapter") as g:
            meta, size, version, tensors, tensor_bytes = g.meta, g.size, g.version, g.tensors, g.tensor_bytes
    except AdapterError:
        raise
    except InvalidArtifactError as exc:
        raise AdapterError(f"adapter_file: {exc}", field="adapter_file") from None

    gtype = _str(meta, "general.type")
    if gtype != "adapter":
        what = "a model" if gtype in (None, "model") else f"general.type = {gtype!r}"
        raise AdapterError(
            f"{p} is {what}, not an adapter: general.type must be 'adapter' (got {gtype!r}); "
            "adapter_file must name a LoRA adapter GGUF, not a model",
            field="general.type",
        )
    atype = _str(meta, "adapter.type")
    if atype != "lora":
        raise AdapterError(
            f"{p}: adapter.type must be 'lora' (got {atype!r}); only LoRA adapters are supported",
            field="adapter.type",
        )
    arch = _str(meta, "general.architecture")
    if not arch:
        raise AdapterError(f"{p}: missing required metadata key 'general.architecture'", field="general.architecture")
    alpha = meta.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0.0:
        raise AdapterError(f"{p}: adapter.lora.alpha must be a non-negative number, got {alpha!r}", field="adapter.lora.alpha")
    return AdapterFacts(
        path=p, file_size=size, gguf_version=version, architecture=arch,
        name=_str(meta, "general.name") or Path(p).stem, adapter_type=atype, alpha=float(alpha),
        pairs=_lora_pairs(p, tensors), tensor_bytes=tensor_bytes,
    )


def _lora_pairs(path: str, tensors: TensorShapes) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]:
    """Group ``X.lora_a``/``X.lora_b`` into (X, a shape, b shape), checking what llama.cpp checks."""
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, dims in tensors:
        suffix = next((s for s in LORA_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            if name.endswith("_norm.weight"):
                continue  # llama.cpp ignores norm vectors in adapters
            raise AdapterError(
                f"{path}: tensor {name!r} is not a LoRA tensor; adapter tensors must end in "
                + " or ".join(LORA_SUFFIXES),
                field=name,
            )
        if len(dims) != 2:
            raise AdapterError(f"{path}: LoRA tensor {name!r} has {len(dims)} dimensions; expected 2", field=name)
        halves.setdefault(name[: -len(suffix)], {})[suffix] = dims
    pairs = []
    for target, parts in halves.items():
        missing = [s for s in LORA_SUFFIXES if s not in parts]
        if missing:
            raise AdapterError(
                f"{path}: LoRA pair of {target!r} is missing {target + missing[0]!r}; every target needs "
                "both lora_a and lora_b",
                field=target + missing[0],
            )
        pairs.append((target, parts[".lora_a"], parts[".lora_b"]))
    if not pairs:
        raise AdapterError(f"{path}: the adapter has no lora_a/lora_b tensors", field="tensors")
    return tuple(pairs)


def sha256_file(
    path: os.PathLike[str] | str,
    *,
    progress: Any = None,
    chunk_size: int = 1024 * 1024,
) -> str:
    """Hex SHA-256 of a file, streamed in ``chunk_size`` pieces.

    ``progress``: ``True`` always shows a ``tqdm.auto`` bar (a widget in Jupyter,
    text on a terminal), ``False`` never, ``None`` (default) only when interactive
    (see :mod:`aner_nb.llm.progress`); or an open bar (anything with
    ``update(n)``) that the caller owns and closes, as ``load()`` passes for
    the pass that runs on a worker thread.
    """
    from .progress import progress_bar

    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    p, st = regular_file(path)
    digest = hashlib.sha256()
    if progress is None or isinstance(progress, bool):
        bar = progress_bar(progress, total=st.st_size, desc=f"sha256 {os.path.basename(p)}",
                           unit="B", unit_scale=True, unit_divisor=1024)
        owned = True
    else:
        bar, owned = progress, False
    # read() rather than mmap: a file truncated while it is hashed must raise, not SIGBUS the kernel.
    buf = bytearray(chunk_size)
    view = memoryview(buf)
    try:
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                digest.update(view[:n])
                bar.update(n)
    except OSError as exc:
        raise InvalidArtifactError(f"cannot read model file {p}: {exc.strerror or exc}") from None
    finally:
        view.release()
        if owned:
            bar.close()
    return digest.hexdigest()
