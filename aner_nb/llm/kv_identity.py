"""What makes saved KV valid for a context, and a bounded, checksummed file format for it.

Pure Python (no engine import): the prefix tiers and saved conversations stamp
every serialised sequence state (``NativeContext.seq_state_bytes``) with a
:class:`KVIdentity` and refuse, with :class:`~aner_nb.llm.errors.StateMismatchError`
and one ``reason`` of :data:`REASONS`, anything that does not match the context
it would be loaded into: another model, adapter, llama.cpp build, KV type or
context layout, a newer format, a corrupt or truncated file. Nothing reaches
native code before every check has passed.

File layout (little endian)::

    MAGIC (8 bytes) | header length (u32) | header (JSON, UTF-8) | SHA-256 of the header (32 bytes)
    | tokens (int32 x n_tokens) | meta (meta_bytes) | logits (logits_bytes) | payload (payload_bytes)

The header names the format version, the identity, ``n_tokens``,
``payload_bytes``, ``meta_bytes`` (a JSON document of the caller's: a
conversation's history), ``logits_bytes`` (format 3: the float32 logits of the
last token's row, kept with a whole prompt so that asking it again evaluates
nothing; 0 when absent) and a checksum of the tokens, meta, logits and payload.
Every size is capped (:data:`MAX_HEADER_BYTES`, :data:`MAX_TOKENS`,
:data:`MAX_LOGITS_BYTES`, a payload cap) and checked before anything of that
size is allocated or read.

The body checksum detects corruption (a torn copy, a flipped bit), not forgery:
anyone who can write the directory can write a matching header, so it need not be
cryptographic. Formats 2 and 3 use xxh3-128 (``body_xxh3_128``; ~2 ms on a 40 MB
state, where SHA-256 took ~25-55 ms and dominated a restore); format 1 files
(``body_sha256``) and format 2 files (no logits) are still read.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import mmap
import os
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence

import xxhash

from .errors import StateMismatchError

__all__ = [
    "pack_in_place",
    "open_regular",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_TOKENS",
    "MAX_META_BYTES",
    "MAX_LOGITS_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "REASONS",
    "KVIdentity",
    "Unpacked",
    "pack",
    "unpack",
    "unpack_full",
    "read_file",
    "write_atomic",
    "write_cache_file",
]

FORMAT_VERSION = 3
MAGIC = b"ANERKV\r\n"  # CR LF: a text-mode copy that rewrites line ends breaks the magic, not the payload
MAX_HEADER_BYTES = 16 * 1024
MAX_TOKENS = 1 << 20  # 16 sequences of the largest admitted context (65,536)
MAX_META_BYTES = 16 * 1024 * 1024
MAX_LOGITS_BYTES = 4 * (1 << 22)  # one float32 row of a vocabulary of up to 4M tokens (Gemma 3: 262,144)
DEFAULT_MAX_PAYLOAD_BYTES = 16 * 1024**3

# Why a stored state was refused (StateMismatchError.reason); callers count skips by these.
REASONS = (
    "corrupt",  # bad magic, malformed header, checksum mismatch, trailing bytes, a size above a cap
    "truncated",  # the file ends before its declared sizes
    "foreign_model",  # written for another model file (SHA-256)
    "foreign_adapter",  # written with another LoRA adapter, or with one where there is none (or vice versa)
    "foreign_build",  # written by another llama.cpp build
    "foreign_kv_type",  # another K or V cache type
    "newer_format",  # a format version this code does not know
    "layout",  # another context layout (cells, sequences, unified streams, flash attention, SWA)
    "sliding_window",  # a restored sliding-window state kept shorter than its last token (see partial_reuse)
)

_PREFIX = struct.Struct("<8sI")
_DIGEST = 32  # the header's own SHA-256 (a few hundred bytes: its cost does not matter)


# Format version -> (the header's body-checksum field, a new hasher, the hex digest's length).
_BODY_DIGESTS: dict[int, tuple[str, Callable[[], Any], int]] = {
    1: ("body_sha256", hashlib.sha256, 64),
    2: ("body_xxh3_128", xxhash.xxh3_128, 32),
    3: ("body_xxh3_128", xxhash.xxh3_128, 32),
}
_LOGITS_SINCE = 3  # the first format whose header has logits_bytes


@dataclass(frozen=True)
class KVIdentity:
    """Everything that must be equal for a saved sequence state to be valid in a context.

    ``n_swa`` is the model's sliding window (0: none) and ``swa_full`` whether the
    context keeps the full SWA cache. ``state`` names the llama.cpp state the
    payload is: ``"sequence"`` (``llama_state_seq_*``: a sliding-window state
    holds only the window of its last position, so it restores exactly only when
    reused from its end or its last token: :meth:`min_keep`, :meth:`check_reuse`)
    or ``"all_cells"`` (the same format holding every cell of a one-sequence
    context with the full SWA cache, loaded back into the cells it was evaluated in).
    """

    model_sha256: str
    adapter_sha256: str | None
    type_k: str
    type_v: str
    n_ctx: int
    n_seq_max: int
    kv_unified: bool
    flash_attention: str
    n_swa: int
    swa_full: bool
    build: str
    state: str = "sequence"

    @property
    def partial_reuse(self) -> bool:
        """Whether a restored state may be trimmed to any shorter prefix of its tokens.

        Measured on llama-cpp-python 0.3.36 (tests/test_kv_identity.py): the
        per-sequence state of a sliding-window model holds only the SWA cells of
        its last window (positions ``n - n_swa .. n - 1``), with or without
        ``swa_full``. A restored state therefore continues exactly from its end
        (``keep == n``) or after replaying its last token (``keep == n - 1``: that
        position's window is all there), and nothing shorter: a removal below
        that succeeds in llama.cpp but leaves a window with holes, and the logits
        differ. Models without a window keep every position, and so does a
        state of every cell (``state == "all_cells"``), cell for cell.
        """
        return self.n_swa == 0 or self.state == "all_cells"

    def min_keep(self, saved_tokens: int) -> int:
        """The fewest of ``saved_tokens`` restored positions a request may keep (then evaluate from there)."""
        return 0 if self.partial_reuse else max(saved_tokens - 1, 0)

    def check_reuse(self, saved_tokens: int, keep: int) -> None:
        """Refuse (``reason="sliding_window"``) keeping ``keep`` of ``saved_tokens`` restored positions when the
        restored state cannot give exact logits from there (see :attr:`partial_reuse`)."""
        if keep < self.min_keep(saved_tokens):
            raise StateMismatchError(
                f"a restored sliding-window state (window {self.n_swa}) holds only the cells of its last window: "
                f"it continues from its {saved_tokens} saved tokens (or replays the last one) but cannot be "
                f"trimmed to {keep}",
                reason="sliding_window",
            )

    def restored_ok(self, saved_tokens: int, pos_min: int, pos_max: int) -> bool:
        """Whether a sequence's ``seq_pos_min``/``seq_pos_max`` after ``seq_state_load`` are what a
        ``saved_tokens`` state must leave: every position, or (sliding window) at least the last window."""
        if pos_max != saved_tokens - 1:
            return False
        return pos_min == 0 if self.partial_reuse else 0 <= pos_min <= max(saved_tokens - self.n_swa, 0)

    @classmethod
    def for_context(cls, ctx: Any, *, model_sha256: str, adapter_sha256: str | None, build: str) -> "KVIdentity":
        """The identity of a ``NativeContext`` (duck-typed: ``params``, ``n_ctx``, ``model.n_swa``).

        ``build`` is ``_engine.engine_build()``; the caller passes it so this module stays pure.
        """
        params = ctx.params
        return cls(
            model_sha256=model_sha256,
            adapter_sha256=adapter_sha256,
            type_k=params.kv_cache_type,
            type_v=params.kv_cache_type,
            n_ctx=int(ctx.n_ctx),
            n_seq_max=int(params.n_seq_max),
            kv_unified=bool(params.kv_unified),
            flash_attention=str(params.flash_attention),
            n_swa=int(getattr(ctx.model, "n_swa", 0) or 0),
            swa_full=bool(params.swa_full),
            build=build,
            # a one-sequence context of a sliding-window model with the full SWA cache saves every cell
            state="all_cells" if getattr(params, "saves_all_cells", False) else "sequence",
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> "KVIdentity":
        """Parse a header's identity; a missing, extra or mistyped field is ``corrupt``."""
        if not isinstance(value, dict):
            raise StateMismatchError("the state header's identity is not an object", reason="corrupt")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if "state" not in value:  # written before states of every cell existed: a per-sequence state
            value = {**value, "state": "sequence"}
        if set(value) != set(fields):
            raise StateMismatchError("the state header's identity has missing or unknown fields", reason="corrupt")
        for name, expected in _FIELD_TYPES.items():
            item = value[name]
            ok = (
                (expected is str and isinstance(item, str))
                or (expected is int and isinstance(item, int) and not isinstance(item, bool))
                or (expected is bool and isinstance(item, bool))
                or (expected == "str|None" and (item is None or isinstance(item, str)))
            )
            if not ok:
                raise StateMismatchError(f"the state header's identity field {name!r} has the wrong type", reason="corrupt")
        return cls(**value)


_FIELD_TYPES: dict[str, Any] = {
    "model_sha256": str, "adapter_sha256": "str|None", "type_k": str, "type_v": str, "n_ctx": int,
    "n_seq_max": int, "kv_unified": bool, "flash_attention": str, "n_swa": int, "swa_full": bool, "build": str,
    "state": str,
}

# The order mismatches are reported in: the most telling first.
_CHECKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foreign_model", ("model_sha256",)),
    ("foreign_adapter", ("adapter_sha256",)),
    ("foreign_build", ("build",)),
    ("foreign_kv_type", ("type_k", "type_v")),
    ("layout", ("n_ctx", "n_seq_max", "kv_unified", "flash_attention", "n_swa", "swa_full", "state")),
)


def _check_identity(found: KVIdentity, expected: KVIdentity) -> None:
    for reason, names in _CHECKS:
        for name in names:
            a, b = getattr(found, name), getattr(expected, name)
            if a != b:
                raise StateMismatchError(
                    f"the saved state does not match this context: {name} is {_short(a)} in the file, "
                    f"{_short(b)} here",
                    reason=reason,
                )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Unpacked:
    """A verified state file: its identity, tokens, the caller's metadata, last-row logits and the native payload.

    ``payload`` and ``logits`` (float32 little endian, or None) are views into the
    bytes that were verified (no copy); they are valid as long as the ``Unpacked``
    is referenced. How many logits a row must have is the caller's check (the
    model's vocabulary).
    """

    identity: KVIdentity
    tokens: tuple[int, ...]
    meta: Any
    payload: memoryview
    logits: memoryview | None = None


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}i", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be int32: {exc}") from exc


def pack(
    identity: KVIdentity, tokens: Sequence[int], payload: bytes, *, meta: Any = None, logits: Any = None
) -> bytes:
    """One state file's bytes: ``identity``, the ``tokens`` the state holds, ``payload``, optional ``meta`` and
    ``logits``.

    ``meta`` is any JSON value (a saved conversation's history); ``logits`` the
    float32 row of the last token (anything with the buffer protocol). Sizes above
    the caps raise ``ValueError``: the writer never produces a file the reader would refuse.
    """
    token_bytes, meta_bytes, logit_bytes = _body_parts(tokens, len(payload), meta, logits)
    digest = _body_digest(FORMAT_VERSION, token_bytes, meta_bytes, logit_bytes, payload)
    front = _front(identity, len(tokens), meta_bytes, len(logit_bytes), len(payload), digest)
    return b"".join((front, token_bytes, meta_bytes, logit_bytes, payload))


def pack_in_place(
    identity: KVIdentity, tokens: Sequence[int], size: int, fill: Callable[[memoryview], int], *, logits: Any = None
) -> bytearray:
    """:func:`pack`'s bytes for a payload of ``size`` bytes that ``fill`` writes straight into them.

    ``fill(view)`` copies the payload into ``view`` and returns the bytes it
    wrote (llama.cpp's state copy): one allocation and one copy of a state of
    tens of megabytes instead of three (measured 60 ms a save on SmolLM2's 39 MB
    at 2 vCPUs, mostly page faults on new buffers). A short copy is packed at
    the size written.
    """
    token_bytes, meta_bytes, logit_bytes = _body_parts(tokens, size, None, logits)
    placeholder = "0" * _BODY_DIGESTS[FORMAT_VERSION][2]  # a hex digest's length is fixed: so is the front's
    lead = len(token_bytes) + len(logit_bytes)  # the body before the payload (no meta here)
    start = len(_front(identity, len(tokens), meta_bytes, len(logit_bytes), size, placeholder)) + lead
    out = bytearray(start + size)
    with memoryview(out) as view:
        with view[start:] as room:
            written = fill(room)
        if not 0 < written <= size:
            raise ValueError(f"the state copy wrote {written} of {size} bytes")
        with view[start : start + written] as payload:
            digest = _body_digest(FORMAT_VERSION, token_bytes, b"", logit_bytes, payload)
            front = _front(identity, len(tokens), meta_bytes, len(logit_bytes), written, digest)
            if len(front) + lead != start:  # the size written changed the header's length
                return bytearray(pack(identity, tokens, bytes(payload), logits=logit_bytes or None))
        view[: len(front)] = front
        view[len(front) : len(front) + len(token_bytes)] = token_bytes
        view[len(front) + len(token_bytes) : start] = logit_bytes
    del out[start + written :]  # no view is left: the buffer may shrink
    return out


def _body_parts(tokens: Sequence[int], payload_bytes: int, meta: Any, logits: Any = None) -> tuple[bytes, bytes, bytes]:
    """The token, metadata and logits bytes of a state file, checked against the caps (``ValueError``)."""
    logit_bytes = b"" if logits is None else bytes(memoryview(logits).cast("B"))
    if len(logit_bytes) % 4 or len(logit_bytes) > MAX_LOGITS_BYTES or (logits is not None and not logit_bytes):
        raise ValueError(f"logits must be 1..{MAX_LOGITS_BYTES // 4} float32 values, got {len(logit_bytes)} bytes")
    if len(tokens) > MAX_TOKENS:
        raise ValueError(f"{len(tokens)} tokens exceed the state file cap of {MAX_TOKENS}")
    if payload_bytes > DEFAULT_MAX_PAYLOAD_BYTES:
        raise ValueError(f"a {payload_bytes}-byte payload exceeds the cap of {DEFAULT_MAX_PAYLOAD_BYTES}")
    meta_bytes = b"" if meta is None else json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode()
    if len(meta_bytes) > MAX_META_BYTES:
        raise ValueError(f"{len(meta_bytes)} bytes of metadata exceed the cap of {MAX_META_BYTES}")
    return _tokens_bytes(tokens), meta_bytes, logit_bytes


def _front(
    identity: KVIdentity, n_tokens: int, meta_bytes: bytes, logits_bytes: int, payload_bytes: int, digest: str
) -> bytes:
    """Magic, header length, the JSON header and its SHA-256: everything before the tokens."""
    header = json.dumps(
        {
            "format": FORMAT_VERSION,
            "identity": identity.to_json(),
            "n_tokens": n_tokens,
            "meta_bytes": len(meta_bytes),
            "logits_bytes": logits_bytes,
            "payload_bytes": payload_bytes,
            _BODY_DIGESTS[FORMAT_VERSION][0]: digest,
        },
        separators=(",", ":"),
        sort_keys=True,
    ).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"a {len(header)}-byte header exceeds the cap of {MAX_HEADER_BYTES}")
    return b"".join((_PREFIX.pack(MAGIC, len(header)), header, hashlib.sha256(header).digest()))


def _body_digest(
    version: int, token_bytes: "bytes | memoryview", meta_bytes: "bytes | memoryview",
    logit_bytes: "bytes | memoryview", payload: "bytes | memoryview",
) -> str:
    h = _BODY_DIGESTS[version][1]()
    for part in (token_bytes, meta_bytes, logit_bytes, payload):
        h.update(part)
    return h.hexdigest()


@dataclass(frozen=True)
class _Header:
    identity: KVIdentity
    n_tokens: int
    meta_bytes: int
    logits_bytes: int
    payload_bytes: int
    version: int
    body_digest: str
    body_offset: int

    @property
    def end(self) -> int:
        return self.body_offset + 4 * self.n_tokens + self.meta_bytes + self.logits_bytes + self.payload_bytes


def _parse_header(prefix: bytes, *, max_payload_bytes: int) -> _Header:
    """Validate the magic, header and header digest in ``prefix`` (the file's first bytes)."""
    if len(prefix) < _PREFIX.size:
        if MAGIC.startswith(prefix[: len(MAGIC)]):
            raise StateMismatchError(f"the state file ends after {len(prefix)} bytes, inside its prefix", reason="truncated")
        raise StateMismatchError("not an aner_nb state file (bad magic)", reason="corrupt")
    magic, header_len = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise StateMismatchError("not an aner_nb state file (bad magic)", reason="corrupt")
    if header_len == 0 or header_len > MAX_HEADER_BYTES:
        raise StateMismatchError(
            f"the state header declares {header_len} bytes; allowed 1..{MAX_HEADER_BYTES}", reason="corrupt"
        )
    body_offset = _PREFIX.size + header_len + _DIGEST
    if len(prefix) < body_offset:
        raise StateMismatchError(f"the state file ends after {len(prefix)} bytes, inside its header", reason="truncated")
    header = prefix[_PREFIX.size : _PREFIX.size + header_len]
    if hashlib.sha256(header).digest() != prefix[_PREFIX.size + header_len : body_offset]:
        raise StateMismatchError("the state header's checksum does not match", reason="corrupt")
    try:
        doc = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StateMismatchError(f"the state header is not JSON: {exc}", reason="corrupt") from None
    if not isinstance(doc, dict):
        raise StateMismatchError("the state header is not a JSON object", reason="corrupt")
    version = doc.get("format")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise StateMismatchError(f"the state header's format {_short(version)} is not a version", reason="corrupt")
    if version > FORMAT_VERSION:
        raise StateMismatchError(
            f"the state file has format {version}; this version of aner_nb reads format {FORMAT_VERSION}",
            reason="newer_format",
        )
    digest_field, _, digest_len = _BODY_DIGESTS[version]
    keys = {"format", "identity", "n_tokens", "meta_bytes", "payload_bytes", digest_field}
    if version >= _LOGITS_SINCE:
        keys.add("logits_bytes")
    if set(doc) != keys:
        raise StateMismatchError("the state header has missing or unknown fields", reason="corrupt")
    identity = KVIdentity.from_json(doc["identity"])
    caps = {"n_tokens": MAX_TOKENS, "meta_bytes": MAX_META_BYTES, "payload_bytes": max_payload_bytes}
    if version >= _LOGITS_SINCE:
        caps["logits_bytes"] = MAX_LOGITS_BYTES
    for name, cap in caps.items():
        value = doc[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= cap:
            raise StateMismatchError(f"the state header's {name} {_short(value)} is outside 0..{cap}", reason="corrupt")
    logits_bytes = doc.get("logits_bytes", 0)
    if logits_bytes % 4:
        raise StateMismatchError(f"the state header's logits_bytes {logits_bytes} is not whole float32 values",
                                 reason="corrupt")
    digest = doc[digest_field]
    if not isinstance(digest, str) or len(digest) != digest_len:
        raise StateMismatchError(
            f"the state header's {digest_field} is not a {digest_len}-character hex digest", reason="corrupt"
        )
    return _Header(
        identity, doc["n_tokens"], doc["meta_bytes"], logits_bytes, doc["payload_bytes"], version, digest, body_offset
    )


def _finish(header: _Header, body: "bytes | bytearray | memoryview", total: int) -> Unpacked:
    """Check sizes and the body digest of a file of ``total`` bytes whose body is ``body``.

    The payload is returned as a view into ``body``: a 40 MB state is never copied
    between the read and llama.cpp's own copy into the KV tensors.
    """
    if total < header.end:
        raise StateMismatchError(
            f"the state file has {total} bytes; its header declares {header.end}", reason="truncated"
        )
    if total > header.end:
        raise StateMismatchError(
            f"the state file has {total - header.end} bytes after its declared end", reason="corrupt"
        )
    token_end = 4 * header.n_tokens
    meta_end = token_end + header.meta_bytes
    logits_end = meta_end + header.logits_bytes
    view = memoryview(body)
    token_bytes, meta_bytes = view[:token_end], view[token_end:meta_end]
    logit_bytes, payload = view[meta_end:logits_end], view[logits_end:]
    if _body_digest(header.version, token_bytes, meta_bytes, logit_bytes, payload) != header.body_digest:
        raise StateMismatchError("the state file's checksum does not match its contents", reason="corrupt")
    meta: Any = None
    if meta_bytes:
        try:
            meta = json.loads(bytes(meta_bytes).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise StateMismatchError("the state file's metadata is not JSON", reason="corrupt") from None
    tokens = struct.unpack(f"<{header.n_tokens}i", token_bytes)
    return Unpacked(header.identity, tokens, meta, payload, logit_bytes if header.logits_bytes else None)


def unpack_full(
    data: bytes, expected_identity: KVIdentity, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> Unpacked:
    """Verify ``data`` against ``expected_identity``; raise ``StateMismatchError`` (with ``reason``) or return it all."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise StateMismatchError(f"state data must be bytes, not {type(data).__name__}", reason="corrupt")
    view = memoryview(data).cast("B")
    header = _parse_header(bytes(view[: _PREFIX.size + MAX_HEADER_BYTES + _DIGEST]), max_payload_bytes=max_payload_bytes)
    _check_identity(header.identity, expected_identity)
    return _finish(header, view[header.body_offset :], len(view))


def unpack(
    data: bytes, expected_identity: KVIdentity, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> tuple[tuple[int, ...], memoryview]:
    """``(tokens, payload)`` of a state file's bytes, verified against ``expected_identity``."""
    out = unpack_full(data, expected_identity, max_payload_bytes=max_payload_bytes)
    return out.tokens, out.payload


def read_file(
    path: os.PathLike[str] | str, expected_identity: KVIdentity, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    mapped: bool = True,
) -> Unpacked:
    """Read and verify one state file, header first: a foreign or oversized file's body is never read.

    ``OSError`` (missing file, permissions, not a regular file) propagates;
    everything about the contents raises ``StateMismatchError``.

    ``mapped``: the body is mapped, not copied (about 5 ms less for a 32 MB
    state). A mapped file that another program truncates in place while it is
    read ends the process with SIGBUS; the tiers' own files are only ever
    replaced whole (:func:`write_atomic`), so the tiers map theirs, and a file
    a user names (``session(resume=path)``) is read with ``mapped=False``.
    """
    with open_regular(path) as f:
        total = os.fstat(f.fileno()).st_size
        prefix = f.read(min(total, _PREFIX.size + MAX_HEADER_BYTES + _DIGEST))
        header = _parse_header(prefix, max_payload_bytes=max_payload_bytes)
        _check_identity(header.identity, expected_identity)
        if total != header.end:  # sizes first: never allocate what the header does not declare
            return _finish(header, b"", total)
        if mapped:
            data: Any = _map_read_only(f)
            got = len(data)
        else:
            data = bytearray(total)
            f.seek(0)
            got = f.readinto(data)
    if got != total:
        raise StateMismatchError(f"the state file changed size while it was read ({got} of {total} bytes)",
                                 reason="truncated")
    return _finish(header, memoryview(data)[header.body_offset :], total)


def open_regular(path: os.PathLike[str] | str) -> BinaryIO:
    """``path`` opened for reading, if it is a regular file; ``OSError`` otherwise.

    A cache directory is shared with other programs: a FIFO named like a state
    file would block a plain ``open`` forever (no writer ever comes), and a
    device or a directory is no state either. The open does not wait (it is
    non-blocking, which changes nothing for a regular file) and the check is on
    the opened descriptor, so a rename in between cannot swap the file.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _map_read_only(f: Any) -> "mmap.mmap":
    """The whole open file mapped read-only, its pages populated from the page cache where the OS can.

    Reading a 40 MB state into a new buffer costs 10-40 ms of page faults and a
    copy; the mapping costs ~0.1 ms, and the checksum and llama.cpp's own copy
    into the KV tensors read the cached pages directly. Writers never modify a
    file in place (``write_atomic`` renames a new one over it, and this mapping
    keeps the old inode), so the mapped bytes cannot change under the reader.
    """
    if os.name == "nt":
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)


def write_atomic(path: os.PathLike[str] | str, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically: a unique temporary file in the same folder, fsync, ``os.replace``.

    Readers see the old file or the new one, never a partial write; two processes
    writing the same path each replace it with a whole file (the last one wins).
    On failure (a full disk) the temporary file is removed and the ``OSError`` propagates.
    ``durable=False`` skips both fsyncs (:func:`write_cache_file`): the rename is
    still atomic for every reader while the machine runs, and after a power loss a
    file the kernel had not written back yet fails its size or checksum check.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if not durable:
        return
    try:  # make the rename itself durable; best effort where directories cannot be opened
        dir_fd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def write_cache_file(path: os.PathLike[str] | str, data: bytes) -> None:
    """:func:`write_atomic` without fsync, for the prefix tiers' disk files.

    A cache file is worth its bytes only if reading it back is cheaper than
    recomputing it, and its checksum already tells a torn file apart: an fsync
    per retained prompt (tens of megabytes, and the kernel's writeback of them
    beside the decode threads) buys durability across a power loss that the
    cache does not need. A saved session (``session.save``) stays durable.
    """
    write_atomic(path, data, durable=False)
