"""Prefix-cache policy as pure functions over token tuples."""

from hypothesis import given, strategies as st

from aner_nb.llm.prefix_pool import choose, common_prefix_length, lru_victim, retain_length, reusable_prefix


def test_common_prefix_and_replay_of_last_token():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    # a fully cached prompt still evaluates its last token (logits are call local)
    assert reusable_prefix([1, 2, 3, 9], [1, 2, 3]) == 2
    assert reusable_prefix([1, 2, 3], [1, 2, 3, 4]) == 3


def test_longest_prefix_entry_is_chosen():
    entries = [(1, 2, 3, 4), (1, 2, 3, 4, 5, 6), (1, 9)]
    choice = choose(entries, [1, 2, 3], [1, 2, 3, 4, 5, 7], trivial_prefix=1, capacity=3)
    assert choice.entry == 1 and choice.keep == 5


def test_ties_go_to_the_most_recent_entry():
    entries = [(1, 2, 3), (1, 2, 3)]
    assert choose(entries, [5, 9], [1, 2, 3, 4], trivial_prefix=0, capacity=2).entry == 1


def test_template_only_match_does_not_evict_while_capacity_remains():
    entries = [(7, 7, 1, 2, 3, 4)]  # 7,7 = BOS + turn header, shared by every prompt
    choice = choose(entries, [1], [7, 7, 9, 9], trivial_prefix=2, capacity=2)
    assert choice.entry is None and choice.evict is None  # a fresh context; the useful entry stays


def test_full_pool_recycles_the_least_recently_used_entry():
    entries = [(7, 7, 1), (7, 7, 2), (7, 7, 3)]
    choice = choose(entries, [5, 3, 9], [7, 7, 8], trivial_prefix=2, capacity=3)
    assert choice.entry is None and choice.evict == 1
    # requests in flight count against capacity too
    assert choose(entries[:2], [5, 3], [7, 7, 8], trivial_prefix=2, capacity=3, in_use=1).evict == 1


def test_retention_cap():
    assert retain_length(100, 2048) == 100
    assert retain_length(3000, 2048) == 2048
    assert lru_victim([4, 2, 9]) == 1


@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12).map(tuple), max_size=5),
    st.lists(st.integers(0, 3), min_size=1, max_size=12),
    st.integers(0, 3),
)
def test_choice_never_keeps_more_than_the_prompt_allows(entries, prompt, trivial):
    last_used = list(range(len(entries)))
    choice = choose(entries, last_used, prompt, trivial_prefix=trivial, capacity=max(len(entries), 1))
    if choice.entry is not None:
        best = max(common_prefix_length(e, prompt) for e in entries)
        assert choice.keep == min(best, len(prompt) - 1) and best > trivial
        assert 0 <= choice.keep < len(prompt)
    else:
        assert choice.keep == 0
