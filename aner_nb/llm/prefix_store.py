"""The prefix tiers applied to contexts: save a sequence's KV into RAM/disk, restore the longest stored prefix.

:class:`PrefixStore` owns one lease's :class:`~aner_nb.llm.prefix_tiers.RamTier`
and :class:`~aner_nb.llm.prefix_tiers.DiskTier` and its counters. Saving
serialises a sequence straight into its file's bytes (``NativeContext.seq_state_copy``
into ``kv_identity.pack_in_place``), stamped with the context's
:class:`~aner_nb.llm.kv_identity.KVIdentity`; an entry whose write-through is still
queued is not serialised again.
Restoring verifies a stored entry against this lease's identity
(``kv_identity.unpack`` / ``read_file``, header first, bounded by the tier's
budget) and its token ids against the request's before llama.cpp sees the
payload; anything that does not match is skipped, counted by reason, logged,
and the request runs cold. A restore that llama.cpp refuses, or that does not
leave exactly the stored positions, is cleared again and counted as
``load_failed``.

Disk writes leave the request's thread (:mod:`aner_nb.llm.disk_writer`): the
request serialises and packs the state, a low-priority writer thread writes it
(atomically, without fsync: ``kv_identity.write_cache_file``). An entry still
queued is served from the queue (counted as a disk hit); :meth:`PrefixStore.flush`
and :meth:`PrefixStore.close` wait for the queue.

A whole prompt (what a latency lease writes through to disk) is stored with the
float32 logits of its last row, taken right after its prefill: asking exactly
that prompt again restores every position and samples its first token from
those logits, evaluating nothing (the uncached run's first token, bit for bit,
where a replayed last token would be computed in another batch shape). The
rows of such an entry after its body were its prompt's tail, evaluated in a
call of their own, so any other prompt reuses at most its body
(``ReuseShape.retained_rows``), as it would from a live entry.

Sliding-window models: a state is only restored when the context keeps the
full SWA cache (``swa_full``); :func:`check_tiers_allowed` refuses the tiers
otherwise. A one-sequence context (a latency lease) then saves every cell of
its sequence (``KVIdentity.state == "all_cells"``), loaded back where it was
evaluated, so a restored prefix is trimmed and continued like a live one. A
batching lease's per-sequence states keep only the last window and are used whole.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from . import kv_identity
from .disk_writer import DiskWriter
from .errors import ConfigurationError, LLMError, StateMismatchError
from .kv_identity import KVIdentity
from .prefix_tiers import TIER_CODES, DiskTier, RamTier, TierConfig, TierStats, common_length
from .reuse import BLOCKED, ReuseShape

__all__ = ["MIN_RESTORE_GAIN", "Restored", "PrefixStore", "check_tiers_allowed"]

log = logging.getLogger(__name__)


def check_tiers_allowed(config: TierConfig, *, n_swa: int, swa_full: bool) -> None:
    """Refuse tiers on a sliding-window context without the full SWA cache (restores would not be exact)."""
    if config.enabled and n_swa > 0 and not swa_full:
        raise ConfigurationError(
            f"prefix tiers (prefix_cache_ram_bytes / prefix_cache_dir) need the full sliding-window cache on this "
            f"model (sliding window {n_swa}): a window-sized SWA cache saves only the last {n_swa} positions, so a "
            "restored prefix would not be the evaluated one; this profile's contexts keep only the window",
            param="prefix_cache_dir" if config.directory else "prefix_cache_ram_bytes",
        )


@dataclass(frozen=True)
class Restored:
    """What a restore put into a sequence: ``keep`` prompt tokens from ``tier`` (``"ram"`` or ``"disk"``).

    ``logits`` (float32, one per vocabulary entry) when the entry was exactly the
    prompt, stored with its last row's logits: then ``keep`` is the whole prompt and
    the first token is sampled from them.
    """

    tier: str
    keep: int
    stored: int  # tokens the entry held (keep may be less: the request's last tokens are evaluated again)
    bytes_read: int
    duration: int  # ns
    logits: "np.ndarray | None" = None

    @property
    def code(self) -> int:
        return TIER_CODES[self.tier]


_REFUSED = object()  # a stored entry that was skipped (counted by reason): not tried again from RAM

# A load copies the stored entry's whole state (39 MB for SmolLM2's 1.7k tokens: 10-20 ms at 2 vCPUs) before
# it is cut to the restore point: against a live context that keeps some of the prompt already, an entry
# must save at least this many more tokens of prefill (seen: a 39 MB restore for 2 tokens of a shared heading).
MIN_RESTORE_GAIN = 16


class PrefixStore:
    """One lease's RAM and disk tiers. ``identity`` gives the identity of a context of this lease."""

    def __init__(
        self, config: TierConfig, identity: Callable[[Any], KVIdentity], *, trivial_prefix: int = 0, n_swa: int = 0,
        shape: ReuseShape = BLOCKED,
    ) -> None:
        self.config = config
        self.shape = shape  # where a prompt may start over a stored prefix (the lease's contexts' shape)
        # A sliding-window model's per-sequence state holds only the last window of its SWA layers' cells
        # (even from a full SWA cache), so such an entry continues exactly from its end but cannot be cut
        # shorter: only entries that are a whole prefix of the prompt are used, never trimmed. A state of
        # every cell (a one-sequence context's identity) has no such limit: see exact_only.
        self.n_swa = n_swa
        self._identity_of = identity
        self._identity: KVIdentity | None = None
        self.trivial_prefix = trivial_prefix
        self.ram = RamTier(config.ram_bytes) if config.ram_bytes > 0 else None
        self.disk = (
            DiskTier(config.directory, config.disk_bytes, kv_identity.write_cache_file) if config.directory else None
        )
        self.stats = TierStats()
        self._suspect: set[Path] = set()  # disk files skipped: a later save may replace them
        self.writer = DiskWriter(self.disk.write, self._written) if self.disk is not None else None

    def identity(self, ctx: Any) -> KVIdentity:
        if self._identity is None:
            self._identity = self._identity_of(ctx)
        return self._identity

    @property
    def exact_only(self) -> bool:
        """Whether stored entries are used only whole (per-sequence states of a sliding-window model)."""
        return self.n_swa > 0 and not (self._identity is not None and self._identity.partial_reuse)

    # -- saving --------------------------------------------------------------------
    def wants_disk(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` should be written through to disk (not there yet, or a skipped file is)."""
        if self.disk is None or len(tokens) <= self.trivial_prefix:
            return False
        assert self.writer is not None
        if self.writer.pending(tuple(tokens)) is not None:
            return False
        path = self.disk.path_for(tokens)
        return path in self._suspect or not path.exists()

    def save(
        self, ctx: Any, seq: int, tokens: Sequence[int], *, ram: bool, disk: bool, pinned: bool = False,
        logits: Any = None,
    ) -> int:
        """Serialise ``seq`` (holding exactly ``tokens``) into the RAM tier and/or disk; bytes stored (both tiers).

        ``logits``: the float32 row of the last token, only when ``tokens`` is a whole
        evaluated prompt (see the module's notes). Failures (no state, a full or
        read-only directory) are counted and logged, never raised: a tier is an optimisation.
        """
        tokens = tuple(tokens)
        ram = ram and self.ram is not None and len(tokens) > self.trivial_prefix
        disk = disk and self.wants_disk(tokens)
        if not (ram or disk):
            return 0
        try:
            if ctx.seq_pos_max(seq) != len(tokens) - 1:
                self.stats.skip("load_failed", "the sequence does not hold exactly the prefix to save")
                return 0
            # A write-through's bytes not on disk yet hold this very prefix (same identity, same tokens: the
            # same KV, which is what makes reuse exact): an entry demoted soon after it was retained is not
            # serialised twice.
            blob = self.writer.pending(tokens) if self.writer is not None else None
            if blob is None:
                blob = kv_identity.pack_in_place(
                    self.identity(ctx), tokens, ctx.seq_state_size(seq), lambda view: ctx.seq_state_copy(seq, view),
                    logits=logits,
                )
        except (LLMError, ValueError) as exc:
            self.stats.skip("save_failed", str(exc))
            return 0
        return self.put(tokens, blob, ram=ram, disk=disk, pinned=pinned)

    def demote(self, ctx: Any, tokens: Sequence[int], written: Sequence[int] | None) -> int:
        """Keep a live entry holding ``tokens`` (sequence 0) in RAM as it leaves live KV; bytes stored.

        Its write-through (stored under ``written``: the whole prompt with its
        last row's logits, or ``tokens`` themselves), while still queued, is the
        entry itself, not serialised again.
        """
        if written is not None and self.writer is not None and self.ram is not None:
            blob = self.writer.pending(tuple(written))
            if blob is not None:
                return self.put(tuple(written), blob, ram=True, disk=False)
        return self.save(ctx, 0, tokens, ram=True, disk=True)

    def put(self, tokens: tuple[int, ...], blob: bytes, *, ram: bool, disk: bool, pinned: bool = False) -> int:
        """Store a packed entry; whatever leaves RAM goes to disk (when configured and not there).

        Returns the bytes stored, in RAM and on disk together.
        """
        written = 0
        spill: list[tuple[tuple[int, ...], bytes]] = []
        if ram and self.ram is not None:
            spill = self.ram.put(tokens, blob, pinned=pinned)
            if not any(k == tokens for k, _ in spill):
                written += len(blob)
                with self.stats.lock:
                    self.stats.bytes_written["ram"] += len(blob)
        if disk:
            spill.append((tokens, blob))
        for key, data in spill:
            if self.wants_disk(key):
                written += self._write_disk(key, data)
        return written

    def _write_disk(self, tokens: tuple[int, ...], blob: bytes) -> int:
        """Queue a write to the disk tier (see :mod:`aner_nb.llm.disk_writer`); the bytes handed over."""
        assert self.disk is not None and self.writer is not None
        if len(blob) > self.disk.budget:
            self.stats.skip("too_large", f"{len(blob)} bytes above the disk tier's {self.disk.budget}")
            return 0
        self.writer.submit(tokens, blob)
        return len(blob)

    def _written(self, tokens: tuple[int, ...], blob: bytes, error: "OSError | None", n: int) -> None:
        """The writer thread's report of one write: counted here, like every other tier event."""
        assert self.disk is not None
        if error is not None:
            self.stats.skip("write_failed", f"{self.disk.directory}: {error}")
            return
        self._suspect.discard(self.disk.path_for(tokens))
        with self.stats.lock:
            self.stats.bytes_written["disk"] += n

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued disk write is done (True), or ``timeout`` seconds (False)."""
        return self.writer.flush(timeout) if self.writer is not None else True

    # -- restoring -----------------------------------------------------------------
    def restore(self, ctx: Any, seq: int, prompt: Sequence[int], *, better_than: int) -> Restored | None:
        """Load the longest stored prefix of ``prompt`` into ``seq`` if it keeps more than ``better_than`` tokens.

        ``better_than`` > 0 (what a live context keeps): an entry must keep
        :data:`MIN_RESTORE_GAIN` tokens more. ``seq`` is cleared before a load.
        Returns None when nothing usable is stored (``seq`` untouched, or empty
        after a load that failed); every skipped entry is counted by reason.
        """
        prompt = tuple(prompt)
        floor = max(better_than + MIN_RESTORE_GAIN - 1 if better_than > 0 else 0, self.trivial_prefix)
        if self.shape.reuse_limit(len(prompt)) <= floor:
            return None
        t0 = time.perf_counter_ns()
        identity = self.identity(ctx)
        ram = self.ram.best(prompt, min_common=floor + 1) if self.ram is not None else None
        disk = self.disk.best(prompt, min_common=floor + 1) if self.disk is not None else []
        queued = [(common_length(k, prompt), k) for k in (self.writer.pending_keys() if self.writer else ())]
        queued = [(n, k) for n, k in queued if n > floor]
        if self.exact_only:  # whole prefixes only, leaving at least the prompt's tail (see __init__)
            limit = self.shape.reuse_limit(len(prompt))
            key = self.ram.longest(prompt[:limit], min_tokens=floor + 1) if self.ram is not None else None
            ram = (key, len(key)) if key is not None else None
            disk = [c for c in disk if c[0] == len(c[1]) <= limit]
            queued = [(n, k) for n, k in queued if n == len(k) <= limit]
        # The entry that keeps the most tokens serves; on equal matches RAM, then a queued write, then a file.
        candidates: list[tuple[int, int, int, Any]] = [(n, len(k), 1, k) for n, k in queued]
        candidates += [(n, len(stored), 2, (stored, path)) for n, stored, path in disk]
        if ram is not None:
            candidates.append((ram[1], len(ram[0]), 0, ram[0]))
        # What each would keep (the match cut to a restore point); a whole-prefix entry only if it keeps all.
        # An entry that is exactly the prompt may hold its last row's logits and then keep it all (checked
        # when it is read: _keep).
        kept = [
            (len(prompt) if self._may_be_whole(n, size, prompt) else self.shape.restore_point(n, len(prompt), size),
             n, source, what)
            for n, size, source, what in candidates
        ]
        choices = [(k, source, what) for k, n, source, what in kept if k > floor and (k == n or not self.exact_only)]
        choices.sort(key=lambda c: (-c[0], c[1]))
        for _, source, what in choices:
            if source == 0:
                assert self.ram is not None
                blob = self.ram.get(what)
                got = self._load(ctx, seq, prompt, what, blob, identity, "ram", t0, floor) if blob is not None else None
                if got is _REFUSED:
                    self.ram.discard(what)  # it did not load: never try it again
            elif source == 1:
                assert self.writer is not None
                blob = self.writer.pending(what)  # not on disk yet: the disk tier's entry, from the queue
                got = self._load(ctx, seq, prompt, what, blob, identity, "disk", t0, floor) if blob is not None else None
            else:
                got = self._load_file(ctx, seq, prompt, what[0], what[1], identity, t0, floor)
            if isinstance(got, Restored):
                return got
        with self.stats.lock:
            self.stats.misses += 1
        return None

    def _may_be_whole(self, common: int, size: int, prompt: Sequence[int]) -> bool:
        """Whether an entry of ``size`` tokens sharing ``common`` with ``prompt`` is exactly the prompt (and so
        may carry its last row's logits); never for whole-prefix-only states (a batching lease's)."""
        return common == size == len(prompt) and not self.exact_only

    def _load_file(
        self, ctx: Any, seq: int, prompt: tuple[int, ...], stored: tuple[int, ...], path: Path, identity: KVIdentity,
        t0: int, floor: int,
    ) -> "Restored | object | None":
        assert self.disk is not None
        try:
            size = path.stat().st_size
            if size > self.disk.budget:
                raise StateMismatchError(f"{path.name} is {size} bytes, above the tier's budget", reason="too_large")
            unpacked = kv_identity.read_file(path, identity, max_payload_bytes=self.disk.budget)
        except StateMismatchError as exc:
            self._suspect.add(path)
            self.stats.skip(exc.reason, f"{path.name}: {exc}")
            return _REFUSED
        except OSError as exc:  # removed by another process, unreadable
            self.stats.skip("read_failed", f"{path.name}: {exc}")
            return _REFUSED
        got = self._load_unpacked(ctx, seq, prompt, stored, unpacked, "disk", size, t0, floor)
        if got is _REFUSED:
            self._suspect.add(path)
        elif got is not None:
            try:
                path.touch()  # most recently used now (mtime is the disk tier's recency)
            except OSError:
                pass
        return got

    def _load(
        self, ctx: Any, seq: int, prompt: tuple[int, ...], key: tuple[int, ...], blob: bytes, identity: KVIdentity,
        tier: str, t0: int, floor: int,
    ) -> "Restored | object | None":
        try:
            unpacked = kv_identity.unpack_full(blob, identity)
        except StateMismatchError as exc:
            self.stats.skip(exc.reason, f"{tier} entry of {len(key)} tokens: {exc}")
            return _REFUSED
        return self._load_unpacked(ctx, seq, prompt, key, unpacked, tier, len(blob), t0, floor)

    def _keep(
        self, ctx: Any, prompt: tuple[int, ...], unpacked: kv_identity.Unpacked, tier: str
    ) -> "tuple[int, np.ndarray | None] | None":
        """How many prompt tokens a verified entry keeps, and its last row's logits when it serves the whole
        prompt; None (counted as ``corrupt``) for logits that are not one finite float32 per vocabulary entry."""
        tokens, n = unpacked.tokens, len(unpacked.tokens)
        common = common_length(tokens, prompt)
        if unpacked.logits is None:
            return self.shape.restore_point(common, len(prompt), n), None
        row = np.frombuffer(unpacked.logits, dtype="<f4")
        n_vocab = getattr(ctx, "n_vocab", None)
        if row.size != n_vocab or not np.isfinite(row).all():
            self.stats.skip("corrupt", f"a {tier} entry's last-row logits are {row.size} values, not {n_vocab} finite ones")
            return None
        if self._may_be_whole(common, n, prompt):
            return n, row.astype(np.float32, copy=True)  # a copy: the file's mapping is closed after the load
        body = self.shape.retained_rows(n, n)  # the rows after it were the stored prompt's own tail
        return self.shape.restore_point(min(common, body), len(prompt), body), None

    def _load_unpacked(
        self, ctx: Any, seq: int, prompt: tuple[int, ...], key: tuple[int, ...], unpacked: kv_identity.Unpacked,
        tier: str, nbytes: int, t0: int, floor: int,
    ) -> "Restored | object | None":
        """Load a verified entry into ``seq``: a :class:`Restored`, None when it would keep no more than
        ``floor`` tokens after all (nothing loaded, nothing wrong), or ``_REFUSED`` (counted)."""
        tokens, payload = unpacked.tokens, unpacked.payload
        if tuple(tokens) != key:
            self.stats.skip("tokens", f"a {tier} entry's token ids are not the ones it is stored under")
            return _REFUSED
        n = len(tokens)
        kept = self._keep(ctx, prompt, unpacked, tier)
        if kept is None:
            return _REFUSED
        keep, logits = kept
        if self.exact_only and keep != n:
            self.stats.skip("sliding_window", f"a {tier} entry of {n} tokens would have to be cut to {keep}")
            return _REFUSED
        if keep <= floor:
            return None
        try:
            ctx.seq_rm(seq, 0, -1)
            ctx.seq_state_load(seq, payload)
            # Without a sliding window every position must be back; with one, the SWA layers keep the last window.
            lowest = ctx.seq_pos_min(seq)
            covered = lowest == 0 or (self.exact_only and 0 <= lowest <= max(0, n - self.n_swa))
            ok = covered and ctx.seq_pos_max(seq) == n - 1 and (keep == n or ctx.trim(seq, keep))
        except LLMError as exc:
            ok = False
            log.info("prefix tier: llama.cpp did not load a %s entry: %s", tier, exc)
        if not ok:
            ctx.seq_rm(seq, 0, -1)
            self.stats.skip("load_failed", f"a {tier} entry of {n} tokens did not restore exactly")
            return _REFUSED
        with self.stats.lock:
            self.stats.hits[tier] += 1
            self.stats.bytes_read[tier] += nbytes
            self.stats.restored_tokens += keep
        return Restored(tier, keep, n, nbytes, time.perf_counter_ns() - t0, logits)

    # -- summaries -----------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Counters (hits and bytes by tier, misses, skips by reason) and what each tier holds now."""
        out = self.stats.snapshot()
        out["held_bytes"] = {"ram": self.ram_bytes, **({"disk": self.disk.bytes} if self.disk is not None else {})}
        out["held_entries"] = {"ram": self.ram_entries, **({"disk": self.disk.entries} if self.disk is not None else {})}
        out["queued_disk_bytes"] = self.writer.queued_bytes if self.writer is not None else 0
        return out

    @property
    def ram_bytes(self) -> int:
        return self.ram.bytes if self.ram is not None else 0

    @property
    def ram_entries(self) -> int:
        return self.ram.entries if self.ram is not None else 0

    def close(self) -> None:
        """Finish the queued disk writes (the next process finds them), then drop the RAM tier."""
        if self.writer is not None:
            self.writer.close()
        if self.ram is not None:
            self.ram.clear()


def tier_store(weights: Any, profile: Any, params: Any, *, trivial_prefix: int) -> PrefixStore | None:
    """The tiers a profile asks for (``prefix_cache_ram_bytes`` / ``_dir`` / ``_disk_bytes``), or None.

    Refuses a sliding-window context without the full SWA cache
    (:func:`check_tiers_allowed`). Entries are stamped with the weights'
    SHA-256, the profile's adapter, the context's layout and the engine build.
    """
    opt = profile.optimizer
    config = TierConfig(opt.prefix_cache_ram_bytes, opt.prefix_cache_dir, opt.prefix_cache_disk_bytes)
    if not config.enabled:
        return None
    check_tiers_allowed(config, n_swa=int(getattr(weights.native, "n_swa", 0) or 0), swa_full=params.swa_full)
    from ._engine import engine_build  # the build string is read once, when the identity is first needed

    def identity(ctx: Any) -> KVIdentity:
        return KVIdentity.for_context(
            ctx, model_sha256=weights.fingerprint, adapter_sha256=profile.adapter, build=engine_build()
        )

    n_swa = int(getattr(weights.native, "n_swa", 0) or 0)
    return PrefixStore(config, identity, trivial_prefix=trivial_prefix, n_swa=n_swa, shape=params.prefix_reuse or BLOCKED)


def system_prefix_length(weights: Any, messages: Any, tokens: Sequence[int]) -> int:
    """Prompt tokens before the first user message's content (0 when it cannot be told, or there is none).

    The render is split into template text and message contents
    (:mod:`aner_nb.llm.prompt_layout`); the text before the first user
    message's content is tokenized and the length it shares with ``tokens`` is
    returned, so the result is always an exact prefix of the prompt's ids
    (a token merged across the boundary is left out).
    """
    from .prompt_layout import locate_contents, template_layout

    if not isinstance(messages, (list, tuple)) or not messages:
        return 0
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first is None or not messages[first].get("content"):
        return 0
    try:
        template = weights.template
        text = template.render(list(messages), add_generation_prompt=True)
        layout = template_layout(template, list(messages))
        pieces = locate_contents(text, layout, [m["content"] for m in messages]) if layout is not None else None
    except LLMError:
        return 0
    if pieces is None:
        return 0
    before: list[str] = []
    for piece, index in pieces:
        if index == first:
            break
        before.append(piece)
    else:
        return 0
    ids = weights.native.tokenize("".join(before), add_special=False, parse_special=True)
    return common_length(ids, tokens)
