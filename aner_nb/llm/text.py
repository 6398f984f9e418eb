"""Turning sampled token bytes into text that is safe to show: UTF-8 and stop strings.

A token's piece can end in the middle of a UTF-8 character, and a stop string
can span several tokens, so text is held back until it can no longer change:
incomplete characters stay in the incremental decoder, and a tail that could
still grow into a stop string stays pending. Pure code, no engine.
"""

from __future__ import annotations

import codecs

__all__ = ["TextAssembler"]


class TextAssembler:
    """Feed token bytes, get the newly final text; stops at the first stop string."""

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._stop = tuple(stop)
        self._pending = ""
        self._parts: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._parts)

    def feed(self, piece: bytes) -> str:
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(piece)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush what is held back (an incomplete character becomes U+FFFD)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        pending = self._pending
        cut = self._first_stop(pending)
        if cut is not None:
            out, self._pending, self.stopped = pending[:cut], "", True
        else:
            keep = 0 if final else self._stop_prefix_tail(pending)
            out, self._pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
        if out:
            self._parts.append(out)
        return out

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _stop_prefix_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
