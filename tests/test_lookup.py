"""Prompt-lookup proposals: the pure reference and the incremental index agree."""

from hypothesis import given, settings, strategies as st

from aner_nb.llm.lookup import MAX_MATCH, MAX_NGRAM, LookupCorpus, NgramIndex, propose


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


def _match_reference(tokens, start, n, low=0):
    """How far back the history's suffix equals the text before ``start + n`` (a plain scan)."""
    m = 0
    while m < MAX_MATCH and start + n - m - 1 >= low and tokens[start + n - m - 1] == tokens[len(tokens) - m - 1]:
        m += 1
    return m


@settings(max_examples=300)
@given(st.lists(st.integers(0, 3), max_size=120), st.integers(1, 10))
def test_lookup_measures_the_whole_match_behind_a_proposal(tokens, k):
    index = NgramIndex(tokens)
    draft = index.lookup(k)
    assert (draft is None) == (propose(tokens, k) == [])
    if draft is not None:
        assert list(draft.tokens) == propose(tokens, k)
        # the occurrence the proposal continues, and how far back it agrees with the history's end
        n = next(n for n in range(min(MAX_NGRAM, len(tokens) - 1), 1, -1) if index.latest(tokens[-n:]) is not None
                 and index.latest(tokens[-n:]) + n < len(tokens))
        start = index.latest(tokens[-n:])
        assert draft.match == _match_reference(tokens, start, n)
        assert 2 <= draft.match <= MAX_MATCH


def test_a_long_copy_reports_a_long_match():
    text = list(range(100, 180))
    index = NgramIndex(text + [7] + text[:40])  # copying the first 40 tokens again
    draft = index.lookup(8)
    assert draft.tokens == tuple(text[40:48]) and draft.match == 40
    index = NgramIndex(text + [7] + text[:70])
    assert index.lookup(8).match == MAX_MATCH  # measured no further than MAX_MATCH


def test_corpus_continues_an_earlier_request_within_that_request():
    corpus = LookupCorpus(capacity=1000)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    second = [50, 51, 52, 53]
    corpus.add(first)
    corpus.add(second)
    draft = corpus.lookup([99, 3, 4, 5], 10)
    assert draft.tokens == (6, 7, 8, 9) and draft.match == 3 and draft.source == "lease"
    # the last n-gram of a request is followed by the next request's tokens: never proposed
    assert corpus.lookup([0, 8, 9], 4) is None
    assert corpus.lookup([52, 53], 4) is None
    assert corpus.lookup([1, 2], 0) is None


@settings(max_examples=200)
@given(st.lists(st.lists(st.integers(0, 4), min_size=3, max_size=30), min_size=1, max_size=12),
       st.integers(10, 120), st.lists(st.integers(0, 4), min_size=2, max_size=12))
def test_corpus_is_bounded_and_proposes_only_what_a_kept_request_continued(requests, capacity, history):
    corpus = LookupCorpus(capacity=capacity)
    for r in requests:
        corpus.add(r)
        assert len(corpus) <= capacity
    kept = [r[-capacity:] for r in requests]
    draft = corpus.lookup(history, 6)
    if draft is None:
        return
    # some kept request holds the matched suffix followed by exactly the proposal, inside that request
    n = min(draft.match, MAX_NGRAM)
    assert any(
        r[s : s + n] == history[-n:] and tuple(r[s + n : s + n + len(draft.tokens)]) == draft.tokens
        for r in kept for s in range(len(r) - n)
    )
    assert draft.match <= len(history)


def test_corpus_drops_the_oldest_requests_first():
    corpus = LookupCorpus(capacity=40)
    corpus.add(list(range(0, 20)))
    corpus.add(list(range(100, 120)))
    assert corpus.lookup([3, 4], 2).tokens == (5, 6)
    corpus.add(list(range(200, 220)))  # 60 tokens > 40: the oldest goes
    assert len(corpus) <= 40
    assert corpus.lookup([3, 4], 2) is None
    assert corpus.lookup([203, 204], 2).tokens == (205, 206)
