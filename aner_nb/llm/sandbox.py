"""The bounded Jinja sandbox chat templates compile and render in.

jinja2's ``ImmutableSandboxedEnvironment`` refuses attribute walks but bounds neither the size of
what one operation builds nor the output. :class:`_Sandbox` checks, before each operation that can
build a huge string or list in one C call (which the render deadline cannot interrupt), the size
it would build: repetition, concatenation, %-formatting, ``str.format``, the growing str methods
and jinja2's filters. :data:`ENVIRONMENT` is the one shared environment (no loader, no randomness).
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import types
from collections.abc import Callable, Mapping
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter

__all__ = ["ENVIRONMENT", "MAX_RENDER_CHARS", "RENDER_SECONDS", "TemplateRaised", "bounded_output"]

# Largest str/list a template may build with ``*`` and largest ``**`` result (bits).
_MAX_REPEAT_LEN = 1 << 20
_MAX_POWER_BITS = 1 << 16
# Bounds of one render: a prompt is at most 65,536 tokens, far below 16 MiB of text, and a real
# template renders in milliseconds; anything beyond is a hostile or broken template.
RENDER_SECONDS = 2.0
MAX_RENDER_CHARS = 16 << 20


def bounded_output(chunks: Any) -> str:
    """Join a template's output chunks, refusing more than MAX_RENDER_CHARS."""
    out, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_RENDER_CHARS:
            raise SecurityError(f"the rendered prompt exceeds {MAX_RENDER_CHARS} characters")
        out.append(chunk)
    return "".join(out)


class TemplateRaised(TemplateError):
    """A template called ``raise_exception(message)``."""


def _raise_exception(message: Any = "") -> None:
    raise TemplateRaised(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without HTML escaping, as Hugging Face's ``tojson`` (prompts are not HTML)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(Extension):
    """Accept HF's ``{% generation %}...{% endgeneration %}`` and render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _too_big(what: str, size: int, bound: int) -> SecurityError:
    return SecurityError(f"{what} would build {size} items; at most {bound} are allowed in one operation")


def _text_size(value: Any, budget: int = MAX_RENDER_CHARS) -> int:
    """An upper bound of ``len(str(value))`` (or its JSON), computed without building it.

    Strings count their length, containers the sizes of their items plus separators; a
    container that refers to one big string a million times is counted a million times,
    which is what ``str()`` would build. Stops counting once ``budget`` is passed.
    """
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v) + 3
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2
        elif isinstance(v, Mapping):
            total += 2 + 4 * len(v)
            if total <= budget:
                for key, item in v.items():
                    stack.append(key)
                    stack.append(item)
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(v)
            if total <= budget:
                stack.extend(v)
        else:
            total += 64  # floats, Undefined, macros, cyclers: short reprs
        if total > budget:
            return total
    return total


def _check_text(what: str, value: Any, bound: int = MAX_RENDER_CHARS) -> None:
    if not isinstance(value, str) and (size := _text_size(value, bound)) > bound:
        raise _too_big(f"{what} (as text)", size, bound)


def _int_arg(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# printf-style conversion: %[(key)][flags][width][.precision][length]type
_PERCENT_SPEC = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.)", re.S)
# str.format spec: [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[_,]?(?:\.(\d*))?.?", re.S)


def _check_percent(fmt: Any, args: Any) -> None:
    """Bound ``fmt % args`` before the one C call that builds it (widths, precisions, argument text)."""
    if not isinstance(fmt, (str, bytes)):
        return
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    positional = list(args) if isinstance(args, tuple) else [args]
    size, index = len(text), 0
    for match in _PERCENT_SPEC.finditer(text):
        key, width, precision, kind = match.groups()
        if kind == "%":
            continue
        numbers = []
        for part in (width, precision):
            if part == "*":
                numbers.append(abs(_int_arg(positional[index])) if index < len(positional) else 0)
                index += 1
            else:
                numbers.append(int(part) if part else 0)
        if max(numbers) > _MAX_REPEAT_LEN:
            raise SecurityError(f"a %-format width or precision above {_MAX_REPEAT_LEN} is not allowed")
        size += sum(numbers)
        if key is None and index < len(positional):
            size += _text_size(positional[index])
            index += 1
    if isinstance(args, Mapping):
        size += _text_size(args)
    if size > MAX_RENDER_CHARS:
        raise _too_big("%-formatting", size, MAX_RENDER_CHARS)


def _check_format_spec(value: Any, spec: str) -> int:
    """Bound one ``format(value, spec)`` (a ``str.format`` field); returns its size bound."""
    match = _FORMAT_SPEC.fullmatch(spec) if isinstance(spec, str) else None
    width = int(match.group(1)) if match and match.group(1) else 0
    precision = int(match.group(2)) if match and match.group(2) else 0
    if match is None and isinstance(spec, str) and len(spec) > 32:
        raise SecurityError("a format spec longer than 32 characters is not allowed")
    if max(width, precision) > _MAX_REPEAT_LEN:
        raise SecurityError(f"a format width or precision above {_MAX_REPEAT_LEN} is not allowed")
    return width + precision + _text_size(value)


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` in the sandbox, each field and the total bounded before it is built."""

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._size = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        self._size += _check_format_spec(value, format_spec)
        if self._size > MAX_RENDER_CHARS:
            raise _too_big("str.format", self._size, MAX_RENDER_CHARS)
        return super().format_field(value, format_spec)


def _check_str_method(obj: Any, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Bound the str/bytes methods whose result can be far larger than their inputs."""
    given = list(args) + list(kwargs.values())
    n = len(obj)
    if name in ("center", "ljust", "rjust", "zfill"):
        size = _int_arg(given[0]) if given else 0
        if size > _MAX_REPEAT_LEN:
            raise _too_big(f"str.{name}", size, _MAX_REPEAT_LEN)
    elif name == "expandtabs":
        tab = _int_arg(given[0]) if given else 8
        size = n + obj.count("\t" if isinstance(obj, str) else b"\t") * max(tab, 0)
        if tab > _MAX_REPEAT_LEN or size > MAX_RENDER_CHARS:
            raise _too_big("str.expandtabs", size, MAX_RENDER_CHARS)
    elif name == "replace" and len(given) >= 2 and type(given[0]) is type(obj) and type(given[1]) is type(obj):
        old, new = given[0], given[1]
        count = _int_arg(given[2]) if len(given) > 2 else -1
        hits = n + 1 if not old else obj.count(old)
        if count >= 0:
            hits = min(hits, count)
        size = n + hits * max(len(new) - len(old), 0)
        if size > MAX_RENDER_CHARS:
            raise _too_big("str.replace", size, MAX_RENDER_CHARS)
    elif name == "join" and given:
        items = given[0]
        if not isinstance(items, (str, bytes, list, tuple)):
            raise SecurityError("str.join takes a string, list or tuple in a template")
        size = sum(len(i) if isinstance(i, (str, bytes)) else 0 for i in items) + n * max(len(items) - 1, 0)
        if size > MAX_RENDER_CHARS:
            raise _too_big("str.join", size, MAX_RENDER_CHARS)
    elif name == "translate" and given and isinstance(given[0], Mapping):
        longest = max((len(v) for v in given[0].values() if isinstance(v, (str, bytes))), default=1)
        if n * longest > MAX_RENDER_CHARS:
            raise _too_big("str.translate", n * longest, MAX_RENDER_CHARS)


_GROWING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "translate"})


def _materialize(value: Any, what: str) -> list[Any]:
    """An iterable as a list of at most _MAX_REPEAT_LEN items (a filter's input)."""
    if isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = list(itertools.islice(iter(value), _MAX_REPEAT_LEN + 1))
    if len(items) > _MAX_REPEAT_LEN:
        raise _too_big(what, len(items), _MAX_REPEAT_LEN)
    return items


# What a filter check returns: None (call the filter as given) or the (args, kwargs) to call it with.
_Checked = tuple[tuple[Any, ...], dict[str, Any]] | None

# jinja2 filters that build text of the size of their input's text: bounded as text first.
_STRINGIFYING_FILTERS = ("string", "e", "escape", "forceescape", "safe", "pprint", "trim", "striptags", "title",
                         "capitalize", "upper", "lower", "truncate", "urlize", "urlencode", "xmlattr", "wordcount")


def _bounded(inner: Callable[..., Any], check: Callable[..., _Checked]) -> Callable[..., Any]:
    """``inner`` (a jinja2 filter) calling ``check`` on its arguments first."""
    passes = 1 if hasattr(inner, "jinja_pass_arg") else 0  # the environment or eval context comes first

    @functools.wraps(inner)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        changed = check(*args[passes:], **kwargs)
        if changed is not None:
            args, kwargs = (*args[:passes], *changed[0]), changed[1]
        return inner(*args, **kwargs)

    return bounded


def _stringifies(name: str) -> Callable[..., None]:
    def check(value: Any = "", *args: Any, **kwargs: Any) -> None:
        _check_text(f"the {name} filter's input", value)
    return check


def _counted(name: str) -> Callable[..., None]:
    def check(value: Any = (), count: Any = 1, *args: Any, **kwargs: Any) -> None:
        if _int_arg(count) > _MAX_REPEAT_LEN:
            raise _too_big(f"the {name} filter", _int_arg(count), _MAX_REPEAT_LEN)
    return check


def _check_center(value: Any = "", width: Any = 80) -> None:
    _check_text("the center filter's input", value)
    if _int_arg(width) > _MAX_REPEAT_LEN:
        raise _too_big("the center filter", _int_arg(width), _MAX_REPEAT_LEN)


def _check_indent(s: Any = "", width: Any = 4, *args: Any, **kwargs: Any) -> None:
    _check_text("the indent filter's input", s)
    pad = len(width) if isinstance(width, str) else _int_arg(width)
    text = str(s)
    size = len(text) + (text.count("\n") + 1) * pad
    if pad > _MAX_REPEAT_LEN or size > MAX_RENDER_CHARS:
        raise _too_big("the indent filter", size, MAX_RENDER_CHARS)


def _check_wordwrap(s: Any = "", width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
                    *args: Any, **kwargs: Any) -> None:
    _check_text("the wordwrap filter's input", s)
    text = str(s)
    lines = min(len(text) + 1, len(text) // max(_int_arg(width), 1) + text.count(" ") + text.count("\n") + 1)
    size = len(text) + lines * (len(wrapstring) if isinstance(wrapstring, str) else 2)
    if size > MAX_RENDER_CHARS:
        raise _too_big("the wordwrap filter", size, MAX_RENDER_CHARS)


def _check_list(value: Any = ()) -> _Checked:
    return None if isinstance(value, str) else ((_materialize(value, "the list filter"),), {})


def _check_join(value: Any = (), *rest: Any, **kwargs: Any) -> _Checked:
    sep = rest[0] if rest else kwargs.get("d", "")
    items = _materialize(value, "the join filter")
    size = len(str(sep)) * max(len(items) - 1, 0)
    for item in items:
        size += _text_size(item, MAX_RENDER_CHARS)
        if size > MAX_RENDER_CHARS:
            raise _too_big("the join filter", size, MAX_RENDER_CHARS)
    return (items, *rest), kwargs


def _check_replace(*args: Any, **kwargs: Any) -> None:
    given = list(args) + [kwargs[k] for k in ("old", "new", "count") if k in kwargs]
    if len(given) >= 3:
        _check_text("the replace filter's input", given[0])
        s, old, new = str(given[0]), str(given[1]), str(given[2])
        count = given[3] if len(given) > 3 and given[3] is not None else -1
        _check_str_method(s, "replace", (old, new, count), {})


def _check_format(value: Any = "", *args: Any, **kwargs: Any) -> None:
    _check_percent(str(value) if not isinstance(value, str) else value, kwargs or args)


def _check_sum(iterable: Any = (), *rest: Any, **kwargs: Any) -> _Checked:
    items = _materialize(iterable, "the sum filter")
    start = rest[1] if len(rest) > 1 else kwargs.get("start", 0)
    if isinstance(start, (str, bytes, list, tuple)) or any(isinstance(i, (list, tuple, str)) for i in items):
        size = (len(start) if hasattr(start, "__len__") else 0) + sum(
            len(i) for i in items if isinstance(i, (list, tuple, str, bytes))
        )
        if size > _MAX_REPEAT_LEN:
            raise _too_big("the sum filter", size, _MAX_REPEAT_LEN)
    return (items, *rest), kwargs


def _check_tojson(value: Any = None, *args: Any, **kwargs: Any) -> None:
    indent = args[1] if len(args) > 1 else kwargs.get("indent")
    pad = len(indent) if isinstance(indent, str) else _int_arg(indent)
    if pad > 64:
        raise SecurityError("tojson indent above 64 is not allowed")
    _check_text("the tojson filter's input", value, MAX_RENDER_CHARS // (1 + pad * 8))


def _filter_checks() -> tuple[tuple[str, Callable[..., _Checked]], ...]:
    """Each bounded filter's name and the check that runs before it."""
    return (
        *((name, _stringifies(name)) for name in _STRINGIFYING_FILTERS),
        ("center", _check_center), ("indent", _check_indent), ("wordwrap", _check_wordwrap),
        ("batch", _counted("batch")), ("slice", _counted("slice")), ("list", _check_list),
        ("join", _check_join), ("replace", _check_replace), ("format", _check_format), ("sum", _check_sum),
        ("tojson", _check_tojson),
    )


def _bounded_filters(filters: dict[str, Any]) -> None:
    """Replace jinja2's filters that can build a huge result in one call with checked wrappers."""
    original = dict(filters)
    for name, check in _filter_checks():
        if name in original:
            filters[name] = _bounded(original[name], check)


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to a sandbox call that bounds the joined text before building it."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that fails loudly on unsafe access and bounds every operation that can
    build a huge string or list in one C call (which the render deadline cannot interrupt).

    Repetition (``*``), padding widths, precisions and counts are bounded at ``_MAX_REPEAT_LEN``
    (1 MiB); joined, replaced, formatted and stringified results at ``MAX_RENDER_CHARS``, the most
    one render may output. Each check runs before the operation, on sizes, never on the result.
    """

    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _BoundedCodeGenerator

    def unsafe_undefined(self, obj: Any, attribute: Any) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                    if len(seq) * n > _MAX_REPEAT_LEN:
                        raise SecurityError(f"repetition longer than {_MAX_REPEAT_LEN} is not allowed")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and abs(left).bit_length() * right > _MAX_POWER_BITS:
                raise SecurityError("power result too large")
        elif operator == "%":
            _check_percent(left, right)
        elif operator == "+":
            if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
                if len(left) + len(right) > MAX_RENDER_CHARS:
                    raise _too_big("string concatenation", len(left) + len(right), MAX_RENDER_CHARS)
            elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                if len(left) + len(right) > _MAX_REPEAT_LEN:
                    raise _too_big("list concatenation", len(left) + len(right), _MAX_REPEAT_LEN)
        return super().call_binop(context, operator, left, right)

    def bounded_concat(self, parts: tuple[Any, ...]) -> str:
        size = 0
        for part in parts:
            size += len(part) if isinstance(part, str) else _text_size(part)
            if size > MAX_RENDER_CHARS:
                raise _too_big("string concatenation (~)", size, MAX_RENDER_CHARS)
        return "".join(map(str, parts))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes)) and isinstance(__obj, types.BuiltinMethodType):
            for name in _GROWING_METHODS:
                if __obj == getattr(owner, name, None):  # the same bound method of this very string
                    _check_str_method(owner, name, args, kwargs)
                    break
        elif isinstance(owner, int) and isinstance(__obj, types.BuiltinMethodType) and __obj == owner.to_bytes:
            length = _int_arg(args[0]) if args else _int_arg(kwargs.get("length", 1))
            if length > _MAX_REPEAT_LEN:
                raise _too_big("int.to_bytes", length, _MAX_REPEAT_LEN)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        """``str.format`` / ``format_map`` through :class:`_BoundedFormatter` (as jinja2's own wrapper)."""
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)):
            return None
        f_self = getattr(value, "__self__", None)
        if not isinstance(f_self, str) or (value != f_self.format and value != f_self.format_map):
            return None
        is_format_map = value == f_self.format_map
        formatter = _BoundedFormatter(self)

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                kwargs, args = args[0], ()
            return str(formatter.vformat(f_self, args, kwargs))

        return functools.update_wrapper(wrapper, value)


def _finalize(value: Any) -> Any:
    """Every ``{{ value }}``: a container is bounded as text before ``str()`` builds it."""
    _check_text("an output value", value)
    return value


def _make_environment() -> _Sandbox:
    env = _Sandbox(
        loader=None,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        finalize=_finalize,
        extensions=["jinja2.ext.loopcontrols", _GenerationTag],
    )
    # Deterministic rendering: drop the only random helpers jinja2 ships.
    env.globals.pop("lipsum", None)
    env.filters.pop("random", None)
    env.filters["tojson"] = _tojson
    _bounded_filters(env.filters)
    env.globals["raise_exception"] = _raise_exception
    return env



# Shared: the environment holds no per-template state and rendering is thread safe.
ENVIRONMENT = _make_environment()
