"""Test seam: faults injected at the engine's native calls (docs/reliability.md, "Fault injection").

``inject(*faults)`` arms frozen :class:`Fault` values for a ``with`` block; the
engine (``_engine.py``, the only module that imports llama_cpp) consults the
armed :class:`Injection` at each point of :data:`FAULT_POINTS` and, when a
fault fires, returns its ``result`` instead of making the native call, or
raises. Nothing here touches llama_cpp.

Off by default, and for tests only: the armed injection is the one piece of
mutable module state besides the notebook's handle registry. The engine keeps
a mirror of it in its own module global (:func:`mirror`), so a disarmed seam
costs each engine call one global lookup.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from .errors import EngineError

__all__ = ["FAULT_POINTS", "NO_FAULT", "Fault", "Injection", "inject", "armed", "mirror"]

FAULT_POINTS = (
    "model_load",  # before llama_model_load_from_file; subject: the path
    "model_loaded",  # after the weights loaded, before NativeModel returns; subject: the NativeModel
    "context_init",  # before llama_init_from_model; subject: the NativeModel
    "decode",  # NativeContext.decode; subject: the context, args: (batch,)
    "seq_rm",  # NativeContext.seq_rm (trims, releases); subject: the context, args: (seq, p0, p1)
    "tokenize",  # NativeModel.tokenize; subject: the model, args: (text,)
    "token_bytes",  # NativeModel.token_bytes (detokenizing one token); subject: the model, args: (token,)
    "free",  # _Owner.free of a live handle, before it is freed; subject: the owner
    "sampler_init",  # before a sampler chain is built; subject: the model, args: (spec,)
)

NO_FAULT = object()  # what Injection.fire returns when the engine should make its call as usual


@dataclass(frozen=True)
class Fault:
    """One fault the test seam injects at an engine call (see :func:`inject`).

    The first ``after`` matching calls at ``point`` pass; the next ``times``
    ones fire. A call matches when ``when(subject, *args)`` is true (no
    ``when``: every call). Firing runs ``action(subject, *args)`` first (to
    cancel a request or change a file at exactly that moment), then returns
    ``result`` instead of making the engine call (``decode``: a return code,
    1 = no KV slot, < 0 an error; ``seq_rm``: False = refused), or raises
    ``error``. A fault with none of the three raises an EngineError.
    """

    point: str
    after: int = 0
    times: int = 1
    result: Any = None
    error: BaseException | None = None
    action: "Callable[..., None] | None" = None
    when: "Callable[..., bool] | None" = None

    def __post_init__(self) -> None:
        if self.point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; known points: {', '.join(FAULT_POINTS)}")
        if self.after < 0 or self.times < 1:
            raise ValueError(f"a fault needs after >= 0 and times >= 1, got after={self.after}, times={self.times}")


class Injection:
    """What one ``inject`` block armed: how often each fault fired, and the native owners made meanwhile."""

    def __init__(self, faults: Sequence[Fault]) -> None:
        self.faults = tuple(faults)
        self._seen = [0] * len(self.faults)
        self._fired = [0] * len(self.faults)
        self._lock = threading.Lock()
        self._owners: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def fired(self, point: str | None = None) -> int:
        """Times the faults (at ``point``, or all) fired."""
        with self._lock:
            return sum(n for f, n in zip(self.faults, self._fired) if point is None or f.point == point)

    def live(self) -> dict[str, int]:
        """Native owners created while armed that are still alive, by kind (``context``, ``batch``...)."""
        with self._lock:
            owners = list(self._owners)
        counts: dict[str, int] = {}
        for owner in owners:
            if owner.alive:
                kind = owner._what.split()[0]
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    def track(self, owner: Any) -> None:
        """Record a native owner (``_engine._Owner``: ``alive``, ``_what``) created while armed."""
        with self._lock:
            self._owners.add(owner)

    def fire(self, point: str, subject: Any, *args: Any) -> Any:
        """The firing fault's result for this call, or :data:`NO_FAULT` to make the engine call as usual."""
        fault = self._hit(point, subject, args)
        if fault is None:
            return NO_FAULT
        if fault.action is not None:
            fault.action(subject, *args)
        if fault.result is not None:
            return fault.result
        if fault.error is not None:
            # A copy: the armed instance would otherwise keep the frames (and handles) of its first raise.
            raise copy.copy(fault.error)
        if fault.action is None:
            raise EngineError(f"injected fault at {point}")
        return NO_FAULT

    def _hit(self, point: str, subject: Any, args: tuple[Any, ...]) -> "Fault | None":
        hit = None
        with self._lock:
            for i, fault in enumerate(self.faults):
                if fault.point != point or (fault.when is not None and not fault.when(subject, *args)):
                    continue
                self._seen[i] += 1
                if hit is None and self._seen[i] > fault.after and self._fired[i] < fault.times:
                    self._fired[i] += 1
                    hit = fault
        return hit


_armed: Injection | None = None  # the armed test seam, or None (the default)
_mirrors: list[Callable[[Injection | None], None]] = []


def armed() -> Injection | None:
    """The injection an ``inject`` block armed, or None."""
    return _armed


def mirror(setter: Callable[[Injection | None], None]) -> None:
    """Call ``setter`` with the armed injection now and whenever a block arms or disarms.

    The engine mirrors it in a module global of its own, so that its native
    calls test one global (``_faults is None``) rather than look this module up.
    """
    _mirrors.append(setter)
    setter(_armed)


def _arm(injection: Injection | None) -> None:
    global _armed
    _armed = injection
    for setter in _mirrors:
        setter(injection)


@contextlib.contextmanager
def inject(*faults: Fault) -> Iterator[Injection]:
    """Test seam: arm ``faults`` at the engine calls named by their points for the ``with`` block.

    Not for production code: it makes every engine call of the process
    consult the armed faults. Blocks do not nest.
    """
    if _armed is not None:
        raise RuntimeError("fault injection is already armed (inject() blocks do not nest)")
    injection = Injection(faults)
    _arm(injection)
    try:
        yield injection
    finally:
        _arm(None)
