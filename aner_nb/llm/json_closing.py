"""The shortest valid end of a schema-constrained JSON answer, so one cut by ``max_tokens`` still parses.

A grammar keeps every prefix of the answer valid, but ``max_tokens`` can end
it anywhere: mid-string, inside an array the model keeps extending. The
generation loop feeds each generated piece to a :class:`JsonCloser`, which
follows the JSON text (a stack of open objects, arrays, strings, numbers and
literals, each with its sub-schema) and answers :meth:`JsonCloser.closing`:
the shortest text that ends the current value and every open container
validly for the schema (a string closed, required properties filled with
their minimal values in the order llama.cpp's schema grammar emits them,
``minItems`` met, containers closed). When the remaining output budget no
longer holds the closing of the answer so far plus the next token, the loop
writes the closing instead of that token (``Response.closed_early``).

Pure: text in, text out; nothing here knows tokens or the engine. Where no
valid end can be derived (a ``pattern`` or ``format`` string already begun),
``closing()`` returns None and the answer is cut as before.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

__all__ = ["JsonCloser", "minimal_json", "MAX_CLOSING_CHARS"]

_WS = " \t\n\r"
_FORMAT_EXAMPLES = {  # the shortest values llama.cpp's format rules accept
    "date": "2000-01-01",
    "time": "00:00:00Z",
    "date-time": "2000-01-01T00:00:00Z",
    "uuid": "00000000-0000-0000-0000-000000000000",
}
for _v in range(1, 6):
    _FORMAT_EXAMPLES[f"uuid{_v}"] = _FORMAT_EXAMPLES["uuid"]
_MAX_DEPTH = 256  # constraints.py bounds schema nesting far below this; a guard against a cyclic $ref
# The longest closing derived. Each minItems / minLength is bounded (constraints.py), their product across
# nested arrays is not: three nested arrays of minItems 1000 need 10^9 items. A closing this long fits no
# output budget anyway, so past it there is none (None: the answer is cut as it would be without a closer).
MAX_CLOSING_CHARS = 1 << 16


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # the converter's literals: json.dumps of each enum value


class _Resolver:
    """Local ``$ref`` targets (``#/...``) of one root schema."""

    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root

    def resolve(self, schema: Any) -> Any:
        seen = 0
        while isinstance(schema, Mapping) and isinstance(schema.get("$ref"), str) and seen < 32:
            ref = schema["$ref"]
            if not ref.startswith("#"):
                return {}
            node: Any = self.root
            for part in [p for p in ref[1:].split("/") if p]:
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(node, Mapping) and part in node:
                    node = node[part]
                else:
                    return {}
            schema, seen = node, seen + 1
        return schema if isinstance(schema, Mapping) else {}

    def alternatives(self, schema: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        """The branches a value may follow: anyOf/oneOf members, or one per type of a type list."""
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return [self.resolve(s) for s in schema[key]]
        types = schema.get("type")
        if isinstance(types, list) and types:
            return [{**schema, "type": t} for t in types]
        return [schema]

    def branch_for(self, schema: Mapping[str, Any], opening: str) -> Mapping[str, Any]:
        """The branch a value that begins with ``opening`` follows (the first whose type or values fit)."""
        branches = self.alternatives(schema)
        if len(branches) == 1:
            return branches[0]
        wanted = {"{": "object", "[": "array", '"': "string", "t": "boolean", "f": "boolean", "n": "null"}.get(opening)
        for branch in branches:
            kind = branch.get("type")
            if kind == wanted or (wanted is None and kind in ("integer", "number")):
                return branch
            values = branch.get("enum", [branch["const"]] if "const" in branch else [])
            if isinstance(values, list) and any(_dumps(v).startswith(opening) for v in values):
                return branch
        return {}


def _properties(schema: Mapping[str, Any]) -> list[str]:
    props = schema.get("properties")
    return list(props) if isinstance(props, Mapping) else []


def _required(schema: Mapping[str, Any]) -> list[str]:
    """Required properties in the order the grammar emits them (their order in ``properties``)."""
    req = schema.get("required")
    wanted = set(req) if isinstance(req, list) else set()
    return [p for p in _properties(schema) if p in wanted]


def _sub(schema: Mapping[str, Any], key: str) -> Any:
    props = schema.get("properties")
    if isinstance(props, Mapping) and key in props:
        return props[key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, Mapping) else {}


def _number(schema: Mapping[str, Any]) -> str:
    """The integer nearest 0 inside the schema's bounds (an integer is a valid JSON number too)."""
    def bound(key: str) -> Optional[float]:
        v = schema.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    low = [b for b in (bound("minimum"),) if b is not None] + [
        math.floor(b) + 1 for b in (bound("exclusiveMinimum"),) if b is not None]
    high = [b for b in (bound("maximum"),) if b is not None] + [
        math.ceil(b) - 1 for b in (bound("exclusiveMaximum"),) if b is not None]
    lo = math.ceil(max(low)) if low else None
    hi = math.floor(min(high)) if high else None
    value = 0
    if lo is not None and value < lo:
        value = lo
    if hi is not None and value > hi:
        value = hi
    return str(int(value))


def _repeated(item: str, count: int, prefix: str = "") -> Optional[str]:
    """``prefix`` and ``count`` copies of ``item`` joined by commas, or None past :data:`MAX_CLOSING_CHARS`."""
    if len(prefix) + count * (len(item) + 1) > MAX_CLOSING_CHARS:
        return None
    return prefix + ",".join([item] * count)


def minimal_json(schema: Any, root: Optional[Mapping[str, Any]] = None, depth: int = 0) -> Optional[str]:
    """The shortest compact JSON text valid for ``schema`` (None where none can be derived)."""
    resolver = _Resolver(root if root is not None else (schema if isinstance(schema, Mapping) else {}))
    return _minimal(resolver, schema, depth)


def _minimal(r: _Resolver, schema: Any, depth: int) -> Optional[str]:
    if depth > _MAX_DEPTH:
        return None
    schema = r.resolve(schema)
    if "const" in schema:
        return _dumps(schema["const"])
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min((_dumps(v) for v in schema["enum"]), key=len)
    branches = r.alternatives(schema)
    if len(branches) > 1 or branches[0] is not schema:
        found = [m for m in (_minimal(r, b, depth + 1) for b in branches) if m is not None]
        return min(found, key=len) if found else None
    kind = schema.get("type")
    if kind == "object" or (kind is None and "properties" in schema):
        parts = []
        size = 2
        for key in _required(schema):
            value = _minimal(r, _sub(schema, key), depth + 1)
            if value is None:
                return None
            parts.append(f"{_dumps(key)}:{value}")
            size += len(parts[-1]) + 1
            if size > MAX_CLOSING_CHARS:
                return None
        return "{" + ",".join(parts) + "}"
    if kind == "array":
        items = schema.get("items") if isinstance(schema.get("items"), Mapping) else {}
        count = schema.get("minItems", 0) if isinstance(schema.get("minItems"), int) else 0
        if count == 0:
            return "[]"
        item = _minimal(r, items, depth + 1)
        body = None if item is None else _repeated(item, count, "[")
        return None if body is None else body + "]"
    if kind == "string":
        if "format" in schema:
            example = _FORMAT_EXAMPLES.get(schema["format"])
            return None if example is None else _dumps(example)
        if "pattern" in schema:
            return None
        low = schema.get("minLength", 0) if isinstance(schema.get("minLength"), int) else 0
        return '"' + "a" * low + '"'
    if kind in ("integer", "number"):
        return _number(schema)
    if kind == "boolean":
        return "true"
    if kind == "null":
        return "null"
    return "0"  # any JSON value


@dataclass
class _Frame:
    """One open value: its kind, its (resolved) schema, where it started and what was read of it."""

    kind: str  # object | array | string | number | literal
    schema: Mapping[str, Any]
    start: int
    state: str = ""  # object: open key colon value after comma; array: open after comma
    key: str = ""  # object: the key being read or just read; string: the characters so far
    emitted: list[str] = field(default_factory=list)  # object: keys with a value
    count: int = 0  # array: items so far; string: characters so far
    escape: str = ""  # string: a pending escape ("\\", "\\u12")
    is_key: bool = False  # string: an object's key


class JsonCloser:
    """Follows a schema-constrained JSON answer as it is generated; ``closing()`` ends it validly."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self._r = _Resolver(schema)
        self._root = self._r.resolve(schema)
        self._stack: list[_Frame] = []
        self._text: list[str] = []
        self._length = 0
        self._done = False  # the top-level value is complete
        self._broken = False  # text a grammar would not have allowed: no closing is offered

    @property
    def text(self) -> str:
        return "".join(self._text)

    def feed(self, piece: str) -> None:
        """Read the next generated text."""
        for ch in piece:
            if not self._broken:
                self._char(ch)
            self._text.append(ch)
            self._length += 1

    # -- reading ------------------------------------------------------------------------------
    def _schema_for_child(self) -> Mapping[str, Any]:
        if not self._stack:
            return self._root
        top = self._stack[-1]
        if top.kind == "object":
            return self._r.resolve(_sub(top.schema, top.key))
        if top.kind == "array":
            items = top.schema.get("items")
            return self._r.resolve(items) if isinstance(items, Mapping) else {}
        return {}

    def _expecting_value(self) -> bool:
        if not self._stack:
            return not self._done
        top = self._stack[-1]
        return (top.kind == "object" and top.state == "value") or (
            top.kind == "array" and top.state in ("open", "comma")
        )

    def _open(self, ch: str) -> None:
        if len(self._stack) >= _MAX_DEPTH:
            self._broken = True
            return
        schema = self._r.branch_for(self._schema_for_child(), ch)
        at = self._length
        if ch == "{":
            self._stack.append(_Frame("object", schema, at, state="open"))
        elif ch == "[":
            self._stack.append(_Frame("array", schema, at, state="open"))
        elif ch == '"':
            self._stack.append(_Frame("string", schema, at))
        elif ch == "-" or ch.isdigit():
            self._stack.append(_Frame("number", schema, at, key=ch))
        elif ch in "tfn":
            self._stack.append(_Frame("literal", schema, at, key=ch))
        else:
            self._broken = True

    def _value_done(self) -> None:
        """The innermost value ended: its parent moves on."""
        self._stack.pop()
        if not self._stack:
            self._done = True
            return
        parent = self._stack[-1]
        if parent.kind == "object":
            if parent.state == "key":
                parent.state = "colon"
            else:
                parent.emitted.append(parent.key)
                parent.state = "after"
        elif parent.kind == "array":
            parent.count += 1
            parent.state = "after"

    def _char(self, ch: str) -> None:
        top = self._stack[-1] if self._stack else None
        if top is not None and top.kind == "string":
            self._string_char(top, ch)
            return
        if top is not None and top.kind == "number":
            if ch.isdigit() or ch in ".eE+-":
                top.key += ch
                return
            self._value_done()  # a number ends at the first character that cannot continue it
            self._char(ch)
            return
        if top is not None and top.kind == "literal":
            top.key += ch
            if top.key in ("true", "false", "null"):
                self._value_done()
            elif not any(w.startswith(top.key) for w in ("true", "false", "null")):
                self._broken = True
            return
        if ch in _WS:
            return
        if top is not None and top.kind == "array" and top.state in ("open", "after") and ch == "]":
            self._value_done()
            return
        if self._expecting_value():
            self._open(ch)
            return
        if top is None:
            self._broken = True  # text after the complete value
        elif top.kind == "object":
            if top.state in ("open", "comma") and ch == '"':
                top.state = "key"
                top.key = ""
                self._stack.append(_Frame("string", {}, self._length, is_key=True))
            elif top.state == "colon" and ch == ":":
                top.state = "value"
            elif top.state in ("after", "open") and ch == "}":
                self._value_done()
            elif top.state == "after" and ch == ",":
                top.state = "comma"
            else:
                self._broken = True
        elif top.kind == "array":
            if top.state == "after" and ch == ",":
                top.state = "comma"
            else:
                self._broken = True

    def _string_char(self, top: _Frame, ch: str) -> None:
        if top.escape:
            top.escape += ch
            if not (top.escape.startswith("\\u") and len(top.escape) < 6):
                if top.is_key:
                    top.key += top.escape
                top.escape = ""
                top.count += 1
            return
        if ch == "\\":
            top.escape = ch
        elif ch == '"':
            if top.is_key:
                try:
                    self._stack[-2].key = json.loads('"' + top.key + '"')
                except ValueError:
                    self._broken = True
                    return
            self._value_done()
        else:
            top.count += 1
            if top.is_key:
                top.key += ch

    # -- closing ------------------------------------------------------------------------------
    def closing(self) -> Optional[str]:
        """The shortest text that makes the answer so far a complete, schema-valid value; None if unknown."""
        if self._broken:
            return None
        if self._done:
            return ""
        if not self._stack:
            return _minimal(self._r, self._root, 0)
        out: list[str] = []
        size = 0
        completed = False  # the innermost frame's own value was ended by the text so far in ``out``
        for i in range(len(self._stack) - 1, -1, -1):
            frame = self._stack[i]
            piece = self._close_frame(frame, completed, i)
            if piece is None:
                return None
            out.append(piece)
            size += len(piece)
            if size > MAX_CLOSING_CHARS:
                return None
            completed = True
        return "".join(out)

    def _close_frame(self, f: _Frame, child_done: bool, index: int) -> Optional[str]:
        if f.kind in ("string", "number", "literal"):
            return self._close_scalar(f, index)
        if f.kind == "array":
            count = f.count + (1 if child_done else 0)
            state = "after" if child_done else f.state
            items = f.schema.get("items") if isinstance(f.schema.get("items"), Mapping) else {}
            need = f.schema.get("minItems", 0) if isinstance(f.schema.get("minItems"), int) else 0
            parts = []
            if state == "comma":
                item = _minimal(self._r, items, 1)
                if item is None:
                    return None
                parts.append(item)
                count += 1
            missing = max(0, need - count)
            if missing:
                item = _minimal(self._r, items, 1)
                if item is None:
                    return None
                rest = _repeated(item, missing, "," if count > 0 else "")
                if rest is None:
                    return None
                parts.append(rest)
            return "".join(parts) + "]"
        return self._close_object(f, child_done)

    def _close_scalar(self, f: _Frame, index: int) -> Optional[str]:
        partial = self.text[f.start:] if f.kind != "number" else f.key
        if f.kind == "string" and f.is_key:
            return self._finish_key(self._stack[index - 1])
        schema = f.schema
        values = None
        if "const" in schema:
            values = [schema["const"]]
        elif isinstance(schema.get("enum"), list):
            values = schema["enum"]
        if values is not None:
            endings = [_dumps(v)[len(partial):] for v in values if _dumps(v).startswith(partial)]
            return min(endings, key=len) if endings else None
        if f.kind == "literal":
            for word in ("true", "false", "null"):
                if word.startswith(f.key):
                    return word[len(f.key):]
            return None
        if f.kind == "number":
            return "0" if partial[-1:] in ("-", ".", "e", "E", "+") else ""
        # a value string
        if "pattern" in schema or "format" in schema:
            return None
        tail = ""
        if f.escape:
            tail = "n" if f.escape == "\\" else "0" * (6 - len(f.escape))
        chars = f.count + (1 if f.escape else 0)
        low = schema.get("minLength", 0) if isinstance(schema.get("minLength"), int) else 0
        return tail + "a" * max(0, low - chars) + '"'

    def _finish_key(self, obj: _Frame) -> Optional[str]:
        """The rest of a key being read, its value, and the object's remaining required properties."""
        key_frame = self._stack[-1]
        if key_frame.escape:
            return None
        partial = key_frame.key
        pending = [k for k in _required(obj.schema) if k not in obj.emitted]
        if pending:
            choices = [pending[0]]  # the grammar emits required properties in order: only the next one fits
        else:
            choices = [k for k in _properties(obj.schema) if k not in obj.emitted]
        fits = [k for k in choices if _dumps(k)[1:-1].startswith(partial)]
        if not fits:
            return None
        key = min(fits, key=len)
        value = _minimal(self._r, _sub(obj.schema, key), 1)
        if value is None:
            return None
        rest = self._rest_of_object(obj, emitted=[*obj.emitted, key])
        return None if rest is None else _dumps(key)[1 + len(partial):] + ":" + value + rest

    def _rest_of_object(self, obj: _Frame, emitted: list[str]) -> Optional[str]:
        parts = []
        for key in _required(obj.schema):
            if key not in emitted:
                value = _minimal(self._r, _sub(obj.schema, key), 1)
                if value is None:
                    return None
                parts.append(f",{_dumps(key)}:{value}")
        return "".join(parts) + "}"

    def _close_object(self, f: _Frame, child_done: bool) -> Optional[str]:
        if child_done and f.state == "key":  # the key frame above closed the key, its value and the object
            return ""
        if child_done:
            return self._rest_of_object(f, [*f.emitted, f.key])
        if f.state in ("value", "colon"):
            value = _minimal(self._r, _sub(f.schema, f.key), 1)
            if value is None:
                return None
            rest = self._rest_of_object(f, [*f.emitted, f.key])
            return None if rest is None else (":" if f.state == "colon" else "") + value + rest
        if f.state == "after":
            return self._rest_of_object(f, f.emitted)
        pending = [k for k in _required(f.schema) if k not in f.emitted]
        if f.state == "comma" and not pending:
            optional = [k for k in _properties(f.schema) if k not in f.emitted]
            if not optional:
                return None
            pending = [min(optional, key=lambda k: len(_minimal(self._r, _sub(f.schema, k), 1) or "x" * 999))]
        parts = []
        for key in pending:
            value = _minimal(self._r, _sub(f.schema, key), 1)
            if value is None:
                return None
            parts.append(f"{_dumps(key)}:{value}")
        lead = "," if f.state == "open" and f.emitted else ""
        return lead + ",".join(parts) + "}"
