"""Prefix cache of a latency profile: retained contexts whose KV holds earlier prompts.

A request takes the retained context whose tokens share the longest identical
prefix with its prompt, removes the divergent positions and evaluates only
the rest. Only a successful request gives its context back, trimmed to its
first ``prefix_cache_tokens`` prompt tokens (generated positions are always
removed). Failed, cancelled or invalid contexts are freed.

Trusted cache domain only: a pool serves one lease, and the timings of a
request reveal how much of its prompt another request of the same lease sent
before. Do not share one optimizer lease between users who must not learn
each other's prompts.

The policy (which entry, how much to keep, what to evict) is pure functions
over token tuples; ``PrefixPool`` applies it to engine contexts.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Sequence

from ._engine import ContextParams, NativeModel
from .context_pool import Acquired, ContextSlot, free_all, new_slot
from .errors import LLMError
from .prefix_store import PrefixStore
from .prefix_tiers import TIER_CODES, common_length
from .reuse import BLOCKED, ReuseShape
from .timings import PoolTimings, PrefixCacheTimings, PrefixTierTimings, TimingsPart

__all__ = [
    "Choice",
    "choose",
    "common_prefix_length",
    "reusable_prefix",
    "retain_length",
    "lru_victim",
    "PrefixPool",
]


common_prefix_length = common_length  # the pool's name for it (shared_prefix, tests, notebooks)


def reusable_prefix(cached: Sequence[int], prompt: Sequence[int], shape: ReuseShape = BLOCKED) -> int:
    """Prompt tokens that can stay in the KV: the common prefix cut to a restore point (``ReuseShape.restore_point``).

    A fully cached prompt still evaluates its last few tokens; they are not
    counted as cached input.
    """
    return shape.restore_point(common_prefix_length(cached, prompt), len(prompt), len(cached))


@dataclass(frozen=True)
class Choice:
    """What to do for one prompt: reuse ``entry`` keeping ``keep`` tokens, or start empty.

    ``entry`` is None for a miss; then ``evict`` names the least recently used
    entry to recycle when the pool is full, or is None when a new context may
    be created (capacity remains) so no useful entry is lost.
    """

    entry: int | None
    keep: int
    evict: int | None = None


def choose(
    entries: Sequence[Sequence[int]],
    last_used: Sequence[int],
    prompt: Sequence[int],
    *,
    trivial_prefix: int,
    capacity: int,
    in_use: int = 0,
    shape: ReuseShape = BLOCKED,
) -> Choice:
    """Pick the entry with the longest identical token prefix (most recent on ties).

    A match no longer than ``trivial_prefix`` (the chat template's fixed
    opening, BOS included) saves nothing worth an entry: while capacity
    remains, such a request gets a fresh context and the entry stays.
    """
    best, best_len = None, 0
    for i, tokens in enumerate(entries):
        n = common_prefix_length(tokens, prompt)
        if n > best_len or (n == best_len and best is not None and last_used[i] > last_used[best]):
            best, best_len = i, n
    if best is not None and best_len > trivial_prefix:
        return Choice(best, reusable_prefix(entries[best], prompt, shape))
    if len(entries) + in_use < capacity or not entries:
        return Choice(None, 0, None)
    return Choice(None, 0, lru_victim(last_used))


def lru_victim(last_used: Sequence[int]) -> int:
    """Index of the least recently used entry."""
    return min(range(len(last_used)), key=lambda i: last_used[i])


def retain_length(prompt_len: int, cap: int, shape: ReuseShape = BLOCKED) -> int:
    """Prompt tokens kept after a successful request: at most ``cap``, none of a prompt too short to reuse (``ReuseShape.retained_rows``)."""
    return shape.retained_rows(max(0, min(prompt_len, cap)), prompt_len)


class _Entry:
    __slots__ = ("slot", "tokens", "last_used", "written")

    def __init__(
        self, slot: ContextSlot, tokens: tuple[int, ...], last_used: int, written: tuple[int, ...] | None = None
    ) -> None:
        self.slot = slot
        self.tokens = tokens
        self.last_used = last_used
        self.written = written  # the tokens its disk write-through was stored under (the whole prompt, or these)


class PrefixPool:
    """Retained contexts of one lease, at most ``capacity`` of them."""

    def __init__(
        self, model: NativeModel, params: ContextParams, *, capacity: int, max_tokens: int, trivial_prefix: int,
        store: PrefixStore | None = None, warm: bool = False,
    ) -> None:
        self.model = model
        self.store = store  # RAM / disk tiers behind the live entries, or None
        self.params = params
        self.shape = params.prefix_reuse or BLOCKED  # where a prompt may start over cached KV
        self.capacity = capacity
        self.max_tokens = max_tokens
        self.trivial_prefix = trivial_prefix
        self._entries: list[_Entry] = []
        self._in_use = 0
        self._clock = 0
        self._lock = threading.Lock()
        self._closed = False
        self.created = 0
        # ``warm``: the first context is made now, as llama.cpp's server makes its slots at start, so the
        # first request (a restore from the disk tier after a restart) does not wait ~50 ms for one.
        self._spare: ContextSlot | None = None
        if warm:
            self._spare = self._new_slot()

    def _new_slot(self) -> ContextSlot:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            return spare
        slot = new_slot(self.model, self.params)
        self.created += 1
        return slot

    def _abandon(self, slot: ContextSlot | None) -> None:
        """An acquire that failed (no context could be made, an interrupt in the trim): return its use."""
        with self._lock:
            self._in_use -= 1
        if slot is not None:
            slot.free()

    def acquire(self, prompt: Sequence[int]) -> Acquired:
        with self._lock:
            entries = self._entries
            choice = choose(
                [e.tokens for e in entries], [e.last_used for e in entries], prompt,
                trivial_prefix=self.trivial_prefix, capacity=self.capacity, in_use=self._in_use, shape=self.shape,
            )
            retained = (len(entries), sum(len(e.tokens) for e in entries))  # as the request found it
            index = choice.entry if choice.entry is not None else choice.evict
            taken = entries.pop(index) if index is not None else None
            self._in_use += 1
        found = {"prefix_cache_entries": retained[0], "prefix_cache_retained_tokens": retained[1]}
        if self.store is not None:
            return self._acquire_tiered(prompt, choice, taken, found)
        if taken is None:
            try:
                slot = self._new_slot()
            except BaseException:
                self._abandon(None)
                raise
            return Acquired(slot, 0, (
                PoolTimings(cached_input_tokens=0, context_pool_reused=0), PrefixCacheTimings(prefix_cache_hit=0, **found),
            ))
        t0 = time.perf_counter_ns()
        keep = choice.keep
        try:
            if keep == 0 or not taken.slot.ctx.trim(0, keep):
                # The kept range did not survive (a sliding-window cache without swa_full): no reuse.
                taken.slot.ctx.clear()
                keep = 0
        except BaseException:  # the entry left the pool; its KV is in an unknown state
            self._abandon(taken.slot)
            raise
        pool = PoolTimings(cached_input_tokens=keep, context_clear_duration=time.perf_counter_ns() - t0, context_pool_reused=1)
        return Acquired(taken.slot, keep, (pool, PrefixCacheTimings(prefix_cache_hit=int(keep > 0), **found)))

    def _acquire_tiered(
        self, prompt: Sequence[int], choice: Choice, taken: "_Entry | None", found: dict[str, int]
    ) -> Acquired:
        """``acquire`` with RAM / disk tiers: demote an evicted entry, then restore a longer stored prefix if any."""
        store = self.store
        assert store is not None
        written = 0
        slot = taken.slot if taken is not None else None
        try:
            # The least recently used entry leaves live KV, or a short match (a shared template or system
            # part) would cut away more of the entry than it keeps: keep it in the tiers before its context
            # is reused.
            lost = len(taken.tokens) - choice.keep if taken is not None else 0
            if taken is not None and slot is not None and (choice.entry is None or lost > max(64, choice.keep)):
                written = store.demote(slot.ctx, taken.tokens, taken.written)
            if slot is None:
                slot = self._new_slot()
            t0 = time.perf_counter_ns()
            live = choice.keep if choice.entry is not None else 0
            restored = store.restore(slot.ctx, 0, prompt, better_than=live) if prompt else None
            keep, tier = 0, "cold"
            if restored is not None:
                keep, tier = restored.keep, restored.tier
            elif live > 0 and taken is not None and slot.ctx.seq_pos_max(0) == len(taken.tokens) - 1 and slot.ctx.trim(0, live):
                keep, tier = live, "live"
            else:
                slot.ctx.clear()  # a miss, a kept range that did not survive, or a failed restore
        except BaseException:  # the context left the pool; its KV is in an unknown state
            self._abandon(slot)
            raise
        parts: tuple[TimingsPart, ...] = (
            PoolTimings(
                cached_input_tokens=keep, context_clear_duration=time.perf_counter_ns() - t0,
                context_pool_reused=int(taken is not None),
            ),
            PrefixCacheTimings(prefix_cache_hit=int(keep > 0), **found),
            PrefixTierTimings(
                prefix_cache_tier=TIER_CODES[tier],
                prefix_restored_tokens=restored.keep if restored is not None else 0,
                prefix_tier_bytes_read=restored.bytes_read if restored is not None else 0,
                prefix_tier_bytes_written=written,
                prefix_restore_duration=restored.duration if restored is not None else -1,
            ),
        )
        return Acquired(slot, keep, parts, restored.logits if restored is not None else None)

    def pin(self, slot: ContextSlot, prompt: Sequence[int], lengths: Sequence[int]) -> None:
        """Keep prefixes of ``prompt`` (its system part, a checkpoint) in the tiers, pinned apart from the LRU.

        ``slot`` holds ``prompt`` from position 0 (at least the longest length). A
        prefix already stored is not saved again; a new one is cut from a copy of
        the state in a scratch context, so the request's own context keeps its KV.
        """
        store = self.store
        if store is None:
            return
        # a pinned length is cut as every kept prefix is (reuse.retained_rows)
        cut = {self.shape.retained_rows(n, len(prompt)) for n in lengths}
        todo = sorted({n for n in cut if 0 < n <= slot.ctx.seq_pos_max(0) + 1}, reverse=True)
        todo = [n for n in todo if not (
            (store.ram is not None and tuple(prompt[:n]) in store.ram) or (store.ram is None and not store.wants_disk(prompt[:n]))
        )]
        if not todo:
            return
        state = slot.ctx.seq_state_bytes(0)
        scratch = self._new_slot()
        try:
            scratch.ctx.seq_state_load(0, state)
            for n in todo:  # longest first: each cut trims the previous one
                if not scratch.ctx.trim(0, n):
                    break
                store.save(scratch.ctx, 0, prompt[:n], ram=True, disk=True, pinned=True)
        finally:
            scratch.free()

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether a request should keep its last prompt row's logits for :meth:`give_back` (a disk tier)."""
        return self.store is not None and self.store.disk is not None

    def give_back(
        self, slot: ContextSlot, prompt: Sequence[int], *, outcome: str, pins: Sequence[int] = (), logits=None
    ) -> None:
        """Retain a successful (``outcome="ok"``) request's context with its prompt prefix; free anything else.

        ``pins``: prefix lengths of ``prompt`` to keep pinned in the tiers (see :meth:`pin`). ``logits``:
        the prompt's last row (``wants_prompt_logits``), stored with the whole prompt in the disk tier.
        """
        # At most the prompt's body (ReuseShape.retained_rows), which the same prompt again restores whole:
        # what a sliding-window entry needs, as it restores only whole (see PrefixStore).
        keep = retain_length(len(prompt), self.max_tokens, self.shape)
        retained = False
        written: tuple[int, ...] | None = None
        evicted: list[ContextSlot] = []
        demoted: list[_Entry] = []  # live entries leaving the pool: kept in the tiers first
        try:
            # Write-through (before another request can take the context): a disk tier holds every retained
            # prefix, so a new process finds it. With the last row's logits the whole prompt is stored first
            # (asked again, it evaluates nothing; other prompts reuse its body); store.save checks that the
            # sequence holds exactly it.
            wanted = outcome == "ok" and keep > 0 and slot.ctx.alive
            store = self.store if wanted else None
            whole = (
                store is not None and logits is not None and len(prompt) <= self.max_tokens
                and slot.ctx.trim(0, len(prompt))
            )
            if whole:
                store.save(slot.ctx, 0, prompt, ram=False, disk=True, logits=logits)  # type: ignore[union-attr]
            # ``retained`` turns true only once the trim to ``keep`` succeeded: an interrupt inside it leaves
            # it false, and the context is freed below.
            retained = wanted and slot.ctx.trim(0, keep)
            if retained and store is not None:
                written = tuple(prompt) if whole else tuple(prompt[:keep])
                if not whole:
                    store.save(slot.ctx, 0, prompt[:keep], ram=False, disk=True)
                if pins:
                    try:
                        self.pin(slot, prompt, [n for n in pins if n <= keep])
                    except LLMError as exc:  # a tier is an optimisation: the request itself succeeded
                        store.stats.skip("save_failed", f"pinning a system prefix: {exc}")
        finally:  # an interrupt inside the trim still returns the use and frees the slot
            with self._lock:
                self._in_use -= 1
                if retained and not self._closed:
                    self._clock += 1
                    self._entries.append(_Entry(slot, tuple(prompt[:keep]), self._clock, written))
                    while len(self._entries) > self.capacity:
                        demoted.append(self._entries.pop(lru_victim([e.last_used for e in self._entries])))
                else:
                    evicted.append(slot)
            try:
                for e in demoted:  # ours now: popped from the pool under the lock
                    if self.store is not None:
                        self.store.demote(e.slot.ctx, e.tokens, e.written)
            finally:
                free_all(evicted + [e.slot for e in demoted])

    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def held_tokens(self) -> int:
        """Tokens of every prefix held (the vocabulary of :class:`~aner_nb.llm.shared_prefix.SharedPrefixes` too)."""
        with self._lock:
            return sum(len(e.tokens) for e in self._entries)

    def retained_tokens(self) -> list[tuple[int, ...]]:
        """The token prefixes held, most recently used last (for tests and dashboards)."""
        with self._lock:
            return [e.tokens for e in sorted(self._entries, key=lambda e: e.last_used)]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries, self._entries = self._entries, []
            spare, self._spare = self._spare, None
        free_all([e.slot for e in entries] + ([spare] if spare is not None else []))
        if self.store is not None:
            self.store.close()
