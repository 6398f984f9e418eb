"""The step policy of continuous batching: plain functions and frozen objects over plain numbers.

Unit tests exercise them without a model (``tests/test_scheduler.py``): which
queued requests start (:class:`FifoAdmission`, :func:`admit_count`), how a
step's token budget is shared (:func:`share_budget`, :func:`plan_step`), the
whole batch of one step, row by row (:func:`plan_batch` returning a
:class:`BatchPlan`), which sequence id a request gets
(:func:`next_sequence_id`) and which sequences move to close gaps between
ids (:func:`compaction_moves`), and which request gives way when the KV has
no room (:func:`kv_victim`). The scheduler thread
(:mod:`aner_nb.llm.scheduler`) applies them to the engine.

Context split: the context's cells are divided equally between the
``max_sequences`` sequence ids, one KV stream each (llama.cpp
``kv_unified=False``). A sequence's cells then sit in position order at the
start of its own stream, exactly as in a fresh context of an ordinary
lease, so attention (whose flash-attention CPU kernel accumulates in cell
order, in f16) computes the same numbers and greedy output equals the
request run alone, token for token. With a unified cache, freed cells are
reused out of order and outputs drift. A request must therefore fit its
sequence's share (prompt plus ``max_tokens`` <= ``context // max_sequences``),
checked at submission; an admitted request can never run out of KV.

Each step gives one decode row to every running sequence first, then shares
the rest of ``batch_tokens`` between prompts still being evaluated (max-min
fair, chunked prefill). Rows are laid out in sequence-id order because
llama.cpp splits a multi-stream batch into micro-batches of *consecutive*
sequence ids (each one a full pass over the weights): with the active ids
kept consecutive (admissions take an id next to the running ones, and when
a finished request leaves a gap that no queued request fills, the fewest
sequences move, a KV stream copy each) one micro-batch carries a token of
every sequence. Logits are requested only for rows that are sampled, plus
one ignored row where an odd count would cost the CPU kernel an extra pass
over the output weights (:func:`output_rows`). A finished sequence's cells
are removed at once and its id admits queued work on the next step, so a
short request that arrives late can finish before an earlier long one.
Admission order is a policy object; the default is first in, first out.
On a speculative batching lease a decoding sequence's rows may carry
prompt-lookup proposals after its fed-back token (``Rows.drafts``), in the
rows the plain plan leaves (:func:`draft_room`); which sequences draft, and
how much, is :func:`aner_nb.llm.draft_policy.batch_drafts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence, TypeVar

__all__ = [
    "StepPlan",
    "Rows",
    "BatchPlan",
    "AdmissionPolicy",
    "FifoAdmission",
    "DECODE",
    "PREFILL",
    "PAD",
    "admit_count",
    "share_budget",
    "plan_step",
    "plan_batch",
    "draft_room",
    "micro_batches",
    "next_sequence_id",
    "compaction_moves",
    "kv_victim",
    "output_rows",
]


def admit_count(waiting: int, free_sequences: int) -> int:
    """How many queued requests start now: the oldest ones, one per free sequence id.

    Every admitted request fits its sequence's KV share (checked at
    submission), so the only limit is the number of free sequence ids.
    """
    return max(min(waiting, free_sequences), 0)


def share_budget(needs: Sequence[int], budget: int) -> tuple[int, ...]:
    """Split ``budget`` tokens between prefills needing ``needs`` tokens (max-min fair).

    Every prefill gets an equal share; what a small one does not need is
    shared again among the others; an indivisible remainder goes to the
    earliest (lowest index) first. No prefill gets more than it needs, and
    the whole budget is used whenever the needs allow it.
    """
    alloc = [0] * len(needs)
    left = max(budget, 0)
    open_ = [i for i, need in enumerate(needs) if need > 0]
    while open_ and left > 0:
        share = left // len(open_)
        if share == 0:
            for i in open_[:left]:
                alloc[i] += 1
            break
        still_open = []
        for i in open_:
            give = min(share, needs[i] - alloc[i])
            alloc[i] += give
            left -= give
            if alloc[i] < needs[i]:
                still_open.append(i)
        open_ = still_open
    return tuple(alloc)


@dataclass(frozen=True)
class StepPlan:
    """What one ``llama_decode`` evaluates: a decode row per running sequence, then prefill chunks."""

    decode: tuple[int, ...]  # sequence ids with one decode row each
    prefill: tuple[tuple[int, int], ...]  # (sequence id, prompt tokens) for each prefill with a chunk

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)

    @property
    def sequences(self) -> int:
        return len(self.decode) + len(self.prefill)

    def layout(self) -> tuple[tuple[int, int], ...]:
        """``(sequence id, rows)`` in the order the rows go into the batch: by sequence id.

        llama.cpp splits a multi-stream batch into micro-batches of
        consecutive sequence ids taken in row order, so id order lets one
        micro-batch hold a row of every sequence.
        """
        rows = [(seq, 1) for seq in self.decode] + list(self.prefill)
        return tuple(sorted(rows))


def plan_step(decoding: Sequence[int], prefilling: Sequence[tuple[int, int]], batch_tokens: int) -> StepPlan:
    """Plan one step: every decoding sequence gets a row, prefills share what is left.

    ``decoding`` lists sequence ids with a token to feed; ``prefilling`` lists
    ``(sequence id, prompt tokens still to evaluate)`` in admission order.
    """
    if len(decoding) > batch_tokens:
        raise ValueError(f"{len(decoding)} decode rows do not fit batch_tokens={batch_tokens}")
    chunks = share_budget([n for _, n in prefilling], batch_tokens - len(decoding))
    prefill = tuple((seq, n) for (seq, _), n in zip(prefilling, chunks) if n > 0)
    return StepPlan(tuple(decoding), prefill)


def draft_room(
    decoding: Sequence[int], prefilling: Sequence[tuple[int, int]], batch_tokens: int
) -> tuple[StepPlan, int]:
    """The plain step :func:`plan_step` plans and the budget it leaves for drafts."""
    step = plan_step(decoding, prefilling, batch_tokens)
    return step, batch_tokens - step.n_tokens


def micro_batches(layout: Sequence[tuple[int, int]], n_ubatch: int) -> tuple[int, ...]:
    """The rows of each micro-batch llama.cpp makes of a multi-stream batch laid out as ``(seq, rows)``.

    Engine fact (``llama_batch_allocr::split_equal`` with sequential ids, what a
    ``kv_unified=False`` cache asks for): a micro-batch takes the run of
    consecutive sequence ids that starts at the lowest id with rows left, and
    the same number of rows from each (the fewest any of them has left, at most
    ``n_ubatch`` over the run's length, at least one); every micro-batch is a
    pass over the weights of its own. So a step whose sequences carry unequal
    row counts (one verifying proposals beside plain decode rows, a prompt
    chunk) costs one pass per level of that staircase, not one pass of all rows.
    """
    left = {seq: n for seq, n in sorted(layout) if n > 0}
    out = []
    while left:
        run = [min(left)]
        while run[-1] + 1 in left and len(run) <= n_ubatch:  # llama.cpp stops after the set exceeds n_ubatch
            run.append(run[-1] + 1)
        take = max(1, min(min(left[s] for s in run), n_ubatch // len(run)))
        for s in run:
            left[s] -= take
            if left[s] == 0:
                del left[s]
        out.append(take * len(run))
    return tuple(out)


def next_sequence_id(active: Sequence[int], free: Sequence[int]) -> int:
    """The free sequence id for the next admission: one that keeps the active ids consecutive.

    A gap between active ids is filled first, then the run is extended
    upwards, then downwards; with nothing active the lowest id is used.
    """
    if not free:
        raise ValueError("no free sequence id")
    free_set = set(free)
    if active:
        lo, hi = min(active), max(active)
        inside = [i for i in sorted(free_set) if lo < i < hi]
        for candidate in (*inside[:1], hi + 1, lo - 1):
            if candidate in free_set:
                return candidate
    return min(free_set)


def compaction_moves(active: Sequence[int], n_ids: int) -> tuple[tuple[int, int], ...]:
    """``(from, to)`` moves that make the active sequence ids consecutive, as few as possible.

    The target is the window of ``len(active)`` ids (within ``0..n_ids-1``)
    that already holds the most active ids (the lowest such window on a
    tie); every active id outside it moves into one of its free ids. No
    moves when the ids are already consecutive.
    """
    ids = sorted(active)
    n = len(ids)
    if n == 0 or ids[-1] - ids[0] + 1 == n:
        return ()
    present = set(ids)
    start = max(range(n_ids - n + 1), key=lambda w: (sum(i in present for i in range(w, w + n)), -w))
    window = range(start, start + n)
    outside = [i for i in reversed(ids) if i not in window]
    holes = [i for i in window if i not in present]
    return tuple(zip(outside, holes))


def kv_victim(participants: Sequence[tuple[int, int, bool]]) -> int:
    """The sequence to fail when a step finds no KV slot.

    ``participants`` are ``(sequence id, admission number, has prefill rows)``.
    The newest request that is evaluating its prompt gives way (prompts are
    what grow the KV fastest); otherwise the newest one. Older requests keep
    their progress, in line with FIFO admission.
    """
    if not participants:
        raise ValueError("a step without participants cannot run out of KV")
    prefilling = [p for p in participants if p[2]]
    return max(prefilling or participants, key=lambda p: p[1])[0]


def output_rows(sampled: int, pair_columns: bool) -> int:
    """How many logits rows a step requests when ``sampled`` of its rows are sampled.

    Where the CPU kernel multiplies the output weights two batch columns at a
    time (``pair_columns``, see :func:`aner_nb.llm._engine.pairs_batch_columns`),
    an odd count of three or more costs a whole extra pass over those weights,
    more than one more column does: such a step asks for one more row's logits
    and ignores them. One row takes the single-column kernel and stays as is.
    """
    if pair_columns and sampled >= 3 and sampled % 2:
        return sampled + 1
    return sampled


T = TypeVar("T")


class AdmissionPolicy(Protocol):
    """Which waiting requests start now; the scheduler calls it under its lock, on its own thread."""

    def admit(self, waiting: Sequence[T], free: Sequence[int]) -> Sequence[T]:
        """Some of ``waiting`` (oldest first), at most one per id in ``free``, in the order they start."""
        ...


class FifoAdmission:
    """First in, first out: the oldest waiting requests, one per free sequence id.

    Every queued request fits its sequence's KV share (checked at
    submission), so the only limit is the number of free sequence ids.
    """

    def admit(self, waiting: Sequence[T], free: Sequence[int]) -> Sequence[T]:
        return tuple(waiting)[: admit_count(len(waiting), len(free))]


DECODE, PREFILL, PAD = "decode", "prefill", "pad"


@dataclass(frozen=True)
class Rows:
    """The consecutive rows one sequence has in a step's batch."""

    seq: int
    first: int  # batch index of the first row
    count: int
    kind: str  # DECODE: the last sampled token fed back; PREFILL: a prompt chunk; PAD: a throwaway token
    sampled: bool  # the last row's logits are sampled (a decode row, or a chunk that ends its prompt)
    # DECODE only: prompt-lookup proposals after the fed-back token (``count`` = 1 + drafts), every
    # row with logits: row ``first + i`` holds the model's choice after the i-th proposal.
    drafts: int = 0

    @property
    def last(self) -> int:
        return self.first + self.count - 1


@dataclass(frozen=True)
class BatchPlan:
    """One step, row by row: what the scheduler writes into the batch before its ``llama_decode``.

    Made by :func:`plan_batch` from plain numbers; the scheduler only fills
    the batch as it says, runs it and applies the results.
    """

    step: StepPlan  # the budget decision the rows lay out
    rows: tuple[Rows, ...]  # in batch order, which is sequence-id order
    spare_row: int = -1  # a prompt row that is not sampled but gets logits, as the padding row
    pad_seq: int = -1  # an empty sequence id holding the padding token instead, cleared after the step

    @property
    def n_tokens(self) -> int:
        return sum(r.count for r in self.rows)

    @property
    def sampled(self) -> tuple[tuple[int, int], ...]:
        """``(sequence id, logits row)`` of every row that is sampled, in batch order."""
        return tuple((r.seq, r.last) for r in self.rows if r.sampled)

    @property
    def participants(self) -> tuple[int, ...]:
        """The sequence ids of requests in this step (not the padding sequence)."""
        return tuple(r.seq for r in self.rows if r.kind != PAD)

    @property
    def padded(self) -> bool:
        return self.spare_row >= 0 or self.pad_seq >= 0


def plan_batch(
    decoding: Sequence[int],
    prefilling: Sequence[tuple[int, int]],
    batch_tokens: int,
    *,
    pair_columns: bool = False,
    active: Sequence[int] | None = None,
    free: Sequence[int] = (),
    drafts: Mapping[int, int] | None = None,
) -> BatchPlan:
    """Plan one step's batch: :func:`plan_step`, laid out by sequence id, plus the padding decision.

    ``decoding`` and ``prefilling`` are as for :func:`plan_step`; ``active``
    lists every running sequence id (the step's own by default) and ``free``
    the unused ones. Where :func:`output_rows` asks for one more logits row,
    the last prompt row that is not sampled gets it; a step without such a
    row puts one token in a free id next to the active ones (so it joins
    their micro-batch), if the batch has room; otherwise the step goes
    unpadded. ``drafts`` gives decoding sequences proposals to verify after
    their decode row (chosen by the caller within the rows the plan leaves:
    :func:`draft_room`); their rows have logits too.
    """
    step = plan_step(decoding, prefilling, batch_tokens)
    drafts = {seq: d for seq, d in (drafts or {}).items() if d > 0}
    if set(drafts) - set(step.decode) or step.n_tokens + sum(drafts.values()) > batch_tokens:
        raise ValueError(f"drafts {drafts} must be for decoding sequences and fit batch_tokens={batch_tokens}")
    left = dict(prefilling)
    ending = {seq for seq, n in step.prefill if n == left[seq]}
    sampled = len(step.decode) + sum(drafts.values()) + len(ending)  # rows with logits
    pad = output_rows(sampled, pair_columns) > sampled
    has_spare = step.n_tokens - len(step.decode) > len(ending)  # a prompt row that is not sampled
    layout = [(seq, n + drafts.get(seq, 0)) for seq, n in step.layout()]
    n_rows = step.n_tokens + sum(drafts.values())
    pad_seq = -1
    if pad and not has_spare and free and n_rows < batch_tokens:
        pad_seq = next_sequence_id([*decoding, *left] if active is None else active, free)
        layout = sorted([*layout, (pad_seq, 1)])
    decode = set(step.decode)
    rows, first = [], 0
    for seq, n in layout:
        kind = PAD if seq == pad_seq else DECODE if seq in decode else PREFILL
        rows.append(Rows(seq, first, n, kind, sampled=kind == DECODE or seq in ending, drafts=drafts.get(seq, 0)))
        first += n
    spare = -1
    if pad and has_spare:  # a chunk's last unsampled row: its last, or the one before a sampled last
        spare = max(r.last - r.sampled for r in rows if r.kind == PREFILL and r.count > r.sampled)
    return BatchPlan(step, tuple(rows), spare, pad_seq)
