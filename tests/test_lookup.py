"""Prompt-lookup proposals: the pure reference and the incremental index agree."""

from hypothesis import given, settings, strategies as st

from aner_nb.llm.lookup import NgramIndex, propose


def test_longest_suffix_wins_over_shorter_more_recent_match():
    #            0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3]
    # suffix (1,2,3) occurred at 0 -> followed by 4, 9, ...; (2,3) alone occurred later at 5 -> 7
    assert propose(history, 3) == [4, 9, 2]


def test_most_recent_occurrence_of_the_same_length():
    history = [5, 6, 1, 5, 6, 2, 5, 6]
    assert propose(history, 1) == [2]


def test_no_match_and_limits():
    assert propose([1, 2, 3, 4], 4) == []
    assert propose([1, 2, 1, 2], 0) == []
    assert propose([1, 2, 9, 1, 2], 10) == [9, 1, 2]  # proposals may run into the suffix itself
    assert propose([7], 3) == []


def test_single_token_suffix_is_not_enough():
    assert propose([1, 5, 2, 5], 2) == []  # only a 1-token match: below the 2-token minimum


def test_window_limits_the_search():
    old = [1, 2, 3]
    filler = list(range(100, 130))
    history = old + filler + [1, 2]
    assert propose(history, 1) == [3]
    assert propose(history, 1, window=len(filler) + 2) == []
    index = NgramIndex(history, window=len(filler) + 2)
    assert index.propose(1) == []


def test_repeated_runs_propose_the_repetition():
    assert propose([4, 4, 4, 4], 3) == [4]  # latest earlier (4,4,4) at 0 -> followed by the last 4


@settings(max_examples=300)
@given(
    st.lists(st.integers(0, 5), max_size=60),
    st.integers(0, 10),
    st.integers(2, 80),
)
def test_incremental_index_equals_reference(tokens, k, window):
    index = NgramIndex(window=window)
    for i, t in enumerate(tokens):
        index.append(t)
        assert index.propose(k) == propose(tokens[: i + 1], k, window=window)


@given(st.lists(st.integers(0, 3), min_size=3, max_size=40), st.integers(1, 8))
def test_proposals_continue_an_earlier_occurrence(tokens, k):
    out = propose(tokens, k)
    if out:
        # some n-gram of length >= 2 equal to the suffix is followed by exactly these tokens
        found = False
        for n in range(2, 9):
            suffix = tokens[-n:]
            for s in range(len(tokens) - n):
                if tokens[s : s + n] == suffix and tokens[s + n : s + n + len(out)] == out:
                    found = True
        assert found


def test_draft_policy_grows_on_acceptance_and_backs_off_on_rejection():
    from aner_nb.llm.lookup import MAX_BACKOFF, DraftPolicy

    p = DraftPolicy(8)
    assert p.budget() == 8
    p.update(8, 3)  # partial: shrink to what was accepted plus one
    assert p.budget() == 4
    p.update(4, 4)  # full acceptance doubles, capped at the maximum
    assert p.budget() == 8
    p.update(8, 0)  # complete rejection: one step without proposals, then a single one
    assert [p.budget(), p.budget()] == [0, 1]
    p.update(1, 0)  # a second rejection in a row doubles the pause
    assert [p.budget() for _ in range(3)] == [0, 0, 1]
    for _ in range(10):
        p.update(1, 0)
        while p.budget() == 0:
            pass
    p.update(1, 0)
    pauses = 0
    while p.budget() == 0:
        pauses += 1
    assert pauses == MAX_BACKOFF
    p.update(1, 1)  # one lucky short match after a run of rejections does not end the back-off
    p.update(2, 0)
    assert [p.budget() for _ in range(MAX_BACKOFF + 1)] == [0] * MAX_BACKOFF + [1]
    for _ in range(4):  # acceptance recovers the estimate: then a rejection pauses briefly again
        p.update(4, 4)
    p.update(2, 0)
    assert [p.budget(), p.budget()] == [0, 1]
    p.update(0, 0)  # a step without proposals changes nothing
    assert p.budget() == 1


def test_draft_policy_pauses_when_partial_acceptance_does_not_pay():
    """Counting-like steps (2 of 3 accepted) estimate ~2/3 < MIN_ACCEPTANCE: pauses grow; copying does not pause."""
    from aner_nb.llm.lookup import MIN_ACCEPTANCE, DraftPolicy

    counting = DraftPolicy(8)
    budgets = []
    for _ in range(40):
        b = counting.budget()
        budgets.append(b)
        if b:
            counting.update(min(b, 3), min(b, 3) - 1)  # ", " accepted, the digit after it rejected
    assert counting.acceptance < MIN_ACCEPTANCE
    assert budgets.count(0) > 20  # mostly paused: a 2-row step costs more than 1.67 tokens are worth

    copying = DraftPolicy(16)
    budgets = []
    for _ in range(40):
        b = copying.budget()
        budgets.append(b)
        copying.update(b, b - 1 if len(budgets) % 5 == 0 else b)  # an occasional last-token rejection
    assert copying.acceptance >= MIN_ACCEPTANCE and 0 not in budgets
    assert max(budgets) == 16
