"""A resumable ``map``: finished rows appended to a JSON Lines file, found again after a restart.

Each line is one finished row: ``{"format": 1, "row": <index label>, "key":
<sha256>, "result": {...}}``. ``key`` hashes everything that decides the
row's answer (the filled messages, every request setting, the model's and the
adapter's SHA-256), so re-running the same call skips the rows whose key is
already there, and a changed prompt, setting or model re-runs exactly the rows
it changes. Only rows that succeeded are written: a row that failed is tried
again on the next run.

The file is an input the process did not write this session, so it is read
with bounds: a line over :data:`MAX_LINE_BYTES`, a line that is not the shape
above, a line of another format and a torn last line (the process was killed
mid-write) are skipped and counted, never trusted. Appends are single
``write()`` calls on an ``O_APPEND`` descriptor, flushed to disk per row:
on a local filesystem two processes appending to one file never interleave
inside a line, and a kill loses at most the row being written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from .errors import ConfigurationError

__all__ = ["Checkpoint", "CheckpointLoad", "row_key", "row_label", "CHECKPOINT_FORMAT", "MAX_LINE_BYTES"]

log = logging.getLogger("aner_nb.map")

CHECKPOINT_FORMAT = 1
MAX_LINE_BYTES = 4 << 20  # one row: an answer of 65,536 tokens is well under this
MAX_FILE_BYTES = 4 << 30  # a checkpoint larger than this is refused rather than read


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def row_key(messages: Any, settings: Mapping[str, Any], model_sha256: str, adapter_sha256: str | None) -> str:
    """The SHA-256 of what decides one row's answer: its messages, its settings, the model and adapter."""
    payload = {"messages": messages, "settings": dict(settings), "model": model_sha256, "adapter": adapter_sha256}
    return hashlib.sha256(_canonical(payload).encode()).hexdigest()


def row_label(label: Any) -> str:
    """An index label as stable text (numpy scalars as their Python value, tuples of a MultiIndex as lists)."""
    import numpy as np

    def plain(v: Any) -> Any:
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    return _canonical(plain(label))


@dataclass(frozen=True)
class CheckpointLoad:
    """What reading a checkpoint found: finished rows by (label, key), and the lines skipped."""

    rows: Mapping[tuple[str, str], Mapping[str, Any]]
    skipped_lines: int


class Checkpoint:
    """One JSON Lines checkpoint file (created with its folder on the first append)."""

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        self.path = Path(path)
        if self.path.suffix != ".jsonl":
            raise ConfigurationError(
                f"checkpoint must be a .jsonl file (one JSON line per finished row), got {str(path)!r}",
                param="checkpoint",
            )
        if self.path.exists() and not self.path.is_file():
            raise ConfigurationError(f"checkpoint {str(path)!r} exists and is not a file", param="checkpoint")

    def load(self, fields: "frozenset[str]") -> CheckpointLoad:
        """The finished rows whose result has exactly ``fields``; every other line is skipped and counted."""
        if not self.path.exists():
            return CheckpointLoad({}, 0)
        size = self.path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigurationError(
                f"checkpoint {str(self.path)!r} is {size} bytes; at most {MAX_FILE_BYTES} are read (start a new file)",
                param="checkpoint",
            )
        rows: dict[tuple[str, str], Mapping[str, Any]] = {}
        skipped = 0
        with open(self.path, "rb") as f:
            for line in _bounded_lines(f, MAX_LINE_BYTES):
                entry = _entry(line, fields) if line is not None else None
                if entry is None:
                    skipped += 1
                else:
                    rows[(entry["row"], entry["key"])] = entry["result"]
        if skipped:
            log.warning("checkpoint %s: %d line(s) skipped (torn, oversized or not a row of this map)", self.path, skipped)
        return CheckpointLoad(rows, skipped)

    def append(self, label: str, key: str, result: Mapping[str, Any]) -> None:
        """Append one finished row as one line, flushed to disk before this returns."""
        line = _canonical({"format": CHECKPOINT_FORMAT, "row": label, "key": key, "result": dict(result)}) + "\n"
        data = line.encode()
        if len(data) > MAX_LINE_BYTES:
            log.warning("checkpoint %s: row %s not written (%d bytes per line at most)", self.path, label, MAX_LINE_BYTES)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if _ends_torn(fd):
                data = b"\n" + data  # a killed writer left half a line: end it, so this row's line is whole
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


def _bounded_lines(f: Any, limit: int) -> "Iterator[bytes | None]":
    """Each line of ``f`` (at most ``limit`` bytes held at once); None for a line over ``limit``, which is skipped
    in pieces of ``limit`` bytes, so one line of gigabytes costs no more memory than a line at the cap."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit:
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(limit)
        yield None


def _ends_torn(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


def _entry(line: bytes, fields: "frozenset[str]") -> "dict[str, Any] | None":
    if len(line) > MAX_LINE_BYTES or not line.endswith(b"\n"):
        return None
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not (
        isinstance(entry, dict) and entry.get("format") == CHECKPOINT_FORMAT
        and isinstance(entry.get("row"), str) and isinstance(entry.get("key"), str)
        and isinstance(entry.get("result"), dict) and set(entry["result"]) == fields
    ):
        return None
    return entry
