"""Tiers behind live KV for retained prefixes: host RAM, then a disk directory.

A prefix evicted from live KV (a latency pool's context, a batching lease's
shared-prefix stream) is kept as serialised sequence state, stamped with the
KV identity (:mod:`aner_nb.llm.kv_identity`), in a RAM tier bounded in bytes
(least recently used out first; an entry leaving RAM is written to disk when
a disk tier is configured) and in a disk directory bounded in bytes (least
recently used by mtime out first). On a miss in live KV, the longest stored
prefix of the request's tokens, by exact token ids, is restored and only the
rest is evaluated.

This module is the policy and the byte bookkeeping, plain Python over token
tuples and bytes (no engine): the file name of a prefix, the longest stored
prefix of a token list, which entries leave a byte budget, the RAM tier, the
disk tier's files (atomic writes, bounded reads, two processes may share a
directory: a file is replaced by rename, never rewritten in place, and a file
another process removed is simply not there), and the counters.
:mod:`aner_nb.llm.prefix_store` applies it to contexts.

A stored entry is only bytes here; whether it may be restored onto a context
is decided by ``kv_identity.unpack`` before native code sees it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import sys
import threading
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from .kv_identity import REASONS, open_regular

__all__ = [
    "TIER_CODES",
    "TIERS",
    "SKIP_REASONS",
    "token_digest",
    "file_name",
    "parse_file_name",
    "is_stored_prefix",
    "longest_stored_prefix",
    "common_length",
    "best_stored",
    "token_file_name",
    "lru_evictions",
    "pinned_lengths",
    "TierStats",
    "RamTier",
    "DiskTier",
    "TierConfig",
]

log = logging.getLogger(__name__)

TIERS = ("ram", "disk")
# Timings.prefix_cache_tier: which tier served the request's prefix (-1: no tiers configured).
TIER_CODES = {"cold": 0, "live": 1, "ram": 2, "disk": 3}
# Why a stored entry was not used (counted per reason; kv_identity's reasons are added as they come).
SKIP_REASONS = REASONS + ("tokens", "too_large", "read_failed", "write_failed", "save_failed", "load_failed")

_NAME = re.compile(r"^(\d{1,6})-([0-9a-f]{40})\.kv$")


def token_digest(tokens: Sequence[int]) -> str:
    """SHA-256 (hex) of the token ids as little-endian int32: the key of a stored prefix."""
    arr = array("i", tokens)
    if arr.itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte C int
        arr = array("l", tokens)
    data = arr.tobytes() if sys.byteorder == "little" else _swapped(arr)
    return hashlib.sha256(data).hexdigest()


def _swapped(arr: array) -> bytes:  # pragma: no cover - big-endian hosts
    copy = array(arr.typecode, arr)
    copy.byteswap()
    return copy.tobytes()


def file_name(tokens: Sequence[int]) -> str:
    """The disk tier's file for a prefix: its length (so lookups know which lengths exist) and digest."""
    return f"{len(tokens):06d}-{token_digest(tokens)[:40]}.kv"


def token_file_name(tokens: Sequence[int]) -> str:
    """The sidecar holding a stored prefix's token ids (int32 LE), so lookups need not open state files."""
    return file_name(tokens)[:-3] + ".tok"


def tokens_from_bytes(data: bytes, length: int, digest: str) -> tuple[int, ...] | None:
    """Token ids of a sidecar, or None unless they are ``length`` ids whose digest starts with ``digest``."""
    if len(data) != 4 * length:
        return None
    arr = array("i")
    arr.frombytes(data)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    tokens = tuple(arr)
    return tokens if token_digest(tokens).startswith(digest) else None


def parse_file_name(name: str) -> tuple[int, str] | None:
    """``(length, digest prefix)`` of a tier file name, or None for anything else in the directory."""
    m = _NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def is_stored_prefix(stored: Sequence[int], tokens: Sequence[int]) -> bool:
    """Whether ``stored`` is a non-empty prefix of ``tokens`` (exact token ids)."""
    n = len(stored)
    return 0 < n <= len(tokens) and tuple(tokens[:n]) == tuple(stored)


def longest_stored_prefix(
    stored: Iterable[Sequence[int]], tokens: Sequence[int], *, min_tokens: int = 1
) -> tuple[int, ...] | None:
    """The longest of ``stored`` that is a prefix of ``tokens`` with more than ``min_tokens - 1`` tokens."""
    best: tuple[int, ...] | None = None
    for s in stored:
        if len(s) >= min_tokens and (best is None or len(s) > len(best)) and is_stored_prefix(s, tokens):
            best = tuple(s)
    return best


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading positions where two token sequences are identical.

    Every request compares its prompt with each held and stored prefix
    (thousands of tokens, dozens of entries), so the comparison is done by
    tuple slices, which run in C, halving the range that differs, instead of a
    Python loop per token.
    """
    n = min(len(a), len(b))
    x, y = tuple(a[:n]), tuple(b[:n])
    if x == y:
        return n
    lo, hi = 0, n  # x[:lo] == y[:lo]; the first difference is in [lo, hi)
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if x[lo:mid] == y[lo:mid]:
            lo = mid
        else:
            hi = mid
    return next(i for i in range(lo, hi) if x[i] != y[i])


def best_stored(
    stored: Iterable[Sequence[int]], tokens: Sequence[int], *, min_common: int = 1
) -> tuple[tuple[int, ...], int] | None:
    """The stored entry sharing the longest token prefix with ``tokens`` and that length, or None.

    A restored entry is trimmed to the common part (the context keeps every
    position, so a trim is exact). Only matches of at least ``min_common``
    tokens count; on equal matches the shorter entry wins (fewer bytes to load).
    """
    best: tuple[tuple[int, ...], int] | None = None
    for s in stored:
        n = common_length(s, tokens)
        if n >= min_common and (best is None or n > best[1] or (n == best[1] and len(s) < len(best[0]))):
            best = (tuple(s), n)
    return best


def lru_evictions(sizes: Sequence[int], budget: int, *, pinned: Sequence[bool] = ()) -> list[int]:
    """Indices of the entries to remove so the rest fit ``budget`` bytes.

    ``sizes`` are in least-recently-used-first order; the oldest unpinned
    entries go first, then (only if the pinned ones alone exceed the budget)
    the oldest pinned ones.
    """
    total = sum(sizes)
    out: list[int] = []
    pins = list(pinned) + [False] * (len(sizes) - len(pinned))
    for want_pinned in (False, True):
        for i, size in enumerate(sizes):
            if total <= budget:
                return out
            if pins[i] == want_pinned:
                out.append(i)
                total -= size
    return out


def pinned_lengths(system_end: int, prompt_len: int, *, checkpoint: int = 4096, trivial: int = 0) -> tuple[int, ...]:
    """Prefix lengths to pin for a prompt whose system part ends at token ``system_end``.

    The system part itself (everything before the first user message), and a
    checkpoint at ``checkpoint`` tokens when the system part is longer; never
    the whole prompt (one token is always evaluated) and never a length no
    longer than the template's fixed opening ``trivial``.
    """
    lengths = []
    if system_end > checkpoint:
        lengths.append(checkpoint)
    lengths.append(system_end)
    return tuple(n for n in lengths if trivial < n < prompt_len)


@dataclass
class TierStats:
    """Counters of one lease's tiers (thread safe through ``lock``)."""

    hits: Counter = field(default_factory=Counter)  # by tier
    misses: int = 0
    skips: Counter = field(default_factory=Counter)  # by reason
    bytes_read: Counter = field(default_factory=Counter)  # by tier
    bytes_written: Counter = field(default_factory=Counter)  # by tier
    restored_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def skip(self, reason: str, what: str = "") -> None:
        with self.lock:
            self.skips[reason] += 1
        log.info("prefix tier: skipped a stored prefix (%s)%s", reason, f": {what}" if what else "")

    def snapshot(self) -> dict[str, object]:
        with self.lock:
            return {
                "hits": dict(self.hits), "misses": self.misses, "skips": dict(self.skips),
                "bytes_read": dict(self.bytes_read), "bytes_written": dict(self.bytes_written),
                "restored_tokens": self.restored_tokens,
            }


class RamTier:
    """Packed prefix states in host memory, at most ``budget`` bytes, least recently used out first."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._entries: "OrderedDict[tuple[int, ...], bytes]" = OrderedDict()
        self._pinned: set[tuple[int, ...]] = set()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> list[tuple[int, ...]]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, tokens: object) -> bool:
        with self._lock:
            return tokens in self._entries

    def put(self, tokens: Sequence[int], blob: bytes, *, pinned: bool = False) -> list[tuple[tuple[int, ...], bytes]]:
        """Store ``blob`` for ``tokens``; returns what left the tier to make room (for the disk tier).

        A blob larger than the whole budget is not stored (returned as if evicted).
        """
        key = tuple(tokens)
        if len(blob) > self.budget:
            self.discard(key)
            return [(key, blob)]
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._entries[key] = blob
            self._bytes += len(blob)
            if pinned:
                self._pinned.add(key)
            keys = list(self._entries)
            victims = lru_evictions(
                [len(self._entries[k]) for k in keys], self.budget, pinned=[k in self._pinned for k in keys]
            )
            out = []
            for i in victims:
                k = keys[i]
                b = self._entries.pop(k)
                self._pinned.discard(k)
                self._bytes -= len(b)
                out.append((k, b))
            return out

    def longest(self, tokens: Sequence[int], *, min_tokens: int = 1) -> tuple[int, ...] | None:
        with self._lock:
            return longest_stored_prefix(self._entries, tokens, min_tokens=min_tokens)

    def best(self, tokens: Sequence[int], *, min_common: int = 1) -> tuple[tuple[int, ...], int] | None:
        """The entry sharing the most leading tokens with ``tokens`` (see :func:`best_stored`)."""
        with self._lock:
            return best_stored(self._entries, tokens, min_common=min_common)

    def get(self, tokens: Sequence[int]) -> bytes | None:
        """The blob for exactly ``tokens`` (now the most recently used), or None."""
        key = tuple(tokens)
        with self._lock:
            blob = self._entries.get(key)
            if blob is not None:
                self._entries.move_to_end(key)
            return blob

    def discard(self, tokens: Sequence[int]) -> None:
        key = tuple(tokens)
        with self._lock:
            blob = self._entries.pop(key, None)
            self._pinned.discard(key)
            if blob is not None:
                self._bytes -= len(blob)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._pinned.clear()
            self._bytes = 0


class DiskTier:
    """Packed prefix states as files in ``directory``, at most ``budget`` bytes, least recently used out first.

    Files are written whole to a temporary name and renamed (``write_atomic``),
    so a reader in another process sees an old file or a new one, never half
    of one. A read is bounded by the budget and checked against the size the
    directory reported. Recency is the file's mtime, refreshed on every hit.
    """

    def __init__(self, directory: "str | os.PathLike[str]", budget: int, write_atomic) -> None:
        self.directory = Path(directory)
        self.budget = budget
        self._write_atomic = write_atomic
        self._lock = threading.Lock()
        self._index: dict[str, tuple[int, ...]] = {}  # file name -> its token ids (the name's digest fixes them)

    def _files(self) -> list[tuple[float, int, Path, int]]:
        """``(mtime, size, path, length)`` of every tier file, oldest first."""
        out = []
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        for name in names:
            parsed = parse_file_name(name)
            if parsed is None:
                continue
            path = self.directory / name
            try:
                st = path.lstat()  # a link is not followed: what the directory holds must itself be a file
            except OSError:  # removed by another process meanwhile
                continue
            if not stat.S_ISREG(st.st_mode):  # a FIFO, a directory, a link named like a tier file: never opened
                continue
            try:
                side = path.with_suffix(".tok").stat().st_size
            except OSError:
                side = 0
            out.append((st.st_mtime, st.st_size + side, path, parsed[0]))
        out.sort(key=lambda f: (f[0], f[2].name))
        return out

    @property
    def bytes(self) -> int:
        """Bytes of the stored entries (state files and their token sidecars)."""
        return sum(f[1] for f in self._files())

    @property
    def entries(self) -> int:
        return len(self._files())

    def _tokens_of(self, path: Path, length: int, digest: str) -> tuple[int, ...] | None:
        """The token ids a state file is stored under, from its sidecar (cached: the name fixes the contents)."""
        key = path.name
        hit = self._index.get(key)
        if hit is not None:
            return hit
        side = path.with_suffix(".tok")
        try:
            with open_regular(side) as f:
                data = f.read(4 * length + 1)  # bounded by the length the name declares
        except OSError:
            return None
        tokens = tokens_from_bytes(data, length, digest)
        if tokens is not None:
            with self._lock:
                if len(self._index) > 4096:
                    self._index.clear()
                self._index[key] = tokens
        return tokens

    def best(self, tokens: Sequence[int], *, min_common: int = 1) -> list[tuple[int, tuple[int, ...], Path]]:
        """Stored files sharing at least ``min_common`` leading tokens with ``tokens``: ``(common, stored, path)``,
        the longest match first (the shorter file first on equal matches)."""
        out = []
        for _, _, path, length in self._files():
            parsed = parse_file_name(path.name)
            if parsed is None or length < min_common:
                continue
            stored = self._tokens_of(path, length, parsed[1])
            if stored is None:
                continue
            n = common_length(stored, tokens)
            if n >= min_common:
                out.append((n, stored, path))
        out.sort(key=lambda c: (-c[0], len(c[1])))
        return out

    def candidates(self, tokens: Sequence[int], *, min_tokens: int = 1) -> list[tuple[int, Path]]:
        """Files that may hold a prefix of ``tokens``, longest first: ``(length, path)``.

        The name carries the length and the digest of the tokens; the file's
        own token list is compared again after it is read (a digest prefix
        could collide, a file could be renamed).
        """
        lengths = sorted({f[3] for f in self._files() if min_tokens <= f[3] <= len(tokens)}, reverse=True)
        out = []
        for n in lengths:
            path = self.directory / file_name(tokens[:n])
            if path.exists():
                out.append((n, path))
        return out

    def path_for(self, tokens: Sequence[int]) -> Path:
        return self.directory / file_name(tokens)

    def has(self, tokens: Sequence[int]) -> bool:
        return self.path_for(tokens).exists()

    def read(self, path: Path) -> bytes:
        """The file's bytes, at most the budget; raises OSError (missing, unreadable) or ValueError (too large)."""
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size > self.budget:
                raise ValueError(f"{path.name} is {size} bytes, above the disk tier's {self.budget}")
            data = f.read(size + 1)
        if len(data) != size:
            raise ValueError(f"{path.name} changed size while it was read ({len(data)} of {size} bytes)")
        try:
            os.utime(path)  # most recently used now
        except OSError:
            pass
        return data

    def write(self, tokens: Sequence[int], blob: bytes) -> int:
        """Store ``blob`` for ``tokens``, then remove the oldest files above the budget; bytes written.

        Returns 0 for a blob larger than the whole budget. Raises OSError when
        the directory cannot be written (full, read-only): the caller counts it.
        """
        if len(blob) > self.budget:
            return 0
        os.makedirs(self.directory, exist_ok=True)
        path = self.path_for(tokens)
        side = path.with_suffix(".tok")
        if not side.exists():  # the sidecar first: a state file is only found through it
            self._write_atomic(side, array("i", tokens).tobytes() if sys.byteorder == "little" else _swapped(array("i", tokens)))
        self._write_atomic(path, blob)
        self.enforce()
        return len(blob)

    def enforce(self) -> None:
        """Remove the least recently used files until the directory fits the budget."""
        with self._lock:
            files = self._files()
            for i in lru_evictions([f[1] for f in files], self.budget):
                self.remove(files[i][2])
            self._remove_orphans()

    def _remove_orphans(self, min_age: float = 60.0) -> None:
        """Sidecars whose state file is gone (a writer writes the sidecar first, so only old ones)."""
        import time

        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        now = time.time()
        for name in names:
            if not name.endswith(".tok") or parse_file_name(name[:-4] + ".kv") is None:
                continue
            side = self.directory / name
            try:
                if not side.with_suffix(".kv").exists() and now - side.stat().st_mtime > min_age:
                    side.unlink()
            except OSError:
                pass

    def remove(self, path: Path) -> None:
        """Remove a state file and its sidecar; one another process removed first is simply gone."""
        for p in (path, path.with_suffix(".tok")):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.info("prefix tier: could not remove %s: %s", p.name, exc)


@dataclass(frozen=True)
class TierConfig:
    """A profile's tier settings (validated by its settings dataclass)."""

    ram_bytes: int = 0
    directory: str | None = None
    disk_bytes: int = 0

    @property
    def enabled(self) -> bool:
        return self.ram_bytes > 0 or self.directory is not None
