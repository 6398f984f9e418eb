"""The draft-length policy: pure arithmetic over measured row costs and acceptance estimates."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from aner_nb.llm.draft_policy import (
    FREE_ROWS, MATCH_BUCKETS, MAX_SPECULATIVE_TOKENS, MIN_DRAFT_CAP, MIN_GAIN, DraftPolicy, RowCosts, best_length, expected_tokens,
)

# Shaped like Gemma 3 270M on two cores (every row pays a 262k-vocabulary product) and like a small
# vocabulary, where rows are cheap until the batch stops being bound by reading the weights.
GEMMA_LIKE = RowCosts.from_points([(1, 1.0), (2, 1.8), (4, 2.6), (8, 3.6), (16, 6.0), (32, 10.0), (65, 19.0)])
CHEAP = RowCosts.from_points([(1, 1.0), (2, 1.05), (8, 1.4), (16, 2.0), (65, 6.0)])
# SmolLM2's ratios as measured at 2 threads (benchmarks/RESULTS.md, "Speculation from measured row costs")
SMOL_LIKE = RowCosts.from_points([(1, 1.0), (2, 1.79), (3, 2.13), (4, 2.51), (5, 3.33), (6, 3.70), (7, 4.17), (8, 4.32),
                                  (10, 5.26), (12, 5.50), (14, 7.60), (16, 7.58), (20, 9.75), (24, 10.02), (32, 12.97),
                                  (48, 19.89), (65, 25.27)])


def test_row_costs_interpolate_between_points_and_extend_past_the_last():
    c = RowCosts.from_points([(1, 0.010), (3, 0.020), (5, 0.024)])
    assert c.ratios == pytest.approx((1.0, 1.5, 2.0, 2.2, 2.4))
    assert c.of(7) == pytest.approx(3.1)  # the mean increment (0.35 per row) goes on
    assert c.measured == (1, 3, 5) and c.drafts(6) == [2, 4]  # the measured 3- and 5-row steps
    assert FREE_ROWS.of(65) == 1.0


@pytest.mark.parametrize("ratios", [(), (2.0,), (1.0, float("nan")), (1.0, -1.0), (1.0,) * (MAX_SPECULATIVE_TOKENS + 2)])
def test_row_costs_reject_implausible_tables(ratios):
    with pytest.raises(ValueError):
        RowCosts(ratios)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 8) == 1.0


def _reference_best(p, limit, costs):
    """The shortest draft whose speed is (within a millionth) the best, if that beats plain decoding by MIN_GAIN."""
    steps = set(costs.measured) if costs.measured else None
    rates = {d: sum(p**i for i in range(d + 1)) / costs.of(d + 1) for d in range(1, limit + 1)
             if steps is None or d + 1 in steps}
    best = max(rates.values(), default=0.0)
    if best <= 1.0 + MIN_GAIN:
        return 0
    return min(d for d, r in rates.items() if r >= best * (1 - 1e-6))


@settings(max_examples=300)
@given(st.floats(0.0, 1.0), st.integers(0, MAX_SPECULATIVE_TOKENS), st.sampled_from([GEMMA_LIKE, CHEAP, FREE_ROWS]))
def test_best_length_is_the_argmax_of_tokens_per_cost(p, limit, costs):
    assert best_length(p, limit, costs) == _reference_best(p, limit, costs)


@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.sampled_from([GEMMA_LIKE, CHEAP]))
def test_a_better_acceptance_never_shortens_the_draft(p, q, costs):
    lo, hi = sorted((p, q))
    assert best_length(lo, 64, costs) <= best_length(hi, 64, costs)


def test_one_proposal_pays_only_when_its_row_is_likely_to_be_used():
    # a second row costs 0.8 of a step: one proposal needs (1 + p) / 1.8 > 1 + MIN_GAIN
    assert best_length(0.85, 1, GEMMA_LIKE) == 0
    assert best_length(0.95, 1, GEMMA_LIKE) == 1
    assert best_length(0.3, 8, CHEAP) > 0  # cheap rows pay even at a modest acceptance
    assert best_length(1.0, 64, GEMMA_LIKE) == 64  # a certain copy drafts all it may
    # a measured 8-row step cheaper than 7 rows: the policy never drafts to an unmeasured count
    tiled = RowCosts.from_points([(1, 1.0), (2, 2.0), (7, 4.2), (8, 3.8), (10, 5.6), (12, 4.4)])
    assert best_length(0.99, 10, tiled) == 7  # 8 rows, not 9 or 10 interpolated between 8 and 10
    assert best_length(0.999, 12, tiled) == 11


def test_policy_drafts_long_while_a_long_match_keeps_being_accepted():
    policy = DraftPolicy(64, GEMMA_LIKE)
    lengths, match = [], 8
    for _ in range(8):
        d = policy.length(match, 64)
        lengths.append(d)
        policy.update(match, d, d)
        match = min(match + d + 1, 64)  # the copied run extends the match
    assert lengths[-1] >= 32 and lengths == sorted(lengths)


def test_policy_stops_proposing_after_short_matches_fail_but_long_matches_still_may():
    assert DraftPolicy(16, GEMMA_LIKE).length(2, 16) == 0  # at the prior, a 2-token match is not worth a dear row
    policy = DraftPolicy(16, CHEAP)
    assert policy.length(2, 16) > 0
    for _ in range(8):
        d = policy.length(2, 16)
        if d:
            policy.update(2, d, 0)
    assert policy.length(2, 16) == 0
    assert policy.length(MATCH_BUCKETS[-1][0], 16) > 0
    assert policy.acceptance(2) < 0.2


def test_policy_respects_its_maximum_what_the_lookup_offers_and_the_match_behind_it():
    policy = DraftPolicy(8, FREE_ROWS)
    assert policy.length(20, 30) == 8
    assert policy.length(20, 3) == 3
    assert policy.length(20, 0) == 0
    wide = DraftPolicy(64, FREE_ROWS)
    assert wide.length(2, 64) == MIN_DRAFT_CAP and wide.length(12, 64) == 12 and wide.length(64, 64) == 64
    with pytest.raises(ValueError):
        DraftPolicy(MAX_SPECULATIVE_TOKENS + 1)


def _simulate(costs, acceptance, match, steps_tokens=400, seed=7):
    """Cost of producing ``steps_tokens`` tokens under the policy when each proposal is accepted with a fixed chance."""
    rng = random.Random(seed)
    policy = DraftPolicy(64, costs)
    produced, cost = 0, 0.0
    while produced < steps_tokens:
        d = policy.length(match, 64)
        accepted = 0
        while accepted < d and rng.random() < acceptance:
            accepted += 1
        policy.update(match, d, accepted)
        produced += accepted + 1
        cost += costs.of(d + 1)
    return steps_tokens / cost  # speed relative to plain decoding (one token per unit of cost)


@pytest.mark.parametrize("costs", [GEMMA_LIKE, CHEAP], ids=["gemma-like", "cheap"])
@pytest.mark.parametrize("acceptance", [0.0, 0.2, 0.5])
@pytest.mark.parametrize("match", [2, 5])
def test_rejected_drafts_cost_at_most_two_percent_of_plain_decoding(costs, acceptance, match):
    assert _simulate(costs, acceptance, match) >= 0.98


@pytest.mark.parametrize("costs,floor", [(GEMMA_LIKE, 2.0), (CHEAP, 4.0)], ids=["gemma-like", "cheap"])
def test_a_copy_is_drafted_long_enough_to_pay(costs, floor):
    assert _simulate(costs, 0.995, 40) >= floor


def test_earlier_requests_drafts_are_estimated_apart_from_the_requests_own():
    policy = DraftPolicy(16, GEMMA_LIKE)
    for _ in range(6):
        d = policy.length(20, 16, "lease")
        if d:
            policy.update(20, d, 0, "lease")
    assert policy.length(20, 16, "lease") == 0  # an earlier answer this one departs from
    assert policy.length(20, 16, "request") == DraftPolicy(16, GEMMA_LIKE).length(20, 16)  # own copying untouched


# -- continuous batching: drafts inside a shared step ------------------------------------------------------

from aner_nb.llm.draft_policy import batch_drafts  # noqa: E402


@settings(max_examples=200)
@given(st.floats(0.0, 1.0), st.integers(0, 64), st.sampled_from([GEMMA_LIKE, CHEAP, FREE_ROWS]))
def test_one_sequence_alone_drafts_as_the_latency_policy(p, most, costs):
    chosen = batch_drafts([(3, p, most)], decoding=1, rows=1, room=511, costs=costs)
    assert chosen.get(3, 0) == best_length(p, most, costs)


def test_batch_drafts_only_where_the_step_gets_faster():
    # four decoding sequences on Gemma-like rows: a certain copy pays, a doubtful one does not
    chosen = batch_drafts([(0, 0.99, 16), (1, 0.3, 16), (2, 0.0, 16)], decoding=4, rows=4, room=508, costs=GEMMA_LIKE)
    assert set(chosen) == {0} and chosen[0] >= 4
    assert batch_drafts([(0, 0.99, 16)], decoding=4, rows=4, room=0, costs=GEMMA_LIKE) == {}  # no room left
    capped = batch_drafts([(0, 1.0, 64), (1, 1.0, 64)], decoding=2, rows=2, room=10, costs=FREE_ROWS)
    assert sum(capped.values()) <= 10


@settings(max_examples=200)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 32)), min_size=1, max_size=6),
       st.integers(0, 200), st.integers(0, 128), st.sampled_from([GEMMA_LIKE, CHEAP]))
def test_batch_drafts_never_slow_the_step_down_and_fit_the_budget(offers, prefill, room, costs):
    decoding = len(offers)
    rows = decoding + prefill
    chosen = batch_drafts([(i, p, m) for i, (p, m) in enumerate(offers)], decoding, rows, room, costs)
    assert sum(chosen.values()) <= room and all(1 <= chosen[i] <= offers[i][1] for i in chosen)
    extra = sum(chosen.values())
    tokens = decoding + sum(expected_tokens(offers[i][0], d) - 1 for i, d in chosen.items())
    base = costs.of(decoding) - costs.of(rows)
    assert tokens / (base + costs.of(rows + extra)) >= decoding / costs.of(decoding) * (1 - 1e-9)


def test_evidence_in_one_bucket_moves_the_others():
    """A request that keeps copying drafts after short matches too; one whose drafts fail stops after long ones."""
    copying = DraftPolicy(16, GEMMA_LIKE)
    assert copying.length(5, 16) == 0  # a 5-token match alone does not pay for Gemma-like rows
    for _ in range(6):
        copying.update(20, 16, 16)
    assert copying.length(5, 16) > 0 and copying.acceptance(5) > 0.85
    failing = DraftPolicy(16, CHEAP)
    for _ in range(8):
        failing.update(3, 4, 0)
    assert failing.acceptance(40) < DraftPolicy(16, CHEAP).acceptance(40) - 0.3


# -- drafts under llama.cpp's multi-stream split ---------------------------------------------------------

from aner_nb.llm.step_policy import micro_batches  # noqa: E402


def _split_equal_oracle(layout, n_ubatch):
    """llama.cpp's ``llama_batch_allocr::split_equal(n_ubatch, sequential=true)`` token by token, as written
    there (one sequence per token, the batch in the given order): the rows of each micro-batch."""
    tokens = [seq for seq, n in layout for _ in range(n)]
    used = [False] * len(tokens)
    out = []
    while not all(used):
        seqs, last = [], -1
        for i, seq in enumerate(tokens):
            if used[i] or seq in seqs:
                continue
            if not seqs or seq == last + 1:
                seqs.append(seq)
                last = seq
                if len(seqs) > n_ubatch:
                    break
        per_seq = {s: [i for i, t in enumerate(tokens) if t == s and not used[i]] for s in seqs}
        taken = 0
        while all(per_seq[s] for s in seqs):
            for s in seqs:
                used[per_seq[s].pop(0)] = True
            taken += 1
            if (taken + 1) * len(seqs) > n_ubatch:
                break
        out.append(taken * len(seqs))
    return tuple(out)


@settings(max_examples=300)
@given(st.dictionaries(st.integers(0, 9), st.integers(1, 40), min_size=1, max_size=6), st.integers(1, 64))
def test_micro_batches_are_llama_cpps_split(rows_by_seq, n_ubatch):
    layout = sorted(rows_by_seq.items())
    assert micro_batches(layout, n_ubatch) == _split_equal_oracle(layout, n_ubatch)


def test_a_lone_verifier_beside_decode_rows_costs_a_pass_of_its_own():
    # four decoding sequences, one verifying 8 proposals: llama.cpp runs 4 rows, then that sequence's 8
    assert micro_batches([(0, 9), (1, 1), (2, 1), (3, 1)], 512) == (4, 8)
    assert micro_batches([(0, 3), (1, 3), (2, 3), (3, 3)], 512) == (12,)  # equal counts: one pass
    layout = [(0, 1), (1, 1), (2, 1), (3, 1)]
    # with SmolLM2-like rows the flat model (one pass of 12 rows) pays for an 8-token draft at 0.95 acceptance,
    # the split model (a pass of 4 rows, then one of 8) does not
    offer = [(0, 0.95, 8)]
    flat = batch_drafts(offer, decoding=4, rows=4, room=508, costs=SMOL_LIKE)
    split = batch_drafts(offer, decoding=4, rows=4, room=508, costs=SMOL_LIKE, layout=layout, n_ubatch=512)
    assert flat.get(0, 0) > 0 and split.get(0, 0) < flat[0]
    # a certain copy still pays for its pass
    assert batch_drafts([(0, 1.0, 16)], decoding=4, rows=4, room=508, costs=SMOL_LIKE, layout=layout, n_ubatch=512)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 32)), min_size=1, max_size=6),
       st.integers(0, 200), st.integers(0, 128), st.sampled_from([GEMMA_LIKE, CHEAP]), st.sampled_from([32, 128, 512]))
def test_split_drafts_never_slow_the_split_step_down(offers, prefill, room, costs, n_ubatch):
    decoding = len(offers)
    layout = [(i, 1) for i in range(decoding)] + ([(decoding, prefill)] if prefill else [])
    rows = decoding + prefill
    chosen = batch_drafts([(i, p, m) for i, (p, m) in enumerate(offers)], decoding, rows, room, costs,
                          layout=layout, n_ubatch=n_ubatch)
    assert sum(chosen.values()) <= room and all(1 <= chosen[i] <= offers[i][1] for i in chosen)

    def cost(drafts):
        return sum(costs.of(n) for n in micro_batches([(s, n + drafts.get(s, 0)) for s, n in layout], n_ubatch))

    tokens = decoding + sum(expected_tokens(offers[i][0], d) - 1 for i, d in chosen.items())
    base = costs.of(decoding) - cost({})
    assert tokens / (base + cost(chosen)) >= decoding / costs.of(decoding) * (1 - 1e-9)


def test_copying_sequences_draft_together_in_one_pass():
    """Four decoding sequences that each copy at 0.8: one draft alone costs a pass of its own and does not
    pay on SmolLM2-like rows, the same count on all four shares the step's one pass and does."""
    layout = [(0, 1), (1, 1), (2, 1), (3, 1)]
    alone = batch_drafts([(0, 0.8, 16)], decoding=4, rows=4, room=508, costs=SMOL_LIKE, layout=layout, n_ubatch=512)
    assert alone == {}
    together = batch_drafts([(i, 0.8, 16) for i in range(4)], decoding=4, rows=4, room=508, costs=SMOL_LIKE,
                            layout=layout, n_ubatch=512)
    assert len(set(together.values())) == 1 and set(together) == {0, 1, 2, 3}
    assert len(micro_batches([(s, 1 + together[s]) for s, _ in layout], 512)) == 1
    assert batch_drafts([(i, 0.5, 16) for i in range(4)], decoding=4, rows=4, room=508, costs=SMOL_LIKE,
                        layout=layout, n_ubatch=512) == {}  # doubtful drafts still do not pay
