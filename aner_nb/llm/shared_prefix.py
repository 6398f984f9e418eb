"""Shared prefixes of a batching lease: evaluated prompt prefixes kept in spare KV streams.

A batching context has one KV stream per request sequence id plus
``prefix_cache_entries`` spare streams. When a request's prompt has been
evaluated, its first ``prefix_cache_tokens`` tokens are copied into a spare
stream (an *entry*). A later request whose prompt starts with the same tokens
copies the entry into its own stream, removes the positions past the common
prefix and evaluates only the rest, so a system prompt that every user sends
is evaluated once per lease instead of once per request.

The policy is pure functions over token tuples and frozen entries: which
entry a prompt starts from (:func:`best_entry`), which stream a newly
evaluated prefix goes to (:func:`retention_stream`; entries that served
another request, the shared system prompts, are kept over ones that never
did, least recently used first within each group), and whether a queued
request should wait for a prompt now being evaluated that it shares more
with (:func:`waits_for`). :class:`SharedPrefixes` keeps the bookkeeping; the
scheduler applies it to the engine.

Scope: one batching lease. Entries live in its own context; two leases
never share, and an entry survives the cancellation or failure of every
request that used it (requests copy from it, they never own it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from .prefix_pool import common_prefix_length, reusable_prefix
from .reuse import restore_point

if TYPE_CHECKING:
    from .prefix_store import PrefixStore

__all__ = ["PrefixEntry", "best_entry", "retention_stream", "waits_for", "SharedPrefixes", "WAIT_MIN_GAIN"]

# A queued request waits for a prompt being evaluated only when that saves at least this many
# tokens over the best entry: below it, evaluating the difference costs less than a step or two.
WAIT_MIN_GAIN = 64


@dataclass(frozen=True)
class PrefixEntry:
    """One retained prefix: the KV stream (sequence id) holding positions ``0..len(tokens)-1``."""

    seq: int
    tokens: tuple[int, ...]
    last_used: int
    hits: int = 0  # requests that started from it


def best_entry(
    entries: Sequence[PrefixEntry], prompt: Sequence[int], *, trivial_prefix: int
) -> tuple[PrefixEntry | None, int]:
    """The entry sharing the longest token prefix with ``prompt`` (most recent on ties), and how much to keep.

    A match no longer than ``trivial_prefix`` (the chat template's fixed
    opening) saves nothing worth a copy: ``(None, 0)``. The kept count leaves
    at least one prompt token to evaluate, whose logits give the first token.
    """
    best, best_len = None, 0
    for e in entries:
        n = common_prefix_length(e.tokens, prompt)
        if n > best_len or (n == best_len and best is not None and e.last_used > best.last_used):
            best, best_len = e, n
    if best is None or best_len <= trivial_prefix:
        return None, 0
    return best, reusable_prefix(best.tokens, prompt)


def retention_stream(entries: Sequence[PrefixEntry], tokens: Sequence[int], free: Sequence[int]) -> int | None:
    """The stream that should hold a newly evaluated prefix ``tokens``, or None to keep nothing.

    Nothing when an entry already starts with all of ``tokens``; else a free
    stream; else the entry to replace: one that never served a hit before one
    that did, the least recently used within each group.
    """
    tokens = tuple(tokens)
    if not tokens or any(e.tokens[: len(tokens)] == tokens for e in entries):
        return None
    if free:
        return min(free)
    if not entries:
        return None
    return min(entries, key=lambda e: (e.hits > 0, e.last_used)).seq


def waits_for(
    prompt: Sequence[int], evaluating: Sequence[Sequence[int]], best_match: int, *, cap: int,
    min_gain: int = WAIT_MIN_GAIN,
) -> bool:
    """Whether a queued ``prompt`` should wait for one of the prompts being ``evaluating`` now.

    It waits when one of them, once retained (its first ``cap`` tokens), would
    give it at least ``min_gain`` more cached tokens than ``best_match``, the
    best entry held now. Without the wait both requests would evaluate the
    shared part side by side, each at half the step budget.
    """
    return any(
        restore_point(min(common_prefix_length(p, prompt), cap), len(prompt)) - best_match >= min_gain for p in evaluating
    )


class SharedPrefixes:
    """The entries of one batching scheduler and the streams they may use (scheduler thread only)."""

    def __init__(
        self, streams: Sequence[int], *, max_tokens: int, trivial_prefix: int, store: "PrefixStore | None" = None
    ) -> None:
        self.tiers = store  # RAM / disk tiers behind the entries (prefix_store.py), or None
        self.streams = tuple(streams)
        self.max_tokens = max_tokens
        self.trivial_prefix = trivial_prefix
        self._entries: dict[int, PrefixEntry] = {}
        self._clock = 0
        self.hits = 0
        self.reused_tokens = 0
        self.retained = 0
        self.evicted = 0

    @property
    def capacity(self) -> int:
        return len(self.streams)

    # The prefix caches' one vocabulary (this class and PrefixPool): ``entries`` counts the held
    # prefixes, ``held_tokens`` sums their tokens, ``retained_tokens()`` lists them, least recent first.
    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def held_tokens(self) -> int:
        return sum(len(e.tokens) for e in self._entries.values())

    def retained_tokens(self) -> list[tuple[int, ...]]:
        return [e.tokens for e in self.held()]

    def held(self) -> tuple[PrefixEntry, ...]:
        """The entries themselves (stream, tokens, use), least recently used first."""
        return tuple(sorted(self._entries.values(), key=lambda e: e.last_used))

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def lookup(self, prompt: Sequence[int]) -> tuple[PrefixEntry | None, int]:
        """The entry a new request should copy and the tokens it keeps (see :func:`best_entry`)."""
        return best_entry(tuple(self._entries.values()), prompt, trivial_prefix=self.trivial_prefix)

    def used(self, entry: PrefixEntry, kept: int) -> None:
        """Record that a request started from ``entry`` with ``kept`` tokens."""
        self._entries[entry.seq] = replace(entry, last_used=self._tick(), hits=entry.hits + 1)
        self.hits += 1
        self.reused_tokens += kept

    def placement(self, prompt: Sequence[int]) -> tuple[int, tuple[int, ...]] | None:
        """Where an evaluated ``prompt``'s prefix goes and which tokens it keeps; None to retain nothing."""
        tokens = tuple(prompt[: self.max_tokens])
        if len(tokens) <= self.trivial_prefix:
            return None
        free = [s for s in self.streams if s not in self._entries]
        seq = retention_stream(tuple(self._entries.values()), tokens, free)
        return None if seq is None else (seq, tokens)

    def store(self, seq: int, tokens: tuple[int, ...]) -> None:
        """``seq`` now holds ``tokens`` (whatever it held before is gone)."""
        if seq in self._entries:
            self.evicted += 1
        self._entries[seq] = PrefixEntry(seq, tokens, self._tick())
        self.retained += 1

    def drop(self, seq: int) -> None:
        """``seq`` holds nothing usable any more."""
        self._entries.pop(seq, None)

    def would_wait(self, prompt: Sequence[int], evaluating: Sequence[Sequence[int]]) -> bool:
        """Whether a queued prompt should wait for one being evaluated (see :func:`waits_for`)."""
        if not evaluating:
            return False
        _, kept = self.lookup(prompt)
        return waits_for(prompt, evaluating, kept, cap=self.max_tokens)
