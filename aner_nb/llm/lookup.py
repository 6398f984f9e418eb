"""Prompt-lookup proposals: guess the next tokens by finding the recent suffix earlier on.

Answers that copy names and terms from their prompt repeat token runs that
already occurred. If the last ``n`` tokens (n from 8 down to 2) occurred
before within the last 4096 tokens, the tokens that followed their most
recent earlier occurrence are proposed as the continuation. The target model
verifies proposals, so a wrong guess costs compute but never changes output.

``propose`` is the reference definition over a plain list; ``NgramIndex``
gives the same answers incrementally (a dict per n-gram length mapping each
n-gram to the start of its latest occurrence that has a successor), so a
decode step costs O(1) instead of a scan of the window.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["WINDOW", "MIN_NGRAM", "MAX_NGRAM", "propose", "NgramIndex"]

WINDOW = 4096
MIN_NGRAM = 2
MAX_NGRAM = 8


def propose(history: Sequence[int], max_tokens: int, *, window: int = WINDOW) -> list[int]:
    """Up to ``max_tokens`` tokens that followed the latest earlier occurrence of the longest suffix."""
    if max_tokens <= 0:
        return []
    h = list(history[-window:])
    size = len(h)
    for n in range(min(MAX_NGRAM, size - 1), MIN_NGRAM - 1, -1):
        suffix = h[size - n :]
        # latest start s < size - n whose n-gram equals the suffix (so h[s + n] exists)
        for s in range(size - n - 1, -1, -1):
            if h[s : s + n] == suffix:
                return h[s + n : s + n + max_tokens]
    return []


class NgramIndex:
    """Incremental equivalent of :func:`propose` over a growing token history."""

    def __init__(self, tokens: Sequence[int] = (), *, window: int = WINDOW) -> None:
        self.window = window
        self.tokens: list[int] = []
        # n -> {n-gram: latest start position that is followed by at least one token}
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MIN_NGRAM, MAX_NGRAM + 1)}
        self.extend(tokens)

    def append(self, token: int) -> None:
        t = self.tokens
        t.append(token)
        end = len(t) - 1  # the n-grams ending just before the new token now have a successor
        for n, latest in self._latest.items():
            start = end - n
            if start >= 0:
                latest[tuple(t[start:end])] = start

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def propose(self, max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        t = self.tokens
        size = len(t)
        low = size - self.window  # occurrences must lie entirely inside the window
        for n in range(min(MAX_NGRAM, size - 1), MIN_NGRAM - 1, -1):
            start = self._latest[n].get(tuple(t[size - n :]))
            if start is not None and start >= low and start + n < size:
                # the suffix itself was indexed only if it had a successor, so start < size - n
                return t[start + n : start + n + max_tokens]
        return []
