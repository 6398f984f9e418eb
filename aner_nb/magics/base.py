"""What every topic of ``LLMMagics`` shares: finding handles, the default handle, errors, results.

The topic modules (``loading``, ``generation``, ``serving``, ``inspection``)
are mixins of :class:`MagicsBase`; ``magics.LLMMagics`` combines them with
IPython's ``Magics`` and holds the configurable traits (``default_handle``,
``default_to_latest``, ``max_tokens``...) that these helpers read.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

from IPython.core.error import UsageError

from ..llm.errors import EngineError, LLMError
from .naming import NameClaims
from .parser import argument, one_line
from .tables import is_handle

if TYPE_CHECKING:
    from .handles import HandleRegistry
    from .prompt import ErrorLog
    from .servers import ServerRegistry

__all__ = ["MagicsBase", "library_errors", "NEW_HANDLE", "SOURCE", "TARGET"]

# Options several subcommands share, as reusable decorators.
NEW_HANDLE = argument("--as", dest="name", metavar="NAME",
                      help="variable name for the new handle (default: derived from the model, printed)")
SOURCE = argument("src", metavar="SRC", help="the source handle")
TARGET = argument("target", metavar="NAME", nargs="?", help="the handle (default: the default handle, see %%llm use)")


@contextmanager
def library_errors(prog: str) -> Iterator[None]:
    """Turn a rejected argument (any library error but an engine failure) into a one-line UsageError."""
    try:
        yield
    except (UsageError, EngineError):
        raise
    except (LLMError, OSError) as exc:
        raise UsageError(f"{prog}: {type(exc).__name__}: {one_line(exc)}") from None


class MagicsBase:
    """Helpers of the ``%llm`` handlers; ``LLMMagics`` supplies ``shell`` and the traits."""

    shell: Any
    handles: "HandleRegistry"
    servers: "ServerRegistry"
    errors: "ErrorLog"
    claims: NameClaims
    default_handle: str
    default_to_latest: bool

    @property
    def ns(self) -> dict[str, Any]:
        return self.shell.user_ns

    def _handle(self, name: str, prog: str) -> Any:
        """The handle bound to ``name``, or a UsageError naming the live ones."""
        value = self.ns.get(name)
        if value is None or not is_handle(value):
            names = self.handles.names()
            live = f"; handles: {', '.join(names)}" if names else "; load one with %llm load PATH --as NAME"
            what = f"{name!r} is a {type(value).__name__}, not a model handle" if value is not None else (
                f"no handle named {name!r}")
            raise UsageError(f"{prog}: {what}{live}")
        return value

    def _default_name(self, prog: str, missing: str = "NAME") -> str:
        """The default handle's name: ``default_handle``, else (with ``default_to_latest``) the latest."""
        if self.default_handle:
            value = self.ns.get(self.default_handle)
            if not is_handle(value) or value.closed:
                state = "closed" if is_handle(value) else "gone"
                raise UsageError(f"{prog}: the default handle {self.default_handle!r} is {state}; "
                                 "name a handle, or choose another with %llm use NAME")
            return self.default_handle
        latest = self.handles.latest() if self.default_to_latest else None
        if latest is None:
            raise UsageError(f"{prog}: the following arguments are required: {missing} "
                             "(or choose a default handle with %llm use NAME)")
        return latest

    def _target(self, name: str | None, prog: str) -> tuple[Any, str]:
        """``(handle, name)`` of ``name``, or of the default handle when no name was given."""
        if name is None:
            name = self._default_name(prog)
        return self._handle(name, prog), name

    def _on_handle(self, sub: str, name: str | None, show: Callable[[Any], Any]) -> Any:
        """``show(handle)`` for ``name`` (the default handle, said so, when None); a library error
        becomes a one-line UsageError."""
        handle, shown = self._target(name, f"%llm {sub}")
        if name is None:
            print(f"%llm {sub} {shown}  (the default handle)")
        with library_errors(f"%llm {sub}"):
            return show(handle)

    def _bind_new(self, name: str, handle: Any, *, claim: Any = None) -> None:
        """Bind a handle the magic just made (closing it if binding fails); ``claim`` marks a derived name."""
        try:
            self.handles.bind(name, handle)
        except BaseException:
            handle.close()
            raise
        self.claims.set(name, claim)

    def _result(self, value: Any, var: str | None = None) -> None:
        """Store a result in ``var`` (when given) and in ``_`` (and ``_N``, ``Out[N]``) like a displayed one."""
        if var is not None:
            self.ns[var] = value
        try:
            self.shell.displayhook.update_user_ns(value)
        except Exception:
            self.ns["_"] = value
