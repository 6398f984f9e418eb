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

The header is parsed here rather than with ``gguf.GGUFReader``: the reader
materialises every element of every metadata array as numpy objects, which
takes seconds for a 262,144-token vocabulary, whereas admission must be fast
(tens of milliseconds) and must treat hostile headers (huge counts, lengths
past the end of the file) as errors, not as exceptions from deep inside numpy.
Every size is checked against the file before anything is read or allocated,
and the header's own size is capped (65,536 key/values and tensors, 2**22
string-array elements, 512 layers, decoded strings 1 MiB each and 4 MiB in all,
longer ones kept as a location), so one inspection stays bounded in time and
memory whatever the file claims (``tests/test_fuzz_gguf.py``, ``fuzz/``).
The ``gguf`` package still supplies the format constants (value types, tensor
types and their block sizes).

:func:`sha256_file` streams a file through SHA-256 with an optional ``tqdm``
progress bar.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import stat
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import AdapterError, InvalidArtifactError, UnsupportedModelError
from .memory import sliding_window_layers

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_GGUF_VERSIONS",
    "ModelFacts",
    "AdapterFacts",
    "TensorShapes",
    "inspect_model",
    "inspect_adapter",
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
SUPPORTED_GGUF_VERSIONS = (2, 3)

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_PROJECTOR_TYPES = ("mmproj", "clip", "projector")
_PROJECTOR_ARCHS = ("clip", "mmproj")
LORA_SUFFIXES = (".lora_a", ".lora_b")

# (tensor name, ggml dims ne[0..n)) in file order; ne[0] is the row length (input features).
TensorShapes = tuple[tuple[str, tuple[int, ...]], ...]
TensorTypes = tuple[tuple[str, str], ...]  # (tensor name, ggml type name such as "Q8_0")

# value type -> struct format character (scalars)
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_SCALAR_SIZES = {t: struct.calcsize("<" + f) for t, f in _SCALAR_FORMATS.items()}
# Numeric arrays up to this many elements are decoded; longer ones (scores,
# token types) are skipped and represented by their length only.
_MAX_DECODED_ARRAY = 4096
# Every Nth string of a string array records its offset, so a token text can
# be found later without walking the whole array again.
_STRING_CHECKPOINT = 1024
# Bounds that keep one inspection fast and small whatever the file's size (a hostile header with
# honest counts could otherwise hold a hundred million key/values or string elements). Real models
# stay far below: ~50 key/values, a few thousand tensors, ~1 M strings (vocabulary plus merges).
_MAX_KV = 65_536
_MAX_TENSORS = 65_536
_MAX_STRING_ELEMENTS = 1 << 22   # over all string arrays of the header
_MAX_KEY_BYTES = 65_535
_MAX_NAME_BYTES = 63             # GGML_MAX_NAME - 1: llama.cpp refuses longer tensor names
_MAX_LAYERS = 512                # LLAMA_MAX_LAYERS: llama.cpp refuses larger block counts
# Metadata strings are decoded up to this size each and this much in all; longer ones (an embedded
# tokenizer.huggingface.json) are kept as a location, never copied out of the map.
_MAX_DECODED_STRING = 1 << 20
_DECODED_STRING_BUDGET = 4 << 20


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


@dataclass(frozen=True)
class _StringArray:
    """A metadata array of strings, kept as a location in the file."""

    offset: int                      # first element (its u64 length)
    count: int
    checkpoints: tuple[int, ...]     # offset of element i * _STRING_CHECKPOINT


@dataclass(frozen=True)
class _LongString:
    """A metadata string too long to decode at inspection: only its location and size are kept."""

    offset: int
    length: int


@dataclass(frozen=True)
class _SkippedArray:
    """A long numeric metadata array: only its type and length are kept."""

    item_type: GGUFValueType
    count: int


class _Truncated(Exception):
    """Internal: a read ran past the end of the file."""


class _Header:
    """Bounds-checked reader of a GGUF header over a memory map."""

    def __init__(self, buf: mmap.mmap, size: int, endian: str) -> None:
        self.buf = buf
        self.size = size
        self.e = endian
        self._u64 = struct.Struct(endian + "Q").unpack_from
        self._u32 = struct.Struct(endian + "I").unpack_from
        self.string_budget = _DECODED_STRING_BUDGET
        self.string_elements = _MAX_STRING_ELEMENTS

    def need(self, off: int, n: int) -> None:
        if n < 0 or off + n > self.size:
            raise _Truncated(off)

    def u32(self, off: int) -> int:
        self.need(off, 4)
        return self._u32(self.buf, off)[0]

    def u64(self, off: int) -> int:
        self.need(off, 8)
        return self._u64(self.buf, off)[0]

    def string(self, off: int, *, what: str, limit: int | None = None) -> tuple[str, int]:
        """Decode the string at ``off``; longer than ``limit`` bytes is an error."""
        n = self.u64(off)
        off += 8
        self.need(off, n)
        if limit is not None and n > limit:
            raise ValueError(f"{what} is {n} bytes long; at most {limit} are allowed")
        raw = self.buf[off : off + n]
        try:
            return raw.decode("utf-8"), off + n
        except UnicodeDecodeError as exc:
            raise ValueError(f"{what} is not valid UTF-8") from exc

    def scalar(self, off: int, vtype: GGUFValueType) -> tuple[Any, int]:
        n = _SCALAR_SIZES[vtype]
        self.need(off, n)
        return struct.unpack_from(self.e + _SCALAR_FORMATS[vtype], self.buf, off)[0], off + n

    def skip_strings(self, off: int, count: int) -> tuple[int, tuple[int, ...]]:
        """Walk ``count`` length-prefixed strings; return the end and checkpoints."""
        # each element needs at least its 8-byte length: reject absurd counts at once
        self.need(off, 8 * count)
        if count > self.string_elements:
            raise ValueError(
                f"the header's string arrays hold more than {_MAX_STRING_ELEMENTS} elements in all "
                f"(this one declares {count})"
            )
        self.string_elements -= count
        u64, buf, size = self._u64, self.buf, self.size
        checkpoints = []
        try:
            for start in range(0, count, _STRING_CHECKPOINT):
                checkpoints.append(off)
                for _ in range(min(_STRING_CHECKPOINT, count - start)):
                    off += 8 + u64(buf, off)[0]
        except struct.error:
            raise _Truncated(off) from None
        if off > size:
            raise _Truncated(off)
        return off, tuple(checkpoints)

    def string_at(self, arr: _StringArray, index: int) -> str | None:
        if not 0 <= index < arr.count:
            return None
        off = arr.checkpoints[index // _STRING_CHECKPOINT]
        for _ in range(index % _STRING_CHECKPOINT):
            off += 8 + self.u64(off)
        text, _ = self.string(off, what=f"token {index}")
        return text

    def value(self, off: int, vtype: GGUFValueType, key: str) -> tuple[Any, int]:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(off, vtype)
        if vtype == GGUFValueType.STRING:
            n = self.u64(off)
            self.need(off + 8, n)
            if n > min(_MAX_DECODED_STRING, self.string_budget):
                return _LongString(off + 8, n), off + 8 + n
            self.string_budget -= n
            return self.string(off, what=f"metadata value of {key!r}")
        if vtype == GGUFValueType.ARRAY:
            item_raw = self.u32(off)
            count = self.u64(off + 4)
            off += 12
            try:
                item = GGUFValueType(item_raw)
            except ValueError:
                raise ValueError(f"metadata array {key!r} has unknown item type {item_raw}") from None
            if item == GGUFValueType.STRING:
                end, checkpoints = self.skip_strings(off, count)
                return _StringArray(off, count, checkpoints), end
            if item == GGUFValueType.ARRAY:
                raise ValueError(f"metadata {key!r} is a nested array, which GGUF models do not use")
            width = _SCALAR_SIZES[item]
            self.need(off, width * count)
            if count <= _MAX_DECODED_ARRAY:
                values = struct.unpack_from(f"{self.e}{count}{_SCALAR_FORMATS[item]}", self.buf, off)
                return list(values), off + width * count
            return _SkippedArray(item, count), off + width * count
        raise ValueError(f"metadata {key!r} has unknown value type {int(vtype)}")


def _regular_file(path: os.PathLike[str] | str, kind: str = "model") -> tuple[str, os.stat_result]:
    try:
        p = os.fspath(path)
    except TypeError:
        raise InvalidArtifactError(f"{kind} path must be a str or os.PathLike, got {type(path).__name__}") from None
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise InvalidArtifactError(f"{kind} file not found: {p}") from None
    except OSError as exc:
        raise InvalidArtifactError(f"cannot access {kind} file {p}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise InvalidArtifactError(f"{kind} path {p} is {what}; expected a single .gguf file")
    return p, st


def _check_magic_and_version(path: str, head: bytes) -> tuple[int, str]:
    """Return ``(version, struct endianness prefix)`` or raise."""
    if len(head) < 4 or head[:4] != GGUF_MAGIC:
        raise InvalidArtifactError(
            f"not a GGUF file: {path}: magic {bytes(head[:4])!r}, expected {GGUF_MAGIC!r}"
        )
    if len(head) < 8:
        raise InvalidArtifactError(f"truncated GGUF file {path}: {len(head)} bytes, no version field")
    little = struct.unpack_from("<I", head, 4)[0]
    big = struct.unpack_from(">I", head, 4)[0]
    # a file written on the other byte order reads as version << 16 and more
    if little & 0xFFFF == 0 and big & 0xFFFF != 0:
        version, endian = big, ">"
    else:
        version, endian = little, "<"
    if version not in SUPPORTED_GGUF_VERSIONS:
        raise InvalidArtifactError(
            f"unsupported GGUF version {version} in {path}; supported versions: "
            + ", ".join(map(str, SUPPORTED_GGUF_VERSIONS))
        )
    return version, endian


def _read_header(
    path: str, buf: mmap.mmap, size: int, endian: str
) -> tuple[dict[str, Any], int, TensorShapes, TensorTypes, _Header]:
    """Parse key/values and tensor infos; return (metadata, tensor_bytes, shapes, types, reader)."""
    h = _Header(buf, size, endian)
    n_tensors = h.u64(8)
    n_kv = h.u64(16)
    off = 24
    # every key/value needs >= 13 bytes, every tensor info >= 24: cheap sanity bounds
    if n_kv * 13 > size or n_tensors * 24 > size:
        raise _Truncated(off)
    if n_kv > _MAX_KV or n_tensors > _MAX_TENSORS:
        raise ValueError(
            f"the header declares {n_kv} metadata entries and {n_tensors} tensors; at most "
            f"{_MAX_KV} and {_MAX_TENSORS} are admitted"
        )
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key, off = h.string(off, what="metadata key", limit=_MAX_KEY_BYTES)
        raw_type = h.u32(off)
        off += 4
        try:
            vtype = GGUFValueType(raw_type)
        except ValueError:
            raise ValueError(f"metadata {key!r} has unknown value type {raw_type}") from None
        value, off = h.value(off, vtype, key)
        if key in meta:
            raise ValueError(f"duplicate metadata key {key!r}")
        meta[key] = value

    infos = []
    shapes: list[tuple[str, tuple[int, ...]]] = []
    types: list[tuple[str, str]] = []
    names = set()
    for _ in range(n_tensors):
        name, off = h.string(off, what="tensor name", limit=_MAX_NAME_BYTES)
        n_dims = h.u32(off)
        off += 4
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (1..{_MAX_DIMS} allowed)")
        h.need(off, 8 * n_dims)
        dims = struct.unpack_from(f"{endian}{n_dims}Q", buf, off)
        off += 8 * n_dims
        raw_type = h.u32(off)
        t_off = h.u64(off + 4)
        off += 12
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        n_elems = 1
        for d in dims:
            n_elems *= d
        if n_elems >= 1 << 63 or any(d >= 1 << 63 for d in dims):  # llama.cpp reads ne as int64_t
            raise ValueError(f"tensor {name!r} has dimensions {list(dims)}, beyond what ggml can address")
        if dims[0] % block:
            raise ValueError(f"tensor {name!r}: row of {dims[0]} elements is not a multiple of block size {block}")
        if name in names:
            raise ValueError(f"duplicate tensor {name!r}")
        names.add(name)
        infos.append((name, t_off, n_elems // block * type_size))
        shapes.append((name, tuple(int(d) for d in dims)))
        types.append((name, ggml_type.name))

    alignment = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")
    data_offset = off + (-off % alignment)
    total = 0
    for name, t_off, nbytes in infos:
        end = data_offset + t_off + nbytes
        if end > size:
            raise InvalidArtifactError(
                f"truncated GGUF file {path}: tensor {name!r} ends at byte {end} "
                f"but the file has {size} bytes"
            )
        total += nbytes
    return meta, total, tuple(shapes), tuple(types), h


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
    p, st = _regular_file(path)
    shard = _SPLIT_NAME.search(os.path.basename(p))
    if shard and int(shard.group(2)) != 1:  # "-00001-of-00001" is a whole model
        raise UnsupportedModelError(
            f"{p} is named like a shard of a split GGUF (*-NNNNN-of-NNNNN.gguf); only single-file "
            "GGUF models are admitted: merge the shards first with "
            "`llama-gguf-split --merge FIRST-SHARD.gguf OUT.gguf`"
        )
    with _open_gguf(p, st) as g:
        arch = _admit(p, g.meta)
        return _facts(p, g.size, g.version, arch, g.meta, g.tensor_bytes, g.tensors, g.tensor_types, g.header)


@dataclass(frozen=True)
class _Parsed:
    """A parsed GGUF header; ``header`` reads strings lazily while the map is open."""

    size: int
    version: int
    meta: dict[str, Any]
    tensor_bytes: int
    tensors: TensorShapes
    tensor_types: TensorTypes
    header: _Header


@contextmanager
def _open_gguf(p: str, st: os.stat_result, kind: str = "model") -> Iterator[_Parsed]:
    """Check magic and version, parse the header over a read-only map; errors are typed."""
    size = st.st_size
    try:
        with open(p, "rb") as f:
            head = f.read(24)
            version, endian = _check_magic_and_version(p, head)
            if len(head) < 24:
                raise InvalidArtifactError(f"truncated GGUF file {p}: {size} bytes, header needs 24")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                size = len(buf)
                try:
                    meta, tensor_bytes, tensors, types, h = _read_header(p, buf, size, endian)
                except _Truncated as exc:
                    raise InvalidArtifactError(
                        f"truncated or corrupted GGUF file {p}: header runs past the end of the "
                        f"file ({size} bytes) near byte {exc.args[0]}"
                    ) from None
                except (ValueError, OverflowError, struct.error) as exc:
                    if isinstance(exc, InvalidArtifactError):
                        raise
                    raise InvalidArtifactError(f"corrupted GGUF file {p}: {exc}") from None
                yield _Parsed(size, version, meta, tensor_bytes, tensors, types, h)
    except OSError as exc:
        raise InvalidArtifactError(f"cannot read {kind} file {p}: {exc.strerror or exc}") from None


def _facts(
    path: str, size: int, version: int, arch: str, meta: dict[str, Any], tensor_bytes: int,
    tensors: TensorShapes, tensor_types: TensorTypes, h: _Header,
) -> ModelFacts:
    a = arch
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
    kv_heads = _int(meta, f"{a}.attention.head_count_kv", path, default=heads)
    head_dim_k = _int(meta, f"{a}.attention.key_length", path, default=n_embd // heads)
    head_dim_v = _int(meta, f"{a}.attention.value_length", path, default=n_embd // heads)
    context_length = _int(meta, f"{a}.context_length", path)
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
    swa_layers = sliding_window_layers(layers, sliding_window, pattern)

    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, _StringArray):
        vocab_size = tokens.count
    else:
        vocab_size = _int(meta, f"{a}.vocab_size", path, default=0)

    def token_text(key: str) -> str | None:
        tid = meta.get(key)
        if isinstance(tokens, _StringArray) and isinstance(tid, int) and not isinstance(tid, bool):
            try:
                return h.string_at(tokens, tid)
            except (_Truncated, ValueError):
                return None
        return None

    template = meta.get("tokenizer.chat_template")
    if isinstance(template, _LongString):
        raise InvalidArtifactError(
            f"{path}: tokenizer.chat_template is {template.length} bytes; at most {_MAX_DECODED_STRING} are admitted"
        )
    template = template if isinstance(template, str) else None
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
        chat_template=template if template else None,
        bos_token=token_text("tokenizer.ggml.bos_token_id"),
        eos_token=token_text("tokenizer.ggml.eos_token_id"),
        tensor_bytes=tensor_bytes,
        tensors=tensors,
        tensor_types=tensor_types,
        kv_heads_per_layer=kv_heads_per_layer,
        swa_layers=swa_layers,
    )


def inspect_adapter(path: os.PathLike[str] | str) -> AdapterFacts:
    """Read a LoRA adapter GGUF's header; return its :class:`AdapterFacts`.

    Raises :class:`AdapterError` (``field`` names the key or tensor) unless the
    file is a readable GGUF with ``general.type = adapter``, ``adapter.type =
    lora``, an architecture, and only complete, consistent ``lora_a``/``lora_b``
    2-D pairs (llama.cpp's own rules). Matching the pairs against a base model
    is :func:`aner_nb.llm.adapters.check_targets`.
    """
    try:
        p, st = _regular_file(path, "adapter")
        with _open_gguf(p, st, "adapter") as g:
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
    p, st = _regular_file(path)
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
