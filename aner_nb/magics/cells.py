"""What ``%%generate`` and ``%%chat`` share: their request options, and streaming into a view.

``request_options`` declares the flags (each sampling flag is the library
option of the same name), ``request_kwargs`` turns parsed flags into the
library's keyword arguments (``--grammar VAR`` / ``--json-schema VAR|JSON``
read from the namespace), and ``stream_into`` feeds a stream to a display
view, turning Ctrl-C into a cancelled request whose partial Response is
kept. What happens after an interrupt is the magic's policy, not decided here.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from IPython.core.error import UsageError

from ..widgets.answer import FORMATS
from .parser import int_arg

__all__ = ["SAMPLING_FLAGS", "request_options", "request_kwargs", "stream_into"]

# (flag, type, metavar, help) of the sampling options; each maps to the library option of the same name.
SAMPLING_FLAGS = (
    ("--top-k", int_arg, "K", "keep the K most likely tokens (0: off)"),
    ("--top-p", float, "P", "nucleus sampling, 0..1 (1: off)"),
    ("--min-p", float, "P", "drop tokens below P x the top probability, 0..1 (0: off)"),
    ("--repeat-penalty", float, "X", "> 0; 1 is off"),
    ("--repeat-last-n", int_arg, "N", "tokens the penalties look back over (default 64)"),
    ("--presence-penalty", float, "X", "-2..2 (0: off)"),
    ("--frequency-penalty", float, "X", "-2..2 (0: off)"),
)


def request_options(p: Any) -> None:
    """The options every request cell shares (%%generate, %%chat)."""
    p.add_argument("--max-tokens", type=int_arg, metavar="N",
                   help="most tokens to generate (default: %%config LLMMagics.max_tokens)")
    p.add_argument("--temperature", type=float, metavar="T", default=0.0, help="0 (greedy, default) .. 2")
    p.add_argument("--seed", type=int_arg, metavar="S", default=0)
    p.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    for flag, kind, meta, what in SAMPLING_FLAGS:
        p.add_argument(flag, type=kind, metavar=meta, help=what)
    p.add_argument("--grammar", metavar="VAR", help="a variable holding a GBNF grammar the answer must match")
    p.add_argument("--json-schema", metavar="VAR|JSON",
                   help="a JSON schema (inline JSON, or a variable holding a dict) the answer must validate against")
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


def request_kwargs(args: Any, ns: Mapping[str, Any], prog: str, max_tokens: int) -> dict[str, Any]:
    """The library's request options from a cell's parsed flags; ``max_tokens`` is the default budget."""
    options: dict[str, Any] = {
        "max_tokens": max_tokens if args.max_tokens is None else args.max_tokens,
        "temperature": args.temperature, "seed": args.seed, "stop": args.stop,
    }
    options.update(_constraints(args, ns, prog))
    for flag, *_ in SAMPLING_FLAGS:
        name = flag[2:].replace("-", "_")
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return options


def _constraints(args: Any, ns: Mapping[str, Any], prog: str) -> dict[str, Any]:
    """``grammar`` / ``json_schema`` options from their flags (a variable, or inline JSON for a schema)."""
    out: dict[str, Any] = {}
    if args.grammar is not None:
        grammar = ns.get(args.grammar)
        if not isinstance(grammar, str):
            raise UsageError(f"{prog}: --grammar {args.grammar!r} must name a variable holding GBNF text")
        out["grammar"] = grammar
    if args.json_schema is not None:
        text = args.json_schema
        schema = ns.get(text) if text.isidentifier() else _json_or_none(text)
        if not isinstance(schema, dict):
            raise UsageError(f"{prog}: --json-schema takes inline JSON or a variable holding a dict, got {text!r}")
        out["json_schema"] = schema
    return out


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
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
