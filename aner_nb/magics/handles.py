"""The notebook's handle registry: weak tracking and release of native memory.

Handles (leases, sessions, batching models) live in the user namespace; the
registry only keeps weak references, so it never keeps one alive. After each
cell (IPython's ``post_run_cell``) it compares the namespace with what it saw
before:

- a handle bound for the first time is adopted (also those made with the
  plain Python API), so ``%llm list``, unload and exit know about it;
- a handle whose names are all gone (``del``, overwritten, ``%reset``) loses
  the references IPython keeps behind the user's back (``_``, ``_N``,
  ``Out``), so the lease's own finalizer frees it; if the only remaining
  references are frames of a failed cell's traceback, it is closed;
- handles held only by a failed cell's traceback frames (``sys.last_*``) are
  closed, so an exception does not pin native memory until the next error.

It also remembers the order in which names were given leases (loaded,
derived, or adopted from the Python API), so :meth:`HandleRegistry.latest`
can name the most recent one still open: the magics' default handle when
none is configured.

Closing a lease makes it reject new requests and release its contexts; the
weights are freed when no lease or session uses them any more.
"""

from __future__ import annotations

import gc
import itertools
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .tables import handle_kind, handle_table, is_handle, is_output_cache_name

__all__ = ["HandleRegistry"]

_CO_OPTIMIZED = 0x0001  # function frames; module and class bodies keep real namespaces


@dataclass
class _Entry:
    ref: "weakref.ref[Any]"
    order: int
    names: set[str] = field(default_factory=set)
    parent: "weakref.ref[Any] | None" = None


class HandleRegistry:
    """Weakly tracks the handles of one shell's namespace and releases them."""

    def __init__(self, namespace: Callable[[], dict[str, Any]], shell: Any = None) -> None:
        self._namespace = namespace
        self._shell = shell
        self._entries: dict[int, _Entry] = {}
        self._order = itertools.count()
        # Called with a handle about to be closed (None: all of them), e.g. ServerRegistry.release.
        self._closing: list[Callable[[Any], Any]] = []
        self._recent: list[str] = []  # names given a lease (not a session), oldest first

    # -- tracking ---------------------------------------------------------------
    @property
    def ns(self) -> dict[str, Any]:
        return self._namespace()

    def track(self, handle: Any, *, parent: Any = None) -> None:
        """Track ``handle`` weakly; ``parent`` is the lease a session was opened on."""
        key = id(handle)
        entry = self._entries.get(key)
        if entry is not None and entry.ref() is handle:
            if parent is not None:
                entry.parent = weakref.ref(parent)
            return

        def forget(ref: "weakref.ref[Any]", key: int = key, entries: dict = self._entries) -> None:
            current = entries.get(key)
            if current is not None and current.ref is ref:
                del entries[key]

        self._entries[key] = _Entry(
            weakref.ref(handle, forget), next(self._order), parent=weakref.ref(parent) if parent is not None else None
        )

    def live(self) -> list[tuple[Any, _Entry]]:
        """Tracked handles still alive, oldest first."""
        out = []
        for entry in sorted(self._entries.values(), key=lambda e: e.order):
            obj = entry.ref()
            if obj is not None:
                out.append((obj, entry))
        return out

    def __len__(self) -> int:
        return len(self.live())

    def __iter__(self) -> Iterator[Any]:
        return (obj for obj, _ in self.live())

    def parent_of(self, handle: Any) -> Any:
        entry = self._entries.get(id(handle))
        if entry is None or entry.ref() is not handle or entry.parent is None:
            return None
        return entry.parent()

    def names(self) -> list[str]:
        """Names of the handles bound in the namespace."""
        return [n for n, v in list(self.ns.items()) if not is_output_cache_name(n) and is_handle(v)]

    def _touch(self, name: str, handle: Any) -> None:
        if handle_kind(handle) != "session":
            if name in self._recent:
                self._recent.remove(name)
            self._recent.append(name)

    def latest(self) -> str | None:
        """The name most recently given a lease (loaded, derived or adopted) that still holds an open one."""
        ns = self.ns
        for name in reversed(self._recent):
            value = ns.get(name)
            if is_handle(value) and handle_kind(value) != "session" and not value.closed:
                return name
        return None

    def table(self) -> Any:
        self.sync()
        parents = {}
        for obj, entry in self.live():
            parent = entry.parent() if entry.parent is not None else None
            if parent is not None:
                parents[id(obj)] = parent
        return handle_table(self.ns, parents=parents)

    # -- binding and closing ------------------------------------------------------
    def bind(self, name: str, handle: Any, *, parent: Any = None) -> None:
        """Store ``handle`` as ``name``; a different handle previously bound there is closed first."""
        old = self.ns.get(name)
        if old is not None and old is not handle and is_handle(old):
            self.close(old)
        self.track(handle, parent=parent)
        self.ns[name] = handle
        self._entries[id(handle)].names.add(name)
        self._touch(name, handle)

    def dependents(self, handle: Any) -> list[Any]:
        """Tracked sessions opened on ``handle`` by the magics."""
        return [obj for obj, e in self.live() if e.parent is not None and e.parent() is handle]

    def on_close(self, hook: Callable[[Any], Any]) -> None:
        """Call ``hook(handle)`` before a handle closes, ``hook(None)`` before :meth:`close_all`."""
        self._closing.append(hook)

    def close(self, handle: Any) -> None:
        """Close ``handle`` and the sessions opened on it (the ``on_close`` hooks first: its HTTP server)."""
        for hook in self._closing:
            hook(handle)
        for dep in self.dependents(handle):
            dep.close()
        handle.close()

    def close_all(self) -> int:
        """Run the ``on_close`` hooks (every server stops), then close every tracked handle (sessions
        first, then newest leases first); returns how many handles were closed."""
        for hook in self._closing:
            hook(None)
        self.sync()
        handles = [obj for obj, _ in self.live()]
        sessions = [h for h in handles if handle_kind(h) == "session"]
        leases = [h for h in reversed(handles) if handle_kind(h) != "session"]
        closed = 0
        for obj in sessions + leases:
            if not obj.closed:
                obj.close()
                closed += 1
        return closed

    # -- after each cell ------------------------------------------------------------
    def sync(self) -> list["weakref.ref[Any]"]:
        """Adopt newly bound handles; return the tracked ones whose names are all gone."""
        bound: dict[int, list[str]] = {}
        for name, value in list(self.ns.items()):
            if is_output_cache_name(name) or not is_handle(value):
                continue
            if id(value) not in bound:
                if id(value) not in self._entries or self._entries[id(value)].ref() is not value:
                    self._touch(name, value)  # made with the Python API: adopted as the latest
                self.track(value)
            bound.setdefault(id(value), []).append(name)
        dropped = []
        for key, entry in list(self._entries.items()):
            names = set(bound.get(key, ()))
            if entry.names and not names:
                dropped.append(entry.ref)
            entry.names = names
        return dropped

    def after_cell(self, result: Any = None, *, release_failed: bool = True) -> None:
        """``post_run_cell``: release what the cell dropped or left in a traceback."""
        dropped = [r for r in self.sync() if r() is not None]
        error = getattr(result, "error_in_exec", None) if result is not None else None
        in_traceback = self._traceback_handles(error) if (error is not None and release_failed) else []
        if dropped:
            self._purge_output_cache(dropped)
            dropped = [r for r in dropped if r() is not None]
            if dropped:
                gc.collect()  # a lease in a reference cycle has no refcount drop to free it
                dropped = [r for r in dropped if r() is not None]
        candidates = [r for r in dropped + in_traceback if r() is not None]
        if not candidates:
            return
        allowed = self._traceback_referrers(error) if release_failed else set()
        if not allowed:
            return
        for ref in candidates:
            if self._referenced_only_by(ref, allowed):
                obj = ref()
                if obj is not None and not obj.closed:
                    self.close(obj)
                del obj

    # -- helpers ------------------------------------------------------------------------
    def _purge_output_cache(self, refs: list["weakref.ref[Any]"]) -> None:
        """Drop IPython's hidden references (``_``, ``_N``, ``Out``, last result) to these handles."""
        ids = {id(o) for o in (r() for r in refs) if o is not None}
        ns = self.ns
        shell = self._shell
        hidden = getattr(shell, "user_ns_hidden", None)  # push(interactive=False) copies _, _N there too
        for space in (ns, hidden if isinstance(hidden, dict) else {}):
            for name in [n for n in list(space) if is_output_cache_name(n)]:
                if id(space[name]) in ids:
                    if name.strip("_"):
                        del space[name]
                    else:
                        space[name] = ""
        out = ns.get("_oh")
        if isinstance(out, dict):
            for key in [k for k, v in list(out.items()) if id(v) in ids]:
                del out[key]
        hook = getattr(shell, "displayhook", None)
        for attr in ("_", "__", "___"):
            if id(getattr(hook, attr, None)) in ids:
                setattr(hook, attr, "")
        last = getattr(shell, "last_execution_result", None)
        if last is not None and id(getattr(last, "result", None)) in ids:
            last.result = None

    @staticmethod
    def _exceptions(error: BaseException | None) -> list[BaseException]:
        """The failed cell's exception and sys.last_* with their causes and contexts."""
        roots = [error, getattr(sys, "last_exc", None), getattr(sys, "last_value", None)]
        seen: dict[int, BaseException] = {}
        stack = [e for e in roots if isinstance(e, BaseException)]
        while stack:
            exc = stack.pop()
            if id(exc) in seen:
                continue
            seen[id(exc)] = exc
            stack += [e for e in (exc.__cause__, exc.__context__) if e is not None]
        return list(seen.values())

    @classmethod
    def _frames(cls, error: BaseException | None) -> list[types.FrameType]:
        frames = []
        for exc in cls._exceptions(error):
            tb = exc.__traceback__
            while tb is not None:
                if tb.tb_frame.f_code.co_flags & _CO_OPTIMIZED:
                    frames.append(tb.tb_frame)
                tb = tb.tb_next
        return frames

    def _traceback_handles(self, error: BaseException) -> list["weakref.ref[Any]"]:
        """Handles that the failed cell's function frames hold in local variables."""
        found: dict[int, weakref.ref[Any]] = {}
        for frame in self._frames(error):
            for value in list(frame.f_locals.values()):
                if is_handle(value) and id(value) not in found:
                    found[id(value)] = weakref.ref(value)
        return list(found.values())

    def _traceback_referrers(self, error: BaseException | None) -> set[int]:
        """Ids of the objects that may be a released handle's only referrers: traceback frames and their locals."""
        allowed: set[int] = set()
        for frame in self._frames(error):
            allowed.add(id(frame))
            allowed.add(id(frame.f_locals))  # the snapshot dict that reading f_locals leaves on the frame
        return allowed

    @staticmethod
    def _referenced_only_by(ref: "weakref.ref[Any]", allowed: set[int]) -> bool:
        obj = ref()
        if obj is None:
            return False
        here = sys._getframe()
        referrers = gc.get_referrers(obj)
        del obj
        try:
            return all(r is here or id(r) in allowed for r in referrers)
        finally:
            del referrers, here
