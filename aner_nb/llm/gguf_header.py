"""The bounded GGUF header reader: metadata key/values and tensor infos over a read-only map.

The header is parsed here rather than with ``gguf.GGUFReader``: the reader
materialises every element of every metadata array as numpy objects, which
takes seconds for a 262,144-token vocabulary, whereas admission must be fast
(tens of milliseconds) and must treat hostile headers (huge counts, lengths
past the end of the file) as errors, not as exceptions from deep inside numpy.
Every size is checked against the file before anything is read or allocated,
and the header's own size is capped (65,536 key/values and tensors, 2**22
string-array elements, decoded strings 1 MiB each and 4 MiB in all, longer
ones kept as a location), so one inspection stays bounded in time and memory
whatever the file claims (``tests/test_fuzz_gguf.py``, ``fuzz/``). The
``gguf`` package still supplies the format constants (value types, tensor
types and their block sizes). Admitting a model from what it reads is
``artifact.py``.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import InvalidArtifactError

__all__ = [
    "GGUF_MAGIC",
    "MAX_DECODED_STRING",
    "SUPPORTED_GGUF_VERSIONS",
    "Header",
    "LongString",
    "Parsed",
    "SkippedArray",
    "StringArray",
    "TensorShapes",
    "TensorTypes",
    "Truncated",
    "open_gguf",
    "read_header",
    "regular_file",
]

SUPPORTED_GGUF_VERSIONS = (2, 3)

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS

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
# Metadata strings are decoded up to this size each and this much in all; longer ones (an embedded
# tokenizer.huggingface.json) are kept as a location, never copied out of the map.
MAX_DECODED_STRING = 1 << 20
_DECODED_STRING_BUDGET = 4 << 20


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, kept as a location in the file."""

    offset: int                      # first element (its u64 length)
    count: int
    checkpoints: tuple[int, ...]     # offset of element i * _STRING_CHECKPOINT


@dataclass(frozen=True)
class LongString:
    """A metadata string too long to decode at inspection: only its location and size are kept."""

    offset: int
    length: int


@dataclass(frozen=True)
class SkippedArray:
    """A long numeric metadata array: only its type and length are kept."""

    item_type: GGUFValueType
    count: int


class Truncated(Exception):
    """Internal: a read ran past the end of the file."""


class Header:
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
            raise Truncated(off)

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
            raise Truncated(off) from None
        if off > size:
            raise Truncated(off)
        return off, tuple(checkpoints)

    def string_at(self, arr: StringArray, index: int) -> str | None:
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
            if n > min(MAX_DECODED_STRING, self.string_budget):
                return LongString(off + 8, n), off + 8 + n
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
                return StringArray(off, count, checkpoints), end
            if item == GGUFValueType.ARRAY:
                raise ValueError(f"metadata {key!r} is a nested array, which GGUF models do not use")
            width = _SCALAR_SIZES[item]
            self.need(off, width * count)
            if count <= _MAX_DECODED_ARRAY:
                values = struct.unpack_from(f"{self.e}{count}{_SCALAR_FORMATS[item]}", self.buf, off)
                return list(values), off + width * count
            return SkippedArray(item, count), off + width * count
        raise ValueError(f"metadata {key!r} has unknown value type {int(vtype)}")


def regular_file(path: os.PathLike[str] | str, kind: str = "model") -> tuple[str, os.stat_result]:
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


def read_header(
    path: str, buf: mmap.mmap, size: int, endian: str
) -> tuple[dict[str, Any], int, TensorShapes, TensorTypes, Header]:
    """Parse key/values and tensor infos; return (metadata, tensor_bytes, shapes, types, reader)."""
    h = Header(buf, size, endian)
    n_tensors = h.u64(8)
    n_kv = h.u64(16)
    off = 24
    # every key/value needs >= 13 bytes, every tensor info >= 24: cheap sanity bounds
    if n_kv * 13 > size or n_tensors * 24 > size:
        raise Truncated(off)
    if n_kv > _MAX_KV or n_tensors > _MAX_TENSORS:
        raise ValueError(
            f"the header declares {n_kv} metadata entries and {n_tensors} tensors; at most "
            f"{_MAX_KV} and {_MAX_TENSORS} are admitted"
        )
    meta, off = _read_metadata(h, off, n_kv)
    infos, shapes, types, off = _read_tensor_infos(h, off, n_tensors)
    total = _tensor_data_bytes(path, size, meta, off, infos)
    return meta, total, tuple(shapes), tuple(types), h


def _read_metadata(h: Header, off: int, n_kv: int) -> tuple[dict[str, Any], int]:
    """The ``n_kv`` key/values from ``off``; returns them and the offset after them."""
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
    return meta, off


def _read_tensor_infos(
    h: Header, off: int, n_tensors: int
) -> tuple[list[tuple[str, int, int]], list[tuple[str, tuple[int, ...]]], list[tuple[str, str]], int]:
    """The ``n_tensors`` tensor infos from ``off``: (name, data offset, bytes), shapes, types, end offset."""
    infos = []
    shapes: list[tuple[str, tuple[int, ...]]] = []
    types: list[tuple[str, str]] = []
    names = set()
    for _ in range(n_tensors):
        name, off = h.string(off, what="tensor name", limit=_MAX_NAME_BYTES)
        dims, off = _tensor_dims(h, off, name)
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
    return infos, shapes, types, off


def _tensor_dims(h: Header, off: int, name: str) -> tuple[tuple[int, ...], int]:
    """A tensor info's dimension count and dimensions at ``off``; returns them and the offset after."""
    n_dims = h.u32(off)
    off += 4
    if not 1 <= n_dims <= _MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {n_dims} dimensions (1..{_MAX_DIMS} allowed)")
    h.need(off, 8 * n_dims)
    dims = struct.unpack_from(f"{h.e}{n_dims}Q", h.buf, off)
    return dims, off + 8 * n_dims


def _tensor_data_bytes(
    path: str, size: int, meta: dict[str, Any], off: int, infos: list[tuple[str, int, int]]
) -> int:
    """The tensors' total bytes, each checked to end within the file (data starts aligned after ``off``)."""
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
    return total


@dataclass(frozen=True)
class Parsed:
    """A parsed GGUF header; ``header`` reads strings lazily while the map is open."""

    size: int
    version: int
    meta: dict[str, Any]
    tensor_bytes: int
    tensors: TensorShapes
    tensor_types: TensorTypes
    header: Header


@contextmanager
def open_gguf(p: str, st: os.stat_result, kind: str = "model") -> Iterator[Parsed]:
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
                    meta, tensor_bytes, tensors, types, h = read_header(p, buf, size, endian)
                except Truncated as exc:
                    raise InvalidArtifactError(
                        f"truncated or corrupted GGUF file {p}: header runs past the end of the "
                        f"file ({size} bytes) near byte {exc.args[0]}"
                    ) from None
                except (ValueError, OverflowError, struct.error) as exc:
                    if isinstance(exc, InvalidArtifactError):
                        raise
                    raise InvalidArtifactError(f"corrupted GGUF file {p}: {exc}") from None
                yield Parsed(size, version, meta, tensor_bytes, tensors, types, h)
    except OSError as exc:
        raise InvalidArtifactError(f"cannot read {kind} file {p}: {exc.strerror or exc}") from None
