"""API keys: the rule every key follows, and reading a key file (one key per line).

A key file is read once, when the service is configured (``aner-nb serve
--api-key-file PATH``, ``.auth(api_key_file=PATH)``); restart the service to
change its keys. Blank lines and lines starting with ``#`` are ignored;
every other line (stripped) is a key. The file is bounded
(:data:`MAX_FILE_BYTES`, :data:`MAX_KEYS` keys, each 8..:data:`MAX_KEY_CHARS`
printable ASCII characters without spaces), and errors name the line, never
a key's text. The ``Guard`` compares the SHA-256 digests of the presented
token and of each key with ``hmac.compare_digest``, checking every key, so
neither the position of a difference nor which key matched shows in the time.
"""

from __future__ import annotations

import logging
import os
import stat

__all__ = ["check_key", "read_key_file", "MAX_FILE_BYTES", "MAX_KEYS", "MAX_KEY_CHARS", "MIN_KEY_CHARS"]

log = logging.getLogger("aner_nb.api")

MIN_KEY_CHARS = 8
MAX_KEY_CHARS = 512
MAX_KEYS = 1024
MAX_FILE_BYTES = 64 * 1024


def check_key(key: object) -> str | None:
    """Why ``key`` is not a usable API key, or None when it is."""
    if not isinstance(key, str):
        return f"a key is a string, got {type(key).__name__}"
    if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
        return f"a key is {MIN_KEY_CHARS}..{MAX_KEY_CHARS} characters long, this one is {len(key)}"
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        return "a key is printable ASCII without spaces"
    return None


def read_key_file(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The keys in ``path`` (in order, duplicates dropped); ValueError naming the line of the first bad one."""
    shown = os.fspath(path)
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"API key file {shown}: not a regular file")
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"API key file {shown}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"API key file {shown}: larger than {MAX_FILE_BYTES} bytes")
    if info.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        log.warning("API key file %s can be read or written by other users (chmod 600 it)", shown)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"API key file {shown}: not UTF-8 text (byte offset {exc.start})") from None
    keys: dict[str, None] = {}
    for number, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        problem = check_key(key)
        if problem is not None:
            raise ValueError(f"API key file {shown}, line {number}: {problem}")
        keys[key] = None
        if len(keys) > MAX_KEYS:
            raise ValueError(f"API key file {shown}: more than {MAX_KEYS} keys")
    if not keys:
        raise ValueError(f"API key file {shown}: no keys (one per line; blank lines and # comments are ignored)")
    return tuple(keys)
