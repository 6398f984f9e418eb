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

__all__ = [
    "WINDOW", "MIN_NGRAM", "MAX_NGRAM", "MAX_BACKOFF", "MIN_ACCEPTANCE", "propose", "NgramIndex", "DraftPolicy",
]

WINDOW = 4096
MIN_NGRAM = 2
MAX_NGRAM = 8
MAX_BACKOFF = 64
# Below this estimated chance that a proposed token is accepted, proposing costs more than it saves:
# on the demo model a 2-row step costs 1.8x a 1-row step (every row pays the 262k-vocabulary output
# product; benchmarks/bench_decode_rows.py), so one proposal pays only when accepted >= ~80% of the time.
MIN_ACCEPTANCE = 0.8
_DECAY = 0.75  # weight of the past in the acceptance estimate (about the last four steps)


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


class DraftPolicy:
    """How many proposals the next step verifies: grow while accepted, back off when it does not pay.

    Every verified row costs a full output-layer product (262k logits on the
    demo model), so proposals the model rejects make a step dearer than plain
    decoding. After full acceptance the length doubles (up to ``maximum``);
    after a partial one it shrinks to what was accepted plus one. The policy
    also keeps a decaying estimate of the chance that a proposed token is
    accepted (accepted tokens over accepted tokens plus first rejections);
    after a complete rejection, or a partial one while that estimate is below
    ``MIN_ACCEPTANCE``, no proposal is made for the next ``skip`` steps, a
    pause that doubles with each such step (up to MAX_BACKOFF steps) and
    resets only on an acceptance while the estimate is good. Only the
    speed depends on it: verification keeps the output equal to plain greedy
    decoding.
    """

    def __init__(self, maximum: int) -> None:
        if maximum < 1:
            raise ValueError(f"maximum must be >= 1, got {maximum}")
        self.maximum = maximum
        self.length = maximum
        self.skip = 0
        self._backoff = 1
        # An optimistic start (as if four tokens had been accepted): the first proposals are tried.
        self._accepted = 4.0
        self._rejected = 0.0

    @property
    def acceptance(self) -> float:
        """The current estimate of the chance that a proposed token is accepted."""
        return self._accepted / (self._accepted + self._rejected)

    def budget(self) -> int:
        """Proposals allowed for the coming step (0 while backing off)."""
        if self.skip:
            self.skip -= 1
            return 0
        return self.length

    def update(self, proposed: int, accepted: int) -> None:
        """Record the outcome of one verification step."""
        if proposed <= 0:
            return
        self._accepted = _DECAY * self._accepted + accepted
        self._rejected = _DECAY * self._rejected + (1 if accepted < proposed else 0)
        if accepted >= proposed:
            self.length = min(self.maximum, self.length * 2)
            if self.acceptance >= MIN_ACCEPTANCE:  # one lucky short match does not end a back-off
                self._backoff = 1
            return
        self.length = max(1, min(self.maximum, accepted + 1)) if accepted > 0 else 1
        if accepted > 0 and self.acceptance >= MIN_ACCEPTANCE:
            self._backoff = 1
            return
        self.skip = self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF)
