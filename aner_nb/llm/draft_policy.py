"""How many proposals a speculative step verifies: the length that buys the most tokens per unit of cost.

On a CPU every verified row costs real time: each row pays the output
layer's product over the whole vocabulary (262k rows on Gemma 3), so a
step of ``k`` rows costs ``D(k)`` and plain decoding yields one token per
``D(1)``. A step that proposes ``d`` tokens, each accepted with chance ``p``
once the ones before it were, yields ``E(d) = 1 + p + ... + p^d`` tokens
(the accepted run plus the model's own next token). The policy picks the
``d`` that maximises ``E(d) / (D(d + 1) / D(1))``, the speed relative to
plain decoding, and proposes nothing unless that beats plain decoding by
``MIN_GAIN``. ``D`` is measured on this machine (:mod:`row_costs`);
``p`` is estimated per step from earlier steps whose lookup matched a
suffix of similar length, because a 16-token match that is being copied is
far more predictive than a 2-token one. Only the speed depends on it:
verification keeps output equal to plain greedy decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .step_policy import micro_batches

__all__ = [
    "MAX_SPECULATIVE_TOKENS", "MIN_GAIN", "MIN_DRAFT_CAP", "MATCH_BUCKETS", "RowCosts", "FREE_ROWS",
    "expected_tokens", "best_length", "batch_drafts", "DraftPolicy",
]

MAX_SPECULATIVE_TOKENS = 64
# A draft must promise this much over plain decoding: its acceptance is an estimate from a few steps.
MIN_GAIN = 0.05
# Lookups are grouped by how many trailing tokens matched: (lower bound, expected acceptance). Before any
# evidence a bucket expects that; evidence from any bucket shifts every bucket's expectation by as much
# (DraftPolicy): a long match is usually a copy, a short one often a coincidence.
MATCH_BUCKETS: tuple[tuple[int, float], ...] = ((2, 0.5), (4, 0.6), (8, 0.8), (16, 0.9))
_POOLED_PRIOR = 0.7  # where the pooled estimate starts, the buckets' shifts being relative to it
MIN_DRAFT_CAP = 4  # the draft cap for short matches (see DraftPolicy.length)
_PRIOR_WEIGHT = 2.0  # the prior counts as this many observed steps
_TIE = 1e-6
_DECAY = 0.8  # weight of the past in a bucket's counts (about the last five of its steps)


@dataclass(frozen=True)
class RowCosts:
    """The cost of a decode step of ``k`` rows (logits on every row) over a one-row step, k = 1..len(ratios).

    ``measured`` lists the counts that were measured (empty: all of them); the others are
    interpolated, and the policy only drafts to measured counts, because kernels that tile
    rows make some counts much cheaper than their neighbours (Gemma on AVX-512: 8 rows cost
    less than 7). Past the last count the cost grows by the mean increment per row.
    """

    ratios: tuple[float, ...]
    measured: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(not 1 <= k <= len(self.ratios) for k in self.measured) or list(self.measured) != sorted(set(self.measured)):
            raise ValueError(f"measured row counts are increasing and within 1..{len(self.ratios)}, got {self.measured}")
        r = self.ratios
        if not 1 <= len(r) <= MAX_SPECULATIVE_TOKENS + 1:
            raise ValueError(f"row costs cover 1..{MAX_SPECULATIVE_TOKENS + 1} rows, got {len(r)}")
        if any(not isinstance(x, float) or not math.isfinite(x) or x <= 0 for x in r) or r[0] != 1.0:
            raise ValueError(f"row costs are finite positive floats starting at 1.0, got {r[:4]}...")

    def drafts(self, limit: int) -> list[int]:
        """The proposal counts in 1..limit whose step sizes (proposals + 1 rows) were measured."""
        if not self.measured:
            return list(range(1, limit + 1))
        return [d for d in range(1, limit + 1) if d + 1 in self.measured]

    def of(self, rows: int) -> float:
        r = self.ratios
        if rows <= len(r):
            return r[rows - 1]
        step = (r[-1] - r[0]) / (len(r) - 1) if len(r) > 1 else 0.0  # the mean increment per row
        return r[-1] + step * (rows - len(r))

    @classmethod
    def from_points(cls, points: Sequence[tuple[int, float]]) -> "RowCosts":
        """Costs at every count 1..max from measured ``(rows, seconds)`` points, linear in between."""
        pts = sorted(points)
        if not pts or pts[0][0] != 1:
            raise ValueError("row cost points must include a one-row step")
        base = pts[0][1]
        ratios = []
        for k in range(1, pts[-1][0] + 1):
            hi = next(i for i, (rows, _) in enumerate(pts) if rows >= k)
            (r1, s1) = pts[hi]
            if r1 == k or hi == 0:
                ratios.append(s1 / base)
                continue
            (r0, s0) = pts[hi - 1]
            ratios.append((s0 + (s1 - s0) * (k - r0) / (r1 - r0)) / base)
        ratios[0] = 1.0
        return cls(tuple(float(x) for x in ratios), tuple(k for k, _ in pts))


# Rows that cost nothing extra: the policy then proposes whatever the lookup offers (direct engine use
# without a measurement, and tests that need every proposal verified).
FREE_ROWS = RowCosts((1.0,))


def expected_tokens(p: float, proposals: int) -> float:
    """``1 + p + ... + p^proposals``: the tokens a step yields when each proposal is accepted with chance p."""
    if p >= 1.0:
        return float(proposals + 1)
    return (1.0 - p ** (proposals + 1)) / (1.0 - p)


def best_length(p: float, limit: int, costs: RowCosts, *, min_gain: float = MIN_GAIN) -> int:
    """The proposal count in 0..limit (measured step sizes only) with the highest speed over plain decoding.

    0: plain decoding beats every draft by less than ``min_gain``.

    Counts within ``_TIE`` of the best rate tie, and the shortest of them wins: extra rows for a gain
    that small are not worth the error in the estimates behind it.
    """
    rates = [(d, expected_tokens(p, d) / costs.of(d + 1)) for d in costs.drafts(limit)]
    best = max((rate for _, rate in rates), default=0.0)
    if best <= 1.0 + min_gain:
        return 0
    return next(d for d, rate in rates if rate >= best * (1.0 - _TIE))


def batch_drafts(
    offers: Sequence[tuple[int, float, int]], decoding: int, rows: int, room: int, costs: RowCosts,
    *, min_gain: float = MIN_GAIN, layout: Sequence[tuple[int, int]] | None = None, n_ubatch: int = 0,
) -> dict[int, int]:
    """Proposals per sequence for one continuous-batching step: drafts only where they raise the step's speed.

    ``offers`` are ``(sequence id, acceptance estimate, most proposals)`` for decoding sequences
    with a draft; the step already holds ``rows`` rows, ``decoding`` of them decode rows (the
    others prompt chunks), with ``room`` rows left in its token budget. The step's speed is its
    tokens over its cost, where prompt rows are work the batch does anyway: cost =
    ``D(decoding) + C(with drafts) - C(plain)``. ``C`` of a step is ``D`` of its rows when they run
    as one micro-batch; given the plain step's ``layout`` (``(seq, rows)``) and the context's
    ``n_ubatch``, it is the sum of ``D`` over the micro-batches llama.cpp splits a multi-stream batch
    into (:func:`~aner_nb.llm.step_policy.micro_batches`): a sequence verifying proposals beside
    plain decode rows costs a pass of its own. Offers are taken by acceptance, best first; each
    gets the count that makes the step fastest, and is kept only if the step then beats the
    plain step by ``min_gain`` (the first) or beats what the drafts kept so far give (the
    others). With one decoding sequence and no prompt rows this is :func:`best_length`.
    """
    def passes(chosen: dict[int, int], extra: int) -> tuple[int, ...]:
        if layout is None:
            return (rows + extra,)
        return micro_batches([(seq, n + chosen.get(seq, 0)) for seq, n in layout], max(n_ubatch, 1))

    def step_cost(chosen: dict[int, int], extra: int) -> float:
        return sum(costs.of(n) for n in passes(chosen, extra))

    def unmeasured(chosen: dict[int, int], extra: int) -> bool:  # draft to measured step sizes only
        return bool(costs.measured) and any(n <= len(costs.ratios) and n not in costs.measured for n in passes(chosen, extra))

    base = costs.of(decoding) - step_cost({}, 0)
    tokens, extra = float(decoding), 0

    def speed(t: float, chosen: dict[int, int], e: int) -> float:
        return t / (base + step_cost(chosen, e))

    plain = speed(tokens, {}, 0)
    current = plain * (1.0 + min_gain)
    chosen: dict[int, int] = {}
    joint = _joint_drafts(offers, tokens, room, speed, unmeasured) if layout is not None else None
    for seq, p, most in sorted(offers, key=lambda o: (-o[1], o[0])):
        candidates = []
        for d in range(1, min(most, room - extra) + 1):
            if unmeasured({**chosen, seq: d}, extra + d):
                continue
            t = tokens + expected_tokens(p, d) - 1.0
            candidates.append((d, speed(t, {**chosen, seq: d}, extra + d), t))
        best = max((s for _, s, _ in candidates), default=0.0)
        if best <= current * (1.0 + _TIE if chosen else 1.0):
            continue
        d, s, t = next(c for c in candidates if c[1] >= best * (1.0 - _TIE))  # the shortest of the near-best
        chosen[seq] = d
        tokens, extra, current = t, extra + d, s
    if joint is not None and joint[1] > max(current, plain * (1.0 + min_gain)) * (1.0 + _TIE):
        return joint[0]
    return chosen


def _joint_drafts(offers, tokens, room, speed, unmeasured) -> "tuple[dict[int, int], float] | None":
    """The best step where every offering sequence drafts the same count (capped by its own limit).

    Sequences on consecutive ids with equal rows share one micro-batch, so drafts that would each
    cost a pass of their own alone can pay together (four copying requests: four 3-row runs in one
    pass of 12). The greedy loop in :func:`batch_drafts` takes offers one at a time and never sees it.
    """
    best: tuple[dict[int, int], float] | None = None
    for d in range(1, max((most for _, _, most in offers), default=0) + 1):
        chosen = {seq: min(d, most) for seq, _, most in offers if most > 0}
        extra = sum(chosen.values())
        if not chosen or extra > room or unmeasured(chosen, extra):
            continue
        t = tokens + sum(expected_tokens(p, chosen[seq]) - 1.0 for seq, p, most in offers if seq in chosen)
        s = speed(t, chosen, extra)
        if best is None or s > best[1] * (1.0 + _TIE):
            best = (chosen, s)
    return best


def _bucket(match: int) -> int:
    index = 0
    for i, (low, _) in enumerate(MATCH_BUCKETS):
        if match >= low:
            index = i
    return index


class DraftPolicy:
    """The proposal count of each step, from measured row costs and per-match-length acceptance estimates.

    Each bucket keeps decaying counts of accepted proposals and of first
    rejections (the estimate of a geometric run's continuation chance:
    accepted over accepted plus rejections). Its prior is not fixed: it is
    the request's pooled estimate over all buckets, shifted by how much
    better than average that match length is expected to be
    (``MATCH_BUCKETS``), so a request that keeps copying drafts after short
    matches too, and one whose drafts keep failing stops drafting after
    long ones as well; a bucket's own outcomes then take over. Drafts from
    the request's own history and from earlier requests (``source``) are
    estimated apart: an earlier answer that the new one departs from must
    not silence the request's own copying, nor the reverse.
    """

    SOURCES = ("request", "lease")

    def __init__(self, maximum: int, costs: RowCosts = FREE_ROWS) -> None:
        if not 1 <= maximum <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"maximum must be in 1..{MAX_SPECULATIVE_TOKENS}, got {maximum}")
        self.maximum = maximum
        self.costs = costs
        # per source: [accepted, rejections] pooled over every bucket, then per bucket (decaying)
        self._pooled = {s: [_POOLED_PRIOR * _PRIOR_WEIGHT, (1 - _POOLED_PRIOR) * _PRIOR_WEIGHT] for s in self.SOURCES}
        self._buckets = {s: [[0.0, 0.0] for _ in MATCH_BUCKETS] for s in self.SOURCES}

    def acceptance(self, match: int, source: str = "request") -> float:
        """The current estimate of the chance that a proposal after a ``match``-token match is accepted."""
        pooled_a, pooled_r = self._pooled[source]
        b = _bucket(match)
        prior = min(max(pooled_a / (pooled_a + pooled_r) + MATCH_BUCKETS[b][1] - _POOLED_PRIOR, 0.0), 1.0)
        accepted, rejected = self._buckets[source][b]
        return (accepted + _PRIOR_WEIGHT * prior) / (accepted + rejected + _PRIOR_WEIGHT)

    def length(self, match: int, available: int, source: str = "request") -> int:
        """Proposals worth verifying out of ``available`` offered after a ``match``-token match.

        At most ``max(MIN_DRAFT_CAP, match)``: a copy that has gone on for ``m`` tokens is
        trusted for about ``m`` more (SuffixDecoding's rule). Copies end abruptly, where
        the answer departs from its source, which a per-token acceptance estimate does not
        foresee; the cap bounds what one departure costs to about what was just confirmed.
        """
        limit = self.limit(match, available)
        if limit <= 0:
            return 0
        return best_length(self.acceptance(match, source), limit, self.costs)

    def limit(self, match: int, available: int) -> int:
        """The most proposals a step may verify after a ``match``-token match with ``available`` offered."""
        return max(min(self.maximum, available, max(MIN_DRAFT_CAP, match)), 0)

    def update(self, match: int, proposed: int, accepted: int, source: str = "request") -> None:
        """Record a verification step: ``accepted`` of ``proposed`` proposals after a ``match``-token match."""
        if proposed <= 0:
            return
        rejected = 1.0 if accepted < proposed else 0.0
        for counts in (self._pooled[source], self._buckets[source][_bucket(match)]):
            counts[0] = _DECAY * counts[0] + accepted
            counts[1] = _DECAY * counts[1] + rejected
