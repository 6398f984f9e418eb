"""One batched request's sequence: its phase, its sequence id and its progress in the KV, in one object.

:class:`SequenceState` is the only record of where a request stands in the
batching scheduler; the caller's handle (:class:`aner_nb.llm.outbox.Request`)
reports from it (``finished``, ``error``, ``phase``) instead of keeping a
copy. Its :class:`Phase` is explicit, as llama.cpp's server keeps a state per
slot:

* ``WAITING``: queued, no sequence id yet;
* ``PREFILL``: admitted with a sequence id; prompt tokens are still to be
  evaluated (chunked, several steps when the step budget is shared);
* ``DECODE``: the whole prompt is in the KV; each step feeds back the last
  sampled token (one row, plus the prompt-lookup proposals chosen for the
  step on a speculative lease) and samples or verifies what follows;
* ``FINISHED``: ended with a Response (a stop or the length limit);
* ``CANCELLED``: ended with a cancelled Response, queued or running;
* ``FAILED``: ended with an error (``error``), or the scheduler stopped.

KV positions: the prompt occupies positions ``0..len(prompt)-1`` of the
sequence's own stream; ``evaluated`` of them are in the KV (``cached`` of
those copied from a shared prefix). In ``DECODE``, ``next_token`` is sampled
but not yet evaluated and goes at position ``pos``.

The phase and the KV progress are changed only by the scheduler thread,
through the transition methods below; ``ended`` is set (once) when the phase
becomes terminal, after ``error`` is recorded, so a caller woken by it reads
a settled state.
"""

from __future__ import annotations

import enum
import threading
from typing import TYPE_CHECKING, Callable

from ._engine import Sampler
from .runner import Job, SequenceOutput

if TYPE_CHECKING:
    from .outbox import Outbox
    from .speculation import RequestDrafts

__all__ = ["Phase", "SequenceState", "RUNNING", "ENDED"]


class Phase(enum.Enum):
    """Where one request stands in the scheduler (see the module docstring)."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


RUNNING = frozenset({Phase.PREFILL, Phase.DECODE})  # holds a sequence id and KV cells
ENDED = frozenset({Phase.FINISHED, Phase.CANCELLED, Phase.FAILED})


class SequenceState:
    """Everything the scheduler knows about one request's sequence; the fields are scheduler-thread only.

    Exceptions: ``ended`` and ``error`` are what the caller's handle reads
    (``error`` is written before ``ended`` is set), and ``job.cancel`` is the
    caller's request to cancel.
    """

    def __init__(
        self, job: Job, *, outbox: "Outbox | None" = None, on_text: Callable[[str], None] | None = None
    ) -> None:
        self.job = job
        self.outbox = outbox
        self.on_text = on_text
        self.phase = Phase.WAITING
        self.ended = threading.Event()
        self.error: BaseException | None = None
        self.t_submit = -1
        self.seq = -1
        self.admission = -1  # admission number (monotonic)
        self.out: SequenceOutput | None = None
        self.sampler: Sampler | None = None
        self.evaluated = 0  # prompt tokens in the KV
        self.cached = 0  # of which copied from a shared prefix entry
        self.pos = 0  # KV position of next_token
        self.next_token = -1  # sampled, not yet evaluated
        self.steps = 0
        self.step_tokens = 0
        self.peak = 0
        self.deferred = False  # waited for a shared prefix (counted once)
        # Speculative batching (plain greedy requests): the request's lookup state, and the proposals
        # this step verifies after ``next_token`` (at positions pos+1..).
        self.drafts_of: "RequestDrafts | None" = None
        self.pending_drafts: list[int] = []

    def __repr__(self) -> str:
        return f"<SequenceState {self.phase.value} seq={self.seq} evaluated={self.evaluated} pos={self.pos}>"

    # -- what the phase says ---------------------------------------------------------
    @property
    def prefilling(self) -> bool:
        return self.phase is Phase.PREFILL

    @property
    def decoding(self) -> bool:
        return self.phase is Phase.DECODE

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to evaluate (``PREFILL``)."""
        return len(self.job.prompt_tokens) - self.evaluated

    @property
    def stream_ready(self) -> bool:
        """The consumer has room for another piece (always, without a stream)."""
        return self.outbox is None or self.outbox.has_room()

    # -- transitions -----------------------------------------------------------------
    def admit(self, seq: int, admission: int) -> None:
        """WAITING -> PREFILL on sequence id ``seq``."""
        assert self.phase is Phase.WAITING, self
        self.phase = Phase.PREFILL
        self.admission = admission
        self._place(seq)

    def move_to(self, seq: int) -> None:
        """The sequence's KV now lives in stream ``seq`` (a compaction move)."""
        self._place(seq)

    def _place(self, seq: int) -> None:
        # The job records the id as a solo run's job does (its KV sequence id).
        self.seq = self.job.seq = seq

    def start_from(self, cached: int) -> None:
        """The first ``cached`` prompt tokens are in the KV already (copied from a shared prefix)."""
        self.evaluated = self.cached = self.job.n_cached = cached

    def took_part(self, n_tokens: int, n_sequences: int) -> None:
        """The sequence had rows in a step of ``n_tokens`` rows over ``n_sequences`` sequences."""
        self.steps += 1
        self.step_tokens += n_tokens
        self.peak = max(self.peak, n_sequences)

    def evaluated_chunk(self, count: int) -> bool:
        """``count`` more prompt tokens are in the KV; True when that completed the prompt (PREFILL -> DECODE).

        The first sampled token then goes right after the prompt.
        """
        assert self.phase is Phase.PREFILL, self
        self.evaluated += count
        if self.evaluated < len(self.job.prompt_tokens):
            return False
        self.phase = Phase.DECODE
        self.pos = self.evaluated
        return True

    def fed(self) -> None:
        """``next_token`` was evaluated at ``pos`` (a decode row)."""
        assert self.out is not None
        self.pos += 1
        self.out.decode_calls += 1

    def deliver(self, piece: str) -> None:
        """Newly final text: to the text callback, then the stream's outbox."""
        if self.on_text is not None:
            self.on_text(piece)
        if self.outbox is not None:
            self.outbox.put(piece)

    def end(self, phase: Phase, error: BaseException | None = None) -> None:
        """Enter a terminal phase: the stream is closed and the caller woken."""
        assert phase in ENDED, phase
        if error is not None:
            self.error = error
        self.phase = phase
        if self.outbox is not None:
            self.outbox.close()
        self.ended.set()
