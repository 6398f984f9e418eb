"""Which field of a JSON request body is nested too deeply to parse.

Python's JSON parser refuses a body nested deeper than the interpreter's
recursion limit (a RecursionError, which FastAPI answers as a bare 400
"error parsing the body"). :func:`deepest_field` scans the raw bytes
lexically, without recursion, to name the top-level field holding the
deepest nesting, so the answer can carry the OpenAI error's ``param``
(``response_format`` for a 10,000-deep JSON schema).
"""

from __future__ import annotations

import json
import re

__all__ = ["deepest_field"]

_LEXEME = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:,]', re.DOTALL)


def deepest_field(body: bytes) -> tuple[str | None, int]:
    """The top-level key of ``body`` (a JSON object) whose value nests deepest, and that depth.

    ``(None, depth)`` when the body is not an object or the deepest nesting is
    outside any field. Never raises, whatever the bytes.
    """
    depth = best = 0
    key: str | None = None
    best_key: str | None = None
    expect_key = False
    for m in _LEXEME.finditer(body):
        tok = m.group(0)
        if tok in (b"{", b"["):
            depth += 1
            expect_key = tok == b"{" and depth == 1
            if depth > best:
                best, best_key = depth, key if depth > 1 else None
        elif tok in (b"}", b"]"):
            depth = max(depth - 1, 0)
        elif tok == b",":
            expect_key = depth == 1
        elif tok == b":":
            expect_key = False
        elif expect_key and depth == 1:
            try:
                key = json.loads(tok)
            except ValueError:
                key = None
            expect_key = False
    return best_key, best
