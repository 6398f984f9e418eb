"""Prefix-cache policy as pure functions over token tuples."""

from hypothesis import given, strategies as st

from aner_nb.llm.prefix_pool import choose, common_prefix_length, lru_victim, retain_length, reusable_prefix
from aner_nb.llm.reuse import MIN_ROWS, ROW_BLOCK, TAIL_ROWS, restore_point


def test_common_prefix_and_replay_of_last_token():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    # a fully cached prompt still evaluates its tail: its last token or a few more, so that the kept part
    # ends on a row block; a partly cached one evaluates at least MIN_ROWS tokens before the tail (reuse)
    assert (MIN_ROWS, ROW_BLOCK, TAIL_ROWS) == (8, 4, 1)
    assert reusable_prefix(list(range(30)) + [99], list(range(30))) == 28
    assert reusable_prefix(list(range(32)) + [99], list(range(32))) == 28
    assert reusable_prefix(list(range(33)), list(range(33))) == 32
    assert reusable_prefix(list(range(13)), list(range(40))) == 12
    assert reusable_prefix(list(range(30)), list(range(35))) == 24  # 28 would leave 4 rows before the tail
    assert reusable_prefix(list(range(12)), list(range(12))) == 8
    assert reusable_prefix(list(range(9)), list(range(9))) == 8
    assert reusable_prefix(list(range(8)), list(range(8))) == 0  # a body of 4 rows: one small micro-batch
    assert reusable_prefix([1, 2, 3], [1, 2, 3]) == 0


def test_longest_prefix_entry_is_chosen():
    entries = [(1, 2, 3, 4, 5), (*range(1, 10), 99), (1, 9)]
    prompt = [*range(1, 10), *range(20, 40)]
    choice = choose(entries, [1, 2, 3], prompt, trivial_prefix=1, capacity=3)
    assert choice.entry == 1 and choice.keep == 8


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
    assert retain_length(3000, 2048) == 2048
    # only body rows are kept (reuse.retained_rows): not the tail, which ran in its own small micro-batch,
    # and nothing of a prompt whose body is shorter than MIN_ROWS (one small micro-batch, other kernels)
    assert retain_length(103, 2048) == 100 and retain_length(100, 2048) == 96 and retain_length(3000, 2050) == 2048
    assert retain_length(MIN_ROWS, 2048) == 0 and retain_length(MIN_ROWS + 1, 2048) == MIN_ROWS
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
        assert choice.keep == restore_point(best, len(prompt)) and best > trivial
        assert choice.keep % ROW_BLOCK == 0 and 0 <= choice.keep <= max(0, len(prompt) - TAIL_ROWS)
    else:
        assert choice.keep == 0


@given(
    a=st.lists(st.integers(0, 5), max_size=300),
    b=st.lists(st.integers(0, 5), max_size=300),
    shared=st.integers(0, 3000),
)
def test_common_prefix_length_equals_a_scan(a, b, shared):
    """The slice-halving comparison against the plain loop it replaced (the oracle), on short alphabets
    (differences anywhere) after a shared run of up to 3,000 tokens, lists against tuples."""
    run = [7] * shared
    x, y = run + a, tuple(run + b)
    n = min(len(x), len(y))
    expected = next((i for i in range(n) if x[i] != y[i]), n)
    assert common_prefix_length(x, y) == common_prefix_length(y, x) == expected
