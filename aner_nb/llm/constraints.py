"""Limits for output constraints: GBNF grammars and JSON schemas are bounded before llama.cpp sees them.

llama.cpp's GBNF parser (``src/llama-grammar.cpp``) is a recursive-descent
parser on the calling thread's stack, with no depth bound of its own:

* ``parse_sequence`` -> ``parse_alternates`` -> ``parse_sequence`` recurses once
  per ``(`` group, so a grammar nesting 30,000 parentheses overflows the stack
  and the process (the kernel, ``aner-nb serve``) dies by SIGSEGV;
* ``llama_grammar_detect_left_recursion`` (run on every grammar it parsed)
  recurses once per rule along a chain of leftmost rule references, so a long
  chain of rules (``r0 ::= r1 "x"``, ``r1 ::= r2 "x"``...) does the same;
* repetitions are expanded into copies and generated rules (``S{m,n}`` copies
  ``S`` m times and adds n-m rules), so a short text can become a huge rule
  set; and ``S{m,n}`` with ``n < m`` makes its loop count wrap around (an
  unsigned ``n - m``), which never ends until memory does;
* the text is handed over as a C string, so a NUL character silently cuts the
  grammar short, and a lone surrogate cannot be encoded at all.

:func:`check_grammar_text` is a lexer-level scan (it respects ``"..."``
literals, ``[...]`` classes, ``<...>`` tokens and ``#`` comments, as
llama.cpp's lexer does) that measures each of these and refuses what is over
a limit with :class:`InvalidRequestError` naming the limit, the value found
and what is allowed. It is not a full parser: what it admits can still be
refused by llama.cpp (a typed error too, raised where the grammar is parsed).

JSON schemas are converted to GBNF by llama-cpp-python's port of llama.cpp's
converter, recursive Python that also expands ``minLength``/``maxLength``/
``minItems``/``maxItems`` and regex quantifiers into text (``maxLength: n``
becomes n nested groups). :func:`check_json_schema` bounds the document
(depth, node count, properties, enum sizes, patterns, repetition keywords,
``$ref`` chains) iteratively, before any recursive code sees it; the grammar
the converter returns goes through :func:`check_grammar_text` as well.

Each limit leaves ample headroom for real grammars and schemas (the JSON
grammars of realistic schemas, see ``tests/test_constraints.py``) and a wide
margin below what breaks the native code (measured figures in
``docs/reliability.md``, "Grammar and schema limits").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import InvalidRequestError
from .valid_text import lone_surrogate

__all__ = [
    "MAX_GRAMMAR_BYTES",
    "MAX_GROUP_DEPTH",
    "MAX_GRAMMAR_SYMBOLS",
    "MAX_REPETITION",
    "MAX_GRAMMAR_ELEMENTS",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_NODES",
    "MAX_SCHEMA_PROPERTIES",
    "MAX_ENUM_VALUES",
    "MAX_PATTERN_LENGTH",
    "MAX_SCHEMA_REPETITION",
    "MAX_REF_CHAIN",
    "GrammarFigures",
    "grammar_figures",
    "check_grammar_text",
    "check_json_schema",
]

# -- GBNF limits ------------------------------------------------------------------------------------
# The text itself. Hand-written grammars are a few KB; the JSON grammar of a schema with a thousand
# properties is about 100 KB. 256 KiB keeps one request's parse well under a second and its rules
# a few MB; a 1 MB grammar is refused before it reaches the parser.
MAX_GRAMMAR_BYTES = 256 * 1024
# Nesting of ( ) groups: one native recursion (parse_sequence + parse_alternates) per level, about
# 460 bytes of stack each (measured: a 1 MiB thread dies near 2,300 levels, an 8 MiB one near 18,000).
# The JSON-schema converter nests one group per optional repetition (``maxLength: n`` gives n levels),
# so the limit admits MAX_SCHEMA_REPETITION plus a little. 1,024 levels take about 0.5 MB; llama.cpp
# parses on a thread of its own with a 16 MiB stack (aner_nb.llm._engine.GRAMMAR_STACK_BYTES).
MAX_GROUP_DEPTH = 1024
# Symbols: named rules, every ( ) group and every rule a repetition generates. A chain of leftmost
# references recurses once per rule in detect_left_recursion (about 130 bytes each, measured), and a
# chain is at most every symbol, so this bounds that depth too: 20,000 take about 2.6 MB of the 16 MiB
# parse stack. The JSON grammar of a 1,000-property schema has a few thousand; ``maxLength: 1000``
# alone adds 2,000 (a group and an optional rule per level).
MAX_GRAMMAR_SYMBOLS = 20_000
# One repetition bound ``{m,n}``: llama.cpp's own threshold (MAX_REPETITION_THRESHOLD). Above it
# llama.cpp refuses a minimum but silently drops a maximum (the output could then be longer than
# asked), so both are refused here with a clear message instead.
MAX_REPETITION = 2000
# Rule elements after llama.cpp expands repetitions (8 bytes each; the rules are copied once more at
# init). A 256 KiB grammar without repetitions has at most 256 Ki elements; 2,000,000 (16 MB) leaves
# room for real repetitions and stops ``"<100 KB>"{2000}`` (200 M elements, 1.6 GB).
MAX_GRAMMAR_ELEMENTS = 2_000_000

# -- JSON-schema limits -----------------------------------------------------------------------------
# Nesting of the schema document (objects and arrays): json.dumps, the keyword walk and the recursive
# converter recurse once or more per level (Python's limit is 1,000 frames, shared with the caller's
# own stack, a Jupyter kernel's included). Real schemas nest about 10-20 levels (two per object level:
# ``properties`` and the property's schema).
MAX_SCHEMA_DEPTH = 64
# Every JSON value in the document (objects, arrays, scalars). A large real schema (an OpenAPI
# component set) has a few thousand.
MAX_SCHEMA_NODES = 20_000
# ``properties`` entries in the whole document: each becomes rules and key literals.
MAX_SCHEMA_PROPERTIES = 2_000
# Values of one ``enum``: each becomes an alternative literal.
MAX_ENUM_VALUES = 2_000
# A ``pattern``: the converter parses regexes with recursive Python (one level per group) and expands
# their quantifiers, so a pattern is bounded in length, group depth and quantifier counts.
MAX_PATTERN_LENGTH = 1_000
MAX_PATTERN_DEPTH = 32
# minLength / maxLength / minItems / maxItems and regex quantifiers ``{m,n}``: the converter writes them
# out (m copies, then n-m nested optional groups), so each is bounded; 1,000 keeps the nesting under
# MAX_GROUP_DEPTH with room for the schema's own nesting.
MAX_SCHEMA_REPETITION = 1_000
# A ``$ref`` whose target is itself a ``$ref``...: the converter resolves chains recursively.
MAX_REF_CHAIN = 32

# llama.cpp's parse_space (with newlines: a superset is safe here). A comment runs to the end of its line
# (the lookahead), so a run of ``#`` splits one way only: ``#[^\r\n]*`` alone backtracks exponentially
# on ``{#####...`` (found by fuzz/fuzz_grammar.py: a 60-byte input took over 30 s).
_SP = r"(?:[ \t\r\n]|#[^\r\n]*(?![^\r\n]))*"
# llama.cpp's escapes inside literals and classes (parse_char): \xHH, \uHHHH, \UHHHHHHHH, or one character.
_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|.)", re.DOTALL)


def _escaped_nuls(body: str) -> tuple[int, int]:
    """``(escapes of code point 0, other characters)`` in a literal's or class's body, as llama.cpp reads it."""
    nuls = chars = 0
    pos = 0
    for m in _ESCAPE.finditer(body):
        chars += m.start() - pos
        pos = m.end()
        digits = m.group(1) or m.group(2) or m.group(3)
        if digits is not None and int(digits, 16) == 0:
            nuls += 1
        else:
            chars += 1
    return nuls, chars + len(body) - pos
_TOKEN = re.compile(
    r'(?P<lit>"(?:[^"\\]|\\.)*"?)'
    r"|(?P<cls>\[(?:[^\]\\]|\\.)*\]?)"
    r"|(?P<com>#[^\r\n]*)"
    r"|(?P<tok>!?<(?:\[[0-9]*\]>?|[^>]*>?))"
    r"|(?P<def>::=)"
    r"|(?P<word>[a-zA-Z0-9-]+)"
    r"|(?P<rep>\{" + _SP + r"(?P<min>[0-9]+)" + _SP + r"(?:(?P<comma>,)" + _SP + r"(?P<max>[0-9]*)" + _SP + r")?\})"
    r"|(?P<brace>\{)"
    r"|(?P<op>[()|*+?.])",
    re.DOTALL,
)


@dataclass(frozen=True)
class GrammarFigures:
    """What :func:`grammar_figures` measured in a GBNF text (upper estimates of llama.cpp's own counts)."""

    size_bytes: int
    depth: int  # deepest ( ) nesting
    symbols: int  # named rules + groups + generated repetition rules
    elements: int  # rule elements after repetition expansion
    max_repetition: int  # the largest m or n of a {m,n}
    inverted_repetition: str | None  # the first {m,n} with n < m, as written
    nul: bool  # the text holds a NUL character
    nul_required: bool = False  # a literal (or a class of NUL alone) asks for code point 0, written as an escape


class _Frame:
    """One sequence being scanned: the size of its last item (elements) and llama.cpp's n_prev_rules."""

    __slots__ = ("item", "prod", "symbols_before")

    def __init__(self, symbols_before: int) -> None:
        self.item: int | None = None
        self.prod = 1
        self.symbols_before = symbols_before


class _Measure:
    """The running counts of :func:`grammar_figures` over one text's tokens."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.generated = 0
        self.elements = 0
        self.depth = self.max_depth = 0
        self.max_rep = 0
        self.inverted: str | None = None
        self.stack = [_Frame(0)]
        self.last_word: str | None = None
        self.nul_required = False

    def symbols(self) -> int:
        return len(self.names) + self.generated

    def item(self, n: int) -> None:
        self.elements += n
        self.stack[-1].item, self.stack[-1].prod = n, 1

    def repeat(self, low: int, high: int | None) -> None:
        frame = self.stack[-1]
        s = frame.item
        if s is None:
            return  # llama.cpp: "expecting preceding item"
        total = high if high is not None and high > 0 else (low if low > 0 else 1)
        frame.prod *= total
        opt = 1 if high is None else max(high - low, 0)
        self.elements += (s * (low - 1) if low > 0 else -s) + opt * (s + 3) + (1 if opt else 0)
        self.generated += opt
        frame.item = (s * low if low > 0 else 0) + (1 if opt else 0)

    def token(self, m: re.Match[str]) -> None:
        """Count one token; only a rule name (``word``) or a comment leaves ``last_word`` set."""
        if m.group("lit") is not None:  # one element per character (the length is an upper estimate)
            self.item(max(len(m.group("lit")) - 2, 0))
            self.nul_required |= _escaped_nuls(m.group("lit")[1:-1])[0] > 0
        elif m.group("cls") is not None:  # one per character, two per range: the length bounds both
            self.item(max(len(m.group("cls")) - 2, 1))
            body = m.group("cls")[1:-1]
            nuls, others = _escaped_nuls(body)
            self.nul_required |= not body.startswith("^") and nuls > 0 and others == body.count("-")
        elif m.group("com") is not None:
            return
        elif m.group("tok") is not None:
            self.item(1)
        elif m.group("def") is not None:
            if self.last_word is not None:  # the word before ::= names a rule: a new top-level sequence starts
                self.elements += 1  # the previous rule's END
            self.stack = [_Frame(self.symbols())]
            self.depth = 0
        elif m.group("word") is not None:
            self.last_word = m.group("word")
            self.names.add(self.last_word)
            self.item(1)
            return
        elif m.group("rep") is not None:
            self.repetition(m)
        elif m.group("brace") is not None:
            pass  # a malformed repetition: llama.cpp refuses it
        else:
            self.operator(m.group("op"))
        self.last_word = None

    def repetition(self, m: re.Match[str]) -> None:
        """``{min}``, ``{min,}`` or ``{min,max}``."""
        low = int(m.group("min"))
        high = low if m.group("comma") is None else (int(m.group("max")) if m.group("max") else None)
        self.max_rep = max(self.max_rep, low, high or 0)
        if high is not None and high < low and self.inverted is None:
            self.inverted = m.group("rep")
        self.repeat(low, high)

    def operator(self, op: str) -> None:
        if op == "(":
            self.generated += 1
            self.depth += 1
            self.max_depth = max(self.max_depth, self.depth)
            self.stack.append(_Frame(self.symbols() - 1))
        elif op == ")":
            if len(self.stack) > 1:
                inner = self.stack.pop()
                self.depth -= 1
                self.elements += 1  # the group rule's END
                self.item(1)
                self.stack[-1].prod = max(1, self.symbols() - inner.symbols_before)
        elif op == "|":
            self.elements += 1
            self.stack[-1].item, self.stack[-1].prod = None, 1
        elif op == ".":
            self.item(1)
        elif op == "*":
            self.repeat(0, None)
        elif op == "+":
            self.repeat(1, None)
        elif op == "?":
            self.repeat(0, 1)


def grammar_figures(text: str) -> GrammarFigures:
    """Measure ``text`` as llama.cpp's lexer would see it; never raises, whatever the text."""
    size = len(text.encode("utf-8", "surrogatepass"))
    m = _Measure()
    for token in _TOKEN.finditer(text):
        m.token(token)
    return GrammarFigures(size, m.max_depth, m.symbols(), max(m.elements, 0), m.max_rep, m.inverted, "\0" in text,
                          m.nul_required)


def _refuse(param: str, what: str, found: Any, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {what} is {found}; {allowed}", param=param)


def check_grammar_text(text: str, *, param: str = "grammar") -> GrammarFigures:
    """Refuse a GBNF text over any limit (InvalidRequestError with ``param``); its figures otherwise."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param}: the text is not valid Unicode (a lone surrogate at index {exc.start}); "
            "a grammar must be encodable as UTF-8", param=param) from None
    if size > MAX_GRAMMAR_BYTES:  # before the scan, so a huge text costs nothing more
        raise _refuse(param, "the grammar's size", f"{size:,} bytes", f"at most {MAX_GRAMMAR_BYTES:,} are allowed")
    figures = grammar_figures(text)
    if figures.nul:
        raise InvalidRequestError(
            f"{param}: the grammar holds a NUL character (llama.cpp would silently ignore the text after it); "
            "a grammar cannot ask for NUL at all", param=param)
    if figures.nul_required:
        # llama.cpp's grammar matcher reads a token's text as a C string and refuses every token whose text
        # starts with NUL, so a literal holding code point 0 can never be generated (nothing could follow it).
        raise InvalidRequestError(
            f"{param}: a literal or character class asks for the NUL character (\\x00, \\u0000); no token can "
            "produce it, so the grammar could never be completed. A negated class may exclude it ([^\\x00-\\x1f])",
            param=param)
    if figures.depth > MAX_GROUP_DEPTH:
        raise _refuse(param, "the nesting depth of ( ) groups", figures.depth, f"at most {MAX_GROUP_DEPTH} is allowed")
    if figures.inverted_repetition is not None:
        raise _refuse(param, "the repetition", repr(figures.inverted_repetition),
                      "a repetition {m,n} needs m <= n")
    if figures.max_repetition > MAX_REPETITION:
        raise _refuse(param, "a repetition bound {m,n}", figures.max_repetition,
                      f"each bound must be at most {MAX_REPETITION}")
    if figures.symbols > MAX_GRAMMAR_SYMBOLS:
        raise _refuse(param, "the number of rules (named, groups and repetition rules)", f"{figures.symbols:,}",
                      f"at most {MAX_GRAMMAR_SYMBOLS:,} are allowed")
    if figures.elements > MAX_GRAMMAR_ELEMENTS:
        raise _refuse(param, "the grammar's size after repetitions are expanded", f"{figures.elements:,} elements",
                      f"at most {MAX_GRAMMAR_ELEMENTS:,} are allowed")
    return figures


# -- JSON schemas -----------------------------------------------------------------------------------
_QUANTIFIER = re.compile(r"\{\s*([0-9]+)\s*(?:,\s*([0-9]*)\s*)?\}")
_REPETITION_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems")


def _pattern_scan(pattern: str) -> tuple[int, int | None]:
    """The group nesting of a regex, and the index of an unescaped ``]`` or ``}`` that closes nothing."""
    depth = best = 0
    escaped = in_class = in_braces = False
    for i, ch in enumerate(pattern):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif in_braces:
            in_braces = ch != "}"
        elif ch == "[":
            in_class = True
        elif ch == "{":
            in_braces = True
        elif ch in "]}":
            return best, i
        elif ch == "(":
            depth += 1
            best = max(best, depth)
        elif ch == ")":
            depth = max(depth - 1, 0)
    return best, None


def _check_pattern(pattern: str, where: str, param: str) -> None:
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise _refuse(param, f"the pattern at {where}", f"{len(pattern):,} characters long",
                      f"at most {MAX_PATTERN_LENGTH:,} are allowed")
    depth, stray = _pattern_scan(pattern)
    if stray is not None:  # llama-cpp-python's converter loops forever on one (found by fuzz/fuzz_grammar.py)
        raise _refuse(param, f"the pattern at {where}", f"unbalanced: {pattern[stray]!r} at index {stray} closes nothing",
                      f"escape it as \\{pattern[stray]}")
    if depth > MAX_PATTERN_DEPTH:
        raise _refuse(param, f"the group nesting of the pattern at {where}", depth,
                      f"at most {MAX_PATTERN_DEPTH} is allowed")
    for q in _QUANTIFIER.finditer(pattern):
        for bound in q.groups():
            if bound and int(bound) > MAX_SCHEMA_REPETITION:
                raise _refuse(param, f"a quantifier of the pattern at {where}", q.group(0),
                              f"each bound must be at most {MAX_SCHEMA_REPETITION:,}")


def _pointer(root: Any, ref: str) -> Any:
    """The target of a local ``#/a/b`` reference, or None (the converter refuses what is not local)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _check_text(text: str, where: str, param: str) -> None:
    """A schema's keys and strings become grammar literals and closing text: they must encode as UTF-8."""
    index = lone_surrogate(text)
    if index is not None:
        at = where if len(where) <= 80 else f"{where[:40]}...{where[-30:]}"
        raise InvalidRequestError(
            f"{param}: a string at {at} is not valid Unicode (a lone surrogate at index {index})", param=param)


def check_json_schema(schema: Any, *, param: str = "json_schema") -> int:
    """Refuse a JSON-schema document over any limit (InvalidRequestError with ``param``); its node count otherwise.

    Iterative: a 10,000-deep document is refused by depth, not by a RecursionError.
    """
    nodes = properties = 0
    todo: list[tuple[Any, int, str]] = [(schema, 1, "")]
    refs: list[tuple[str, str]] = []
    while todo:
        node, depth, where = todo.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _refuse(param, "the number of values in the schema", f"over {MAX_SCHEMA_NODES:,}",
                          f"at most {MAX_SCHEMA_NODES:,} are allowed")
        if isinstance(node, Mapping):
            children = list(node.items())
            for key in node:
                if isinstance(key, str):
                    _check_text(key, f"{where}/{key!r}", param)
        elif isinstance(node, (list, tuple)):
            children = list(enumerate(node))
        else:
            if isinstance(node, str):
                _check_text(node, where or "/", param)
            continue
        if depth > MAX_SCHEMA_DEPTH:
            at = where if len(where) <= 80 else f"{where[:40]}...{where[-30:]}"
            raise _refuse(param, f"the nesting depth of the schema (at {at})", f"over {MAX_SCHEMA_DEPTH}",
                          f"at most {MAX_SCHEMA_DEPTH} levels are allowed")
        if isinstance(node, Mapping):
            _check_schema_node(node, where or "/", param)
            props = node.get("properties")
            if isinstance(props, Mapping):
                properties += len(props)
                if properties > MAX_SCHEMA_PROPERTIES:
                    raise _refuse(param, "the number of properties in the schema", f"over {MAX_SCHEMA_PROPERTIES:,}",
                                  f"at most {MAX_SCHEMA_PROPERTIES:,} are allowed")
            if isinstance(node.get("$ref"), str):
                refs.append((node["$ref"], where or "/"))
        todo.extend((value, depth + 1, f"{where}/{key}") for key, value in children)
    for ref, where in refs:
        _check_ref_chain(schema, ref, where, param)
    if refs:
        _check_depth_through_refs(schema, param)
    return nodes


def _check_depth_through_refs(root: Any, param: str) -> None:
    """Nesting as the converter walks it, into each ``$ref``'s target (a reference back into the path,
    a recursive schema, is not followed: the converter makes it a rule reference)."""

    def children(node: Any) -> list[Any]:
        if isinstance(node, Mapping):
            out = [v for v in node.values() if isinstance(v, (Mapping, list))]
            target = _pointer(root, node["$ref"]) if isinstance(node.get("$ref"), str) else None
            return out + [target] if isinstance(target, (Mapping, list)) else out
        return [v for v in node if isinstance(v, (Mapping, list))]

    memo: dict[int, int] = {}
    path: list[tuple[Any, list[Any], int]] = [(root, children(root), 0)]
    on_path = {id(root)}
    while path:
        node, todo, best = path[-1]
        if todo:
            child = todo.pop()
            if id(child) in memo:
                path[-1] = (node, todo, max(best, memo[id(child)]))
            elif id(child) not in on_path:
                if len(path) >= MAX_SCHEMA_DEPTH:
                    raise _refuse(param, "the nesting depth of the schema with its $ref targets included",
                                  f"over {MAX_SCHEMA_DEPTH}", f"at most {MAX_SCHEMA_DEPTH} levels are allowed")
                path.append((child, children(child), 0))
                on_path.add(id(child))
            continue
        path.pop()
        on_path.discard(id(node))
        memo[id(node)] = best + 1
        if path:
            parent, ptodo, pbest = path[-1]
            path[-1] = (parent, ptodo, max(pbest, best + 1))


def _check_schema_node(node: Mapping[str, Any], where: str, param: str) -> None:
    enum = node.get("enum")
    if isinstance(enum, list) and len(enum) > MAX_ENUM_VALUES:
        raise _refuse(param, f"the enum at {where}", f"{len(enum):,} values long",
                      f"at most {MAX_ENUM_VALUES:,} are allowed")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        _check_pattern(pattern, where, param)
    for key in _REPETITION_KEYWORDS:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_SCHEMA_REPETITION:
            raise _refuse(param, f"{key} at {where}", value, f"at most {MAX_SCHEMA_REPETITION:,} is allowed")


def _check_ref_chain(root: Any, ref: str, where: str, param: str) -> None:
    seen = [ref]
    target = _pointer(root, ref)
    while isinstance(target, Mapping) and isinstance(target.get("$ref"), str):
        nxt = target["$ref"]
        if nxt in seen:
            raise _refuse(param, f"the $ref chain from {where}", " -> ".join([*seen, nxt]),
                          "a $ref must not lead back to itself without a schema in between")
        seen.append(nxt)
        if len(seen) > MAX_REF_CHAIN:
            raise _refuse(param, f"the $ref chain from {where}", f"over {MAX_REF_CHAIN} references long",
                          f"at most {MAX_REF_CHAIN} are allowed")
        target = _pointer(root, nxt)
