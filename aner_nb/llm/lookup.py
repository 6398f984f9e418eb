"""Prompt-lookup proposals: guess the next tokens by finding the recent suffix earlier on.

Answers that copy names and terms from their prompt repeat token runs that
already occurred. If the last ``n`` tokens (n from 8 down to 2) occurred
before within the last 4096 tokens, the tokens that followed their most
recent earlier occurrence are proposed as the continuation. The target model
verifies proposals, so a wrong guess costs compute but never changes output.

``propose`` is the reference definition over a plain list; ``NgramIndex``
gives the same answers incrementally (a dict per n-gram length mapping each
n-gram to the start of its latest occurrence that has a successor), so a
decode step costs O(1) instead of a scan of the window. Its ``lookup`` also
says how far back the match really goes (up to ``MAX_MATCH`` tokens), which
the draft policy uses to judge how far the continuation can be trusted.

``LookupCorpus`` is the same index over the prompts and answers of a
lease's earlier requests (bounded in tokens): a re-run cell with an edited
prompt, or a revision of an earlier answer, repeats text that its own
prompt does not hold. A corpus belongs to one lease, so requests of
independent leases never see each other's text.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass
from typing import Sequence

__all__ = ["WINDOW", "MIN_NGRAM", "MAX_NGRAM", "MAX_MATCH", "CORPUS_TOKENS", "Draft", "propose", "NgramIndex", "LookupCorpus"]

WINDOW = 4096
MIN_NGRAM = 2
MAX_NGRAM = 8
# A match found with an n-gram is measured further back, up to this many tokens: how long the history
# has been repeating is the best predictor of how long it goes on repeating (SuffixDecoding's insight).
MAX_MATCH = 64
# The tokens a lease's cross-request corpus keeps (prompts and answers of its latest requests).
CORPUS_TOKENS = 16384


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

    def latest(self, ngram: Sequence[int]) -> int | None:
        """Where the latest occurrence of ``ngram`` (2..MAX_NGRAM tokens) with a successor starts."""
        return self._latest[len(ngram)].get(tuple(ngram))

    def propose(self, max_tokens: int) -> list[int]:
        draft = self.lookup(max_tokens)
        return list(draft.tokens) if draft is not None else []

    def lookup(self, max_tokens: int) -> "Draft | None":
        """:meth:`propose`'s continuation with the length of the match behind it (None: no match)."""
        if max_tokens <= 0:
            return None
        t = self.tokens
        size = len(t)
        low = max(size - self.window, 0)  # occurrences must lie entirely inside the window
        for n in range(min(MAX_NGRAM, size - 1), MIN_NGRAM - 1, -1):
            start = self.latest(t[size - n :])
            if start is not None and start >= low and start + n < size:
                # the suffix itself was indexed only if it had a successor, so start < size - n
                match = n + _matched_before(t, start, t, size - n, MAX_MATCH - n, low)
                return Draft(tuple(t[start + n : start + n + max_tokens]), match)
        return None


@dataclass(frozen=True)
class Draft:
    """A proposed continuation and how many trailing history tokens matched where it was found."""

    tokens: tuple[int, ...]
    match: int
    source: str = "request"  # "request": its own prompt and output; "lease": an earlier request's


def _matched_before(a: Sequence[int], a_end: int, b: Sequence[int], b_end: int, limit: int, low: int = 0) -> int:
    """How many tokens right before ``a[a_end]`` and ``b[b_end]`` agree, counting back (at most ``limit``)."""
    k = 0
    while k < limit and a_end - k - 1 >= low and b_end - k - 1 >= 0 and a[a_end - k - 1] == b[b_end - k - 1]:
        k += 1
    return k


class LookupCorpus:
    """The prompts and answers of a lease's latest requests, searchable by another request's suffix.

    Bounded by ``capacity`` tokens: past it, the oldest requests are dropped
    until three quarters remain and the index is rebuilt (amortised over
    the requests added since). Safe to share between a lease's threads.
    """

    def __init__(self, capacity: int = CORPUS_TOKENS) -> None:
        if capacity < MAX_NGRAM + 1:
            raise ValueError(f"a corpus holds at least {MAX_NGRAM + 1} tokens, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._segments: deque[list[int]] = deque()
        self._index = NgramIndex(window=capacity)
        self._ends: list[int] = []  # where each segment ends in the index's token list

    def __len__(self) -> int:
        return len(self._index.tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """Remember one request's tokens (its prompt and answer) as the newest segment."""
        segment = list(tokens[-self.capacity :])
        if len(segment) <= MIN_NGRAM:
            return
        with self._lock:
            self._segments.append(segment)
            if len(self._index.tokens) + len(segment) <= self.capacity:
                self._index.extend(segment)
                self._ends.append(len(self._index.tokens))
                return
            total = sum(map(len, self._segments))
            while len(self._segments) > 1 and total > self.capacity * 3 // 4:
                total -= len(self._segments.popleft())
            self._index = NgramIndex(window=self.capacity)
            self._ends = []
            for kept in self._segments:
                self._index.extend(kept)
                self._ends.append(len(self._index.tokens))

    def lookup(self, history: Sequence[int], max_tokens: int) -> "Draft | None":
        """The continuation of the longest suffix of ``history`` found in an earlier request (None: none)."""
        if max_tokens <= 0:
            return None
        size = len(history)
        with self._lock:
            t = self._index.tokens
            for n in range(min(MAX_NGRAM, size), MIN_NGRAM - 1, -1):
                start = self._index.latest(history[size - n :])
                if start is None:
                    continue
                seg = bisect.bisect_right(self._ends, start)  # the request whose tokens hold the occurrence
                end = self._ends[seg] if seg < len(self._ends) else len(t)
                continuation = t[start + n : min(start + n + max_tokens, end)]
                if not continuation:  # the occurrence ends its request: what followed it is another request
                    continue
                first = self._ends[seg - 1] if seg > 0 else 0
                match = n + _matched_before(t, start, history, size - n, MAX_MATCH - n, first)
                return Draft(tuple(continuation), match, "lease")
        return None
