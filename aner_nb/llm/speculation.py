"""A lease's prompt-lookup speculation: its row costs, its cross-request corpus, and each request's drafts.

A :class:`Speculator` is made once per lease (``speculative_tokens`` > 0):
the upper bound on proposals, the costs measured for its contexts
(:mod:`row_costs`) and a :class:`~aner_nb.llm.lookup.LookupCorpus` of its
latest requests. Each request gets :class:`RequestDrafts`: its own n-gram
index over prompt and output, and a :class:`~aner_nb.llm.draft_policy.DraftPolicy`.
A step's draft is the longer of two matches, the request's own history and
the corpus (the request's own wins a tie, being the more recent text); the
policy then cuts it to the length worth verifying. A request that finishes
adds its prompt and answer to the corpus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from ._engine import ContextParams
from .draft_policy import FREE_ROWS, DraftPolicy, RowCosts, best_length
from .lookup import Draft, LookupCorpus, NgramIndex
from .row_costs import row_costs

if TYPE_CHECKING:
    from .weights import SharedWeights

__all__ = ["Speculator", "RequestDrafts", "choose_draft", "lease_speculator"]


def choose_draft(own: Draft | None, earlier: Draft | None) -> Draft | None:
    """The draft behind the longer match; the request's own on a tie."""
    if own is None or (earlier is not None and earlier.match > own.match):
        return earlier
    return own


@dataclass(frozen=True)
class Speculator:
    """What every speculative request of one lease shares (the corpus is that lease's alone)."""

    maximum: int
    costs: RowCosts = FREE_ROWS
    corpus: LookupCorpus | None = None

    def start(self, prompt: Sequence[int]) -> "RequestDrafts":
        return RequestDrafts(self, prompt)


def lease_speculator(weights: "SharedWeights", params: ContextParams, maximum: int) -> Speculator | None:
    """A new lease's speculator (None without speculation): costs measured for its contexts, an empty corpus."""
    if maximum <= 0:
        return None
    return Speculator(maximum, row_costs(weights.native, weights.fingerprint, params, maximum + 1), LookupCorpus())


class RequestDrafts:
    """One request's lookup state: proposes, records verification outcomes, and feeds the corpus at the end."""

    def __init__(self, speculator: Speculator, prompt: Sequence[int]) -> None:
        self._speculator = speculator
        self._prompt_length = len(prompt)
        self.index = NgramIndex(prompt)
        self.policy = DraftPolicy(speculator.maximum, speculator.costs)
        self._last: Draft | None = None

    def extend(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)

    def offer(self, room: int) -> "tuple[Draft, float, int] | None":
        """The next draft, its acceptance estimate and how much of it may be verified (None: nothing to offer).

        At most ``room`` proposals (the request's output limit and KV room); the outcome of
        verifying it goes to :meth:`record`.
        """
        limit = min(self._speculator.maximum, room)
        if limit <= 0:
            return None
        corpus = self._speculator.corpus
        draft = choose_draft(
            self.index.lookup(limit), corpus.lookup(self.index.tokens, limit) if corpus is not None else None
        )
        if draft is None:
            return None
        self._last = draft
        return draft, self.policy.acceptance(draft.match, draft.source), self.policy.limit(draft.match, len(draft.tokens))

    def propose(self, room: int) -> list[int]:
        """The proposals worth verifying next on their own (at most ``room``; [] for a plain step)."""
        offered = self.offer(room)
        if offered is None:
            return []
        draft, p, limit = offered
        length = best_length(p, limit, self._speculator.costs) if limit > 0 else 0
        return self.take(draft, length)

    def take(self, draft: Draft, length: int) -> list[int]:
        """The first ``length`` tokens of ``draft``, which the next step verifies."""
        return list(draft.tokens[:length])

    def record(self, proposed: int, accepted: int) -> None:
        """The outcome of verifying the last proposals."""
        if self._last is not None:
            self.policy.update(self._last.match, proposed, accepted, self._last.source)

    def finish(self, output: Sequence[int]) -> None:
        """A completed request: its prompt and ``output`` join the lease's corpus."""
        corpus = self._speculator.corpus
        if corpus is not None:
            corpus.add(self.index.tokens[: self._prompt_length] + list(output))
