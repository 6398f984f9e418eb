"""What ``%%generate`` and ``%%chat`` share: their request options, and streaming into a view.

The request flags are derived from the library's option declarations
(:data:`aner_nb.llm.options.REGISTRY`): every option with a ``Flag`` is
``--name-with-dashes METAVAR``, its help the option's help with its bounds
and default. ``request_options`` adds them (and the display flags) to a
parser (``request_flags`` only them, for ``%llm chat``), ``request_usage`` writes them into a usage line, and
``request_settings`` turns parsed flags into one checked ``RequestSettings``
(``--grammar VAR`` / ``--json-schema VAR|JSON`` read from the namespace).
``stream_into`` feeds a stream to a display view, turning Ctrl-C into a
cancelled request whose partial Response is kept. What happens after an
interrupt is the magic's policy, not decided here.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from IPython.core.error import UsageError

from ..llm.options import REGISTRY, Option, Registry
from ..llm.requests import request_settings as library_settings
from ..widgets.answer import FORMATS
from .parser import int_arg

__all__ = ["request_flags", "request_options", "request_usage", "request_settings", "flag_help", "stream_into"]

# Options whose default in a cell comes from the magics' configuration, not from the library.
CONFIGURED = {"max_tokens": "%%config LLMMagics.max_tokens"}


def _flagged(registry: Registry) -> list[Option]:
    return [o for o in registry if o.flag is not None]


def flag_help(option: Option) -> str:
    """The flag's ``-h`` line: what it does, its bounds and where its default comes from."""
    flag = option.flag
    assert flag is not None
    text = flag.help or option.help
    details = [option.span] if option.span and flag.takes == "value" else []
    if option.name in CONFIGURED:
        details.append(f"default: {CONFIGURED[option.name]}")
    elif flag.takes == "value":
        details.append(f"default {option.default:g}" if isinstance(option.default, float) else
                       f"default {option.default}")
    return f"{text} ({'; '.join(details)})" if details else text


def request_usage(registry: Registry = REGISTRY) -> str:
    """The request flags as a usage fragment: ``[--max-tokens N] [--temperature T] ...``."""
    return " ".join(f"[{o.flag_name} {o.flag.metavar}]" for o in _flagged(registry))  # type: ignore[union-attr]


def request_flags(p: Any, registry: Registry = REGISTRY) -> None:
    """The request flags alone (``--max-tokens``, ``--temperature``...), for ``%llm chat``."""
    for option in _flagged(registry):
        flag = option.flag
        assert flag is not None
        kwargs: dict[str, Any] = {"dest": option.name, "metavar": flag.metavar, "help": flag_help(option)}
        if flag.takes == "repeat":
            kwargs["action"] = "append"
        elif flag.takes == "value":
            kwargs["type"] = int_arg if option.type is int else float if option.type is float else str
        p.add_argument(option.flag_name, **kwargs)


def request_options(p: Any, registry: Registry = REGISTRY) -> None:
    """The options every request cell shares (%%generate, %%chat): the request flags, then the display flags."""
    request_flags(p, registry)
    p.add_argument("--as", dest="var", metavar="VAR", help="also store the Response in this variable")
    p.add_argument("--format", choices=FORMATS,
                   help="how the answer shows: markdown (rendered), text, code (a code block) or json "
                   "(pretty-printed) (default: %%config LLMMagics.format, markdown)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stream", dest="display", action="store_const", const="stream",
                      help="stream into the display (default: %%config LLMMagics.display)")
    mode.add_argument("--no-stream", dest="display", action="store_const", const="final",
                      help="show only the final answer and timings")
    mode.add_argument("--quiet", dest="display", action="store_const", const="none",
                      help="show nothing (the Response still goes to VAR and _)")


def request_settings(args: Any, ns: Mapping[str, Any], prog: str, max_tokens: int,
                     registry: Registry = REGISTRY) -> Any:
    """The checked request settings of a cell's parsed flags; ``max_tokens`` is the configured default budget.

    A flag left out leaves the library's default; a bad value raises the library's InvalidRequestError
    (naming the option), a flag naming a missing variable a UsageError.
    """
    options: dict[str, Any] = {"max_tokens": max_tokens} if "max_tokens" in registry else {}
    for option in _flagged(registry):
        given = getattr(args, option.name, None)
        if given is not None:
            options[option.name] = _flag_value(option, given, ns, prog)
    return library_settings(options, registry=registry)


def _flag_value(option: Option, given: Any, ns: Mapping[str, Any], prog: str) -> Any:
    """A flag's value: as parsed, or read from a variable (``variable``), or inline JSON (``variable_or_json``)."""
    flag = option.flag
    assert flag is not None
    if flag.takes == "variable":
        value = ns.get(given)
        if flag.holds is not None and not isinstance(value, flag.holds):
            raise UsageError(f"{prog}: {option.flag_name} {given!r} must name a variable holding {flag.holding}")
        return value
    if flag.takes == "variable_or_json":
        value = ns.get(given) if given.isidentifier() else _json_or_none(given)
        if flag.holds is not None and not isinstance(value, flag.holds):
            raise UsageError(f"{prog}: {option.flag_name} takes inline JSON or a variable holding a dict, got {given!r}")
        return value
    return given


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser recurses
        return None


def stream_into(view: Any, stream: Any) -> tuple[Any, bool]:
    """Feed ``stream``'s pieces to ``view`` and finish it; returns ``(response, cancelled)``.

    Ctrl-C (KeyboardInterrupt, raised in the engine step or in the view) cancels the
    request: the view shows the partial Response and ``cancelled`` is True. Any other
    error cancels the request, marks the view failed and propagates.
    """
    cancelled = False
    try:
        view.start()
        for piece in stream:
            view.add(piece)
    except KeyboardInterrupt:
        stream.cancel()  # a no-op when the interrupt already ended the stream inside its step
        cancelled = True
    except BaseException as exc:
        stream.cancel()
        view.fail(exc)
        raise
    response = stream.response
    view.finish(response, cancelled=cancelled)
    return response, cancelled
