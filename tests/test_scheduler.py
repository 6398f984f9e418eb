"""The batching step policy, without a model: admission, budget sharing, row layout, compaction.

These are the pure functions of ``aner_nb.llm.scheduler``; the scheduler
thread that applies them to the engine is tested in ``test_batching.py``.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings, strategies as st

from aner_nb.llm import errors
from aner_nb.llm.scheduler import (
    Outbox,
    StepPlan,
    admit_count,
    compaction_moves,
    kv_victim,
    next_sequence_id,
    output_rows,
    plan_step,
    share_budget,
)


# -- admission ----------------------------------------------------------------------
@given(st.integers(0, 20), st.integers(0, 64))
def test_admission_takes_the_oldest_requests_one_per_free_sequence(waiting, free):
    assert admit_count(waiting, free) == min(waiting, free)


# -- sharing the prefill budget ---------------------------------------------------------
def test_share_budget_examples():
    assert share_budget([], 10) == ()
    assert share_budget([5, 5], 0) == (0, 0)
    assert share_budget([100, 3, 50], 60) == (29, 3, 28)  # the small one is satisfied, the rest split evenly
    assert share_budget([10, 10, 10], 2) == (1, 1, 0)  # the remainder goes to the oldest first
    assert share_budget([4, 0, 6], 100) == (4, 0, 6)  # never more than needed


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 600), max_size=12), st.integers(0, 1024))
def test_share_budget_is_work_conserving_and_max_min_fair(needs, budget):
    alloc = share_budget(needs, budget)
    assert len(alloc) == len(needs)
    assert sum(alloc) == min(budget, sum(needs))  # uses the whole budget whenever the needs allow
    assert all(0 <= a <= n for a, n in zip(alloc, needs))
    unsatisfied = [i for i, (a, n) in enumerate(zip(alloc, needs)) if a < n]
    for i in unsatisfied:
        # nobody gets more than one token above a prefill that still wants more
        assert max(alloc) <= alloc[i] + 1
        for j in unsatisfied:
            if i < j:
                assert alloc[i] >= alloc[j]  # earlier admissions get the remainder first


# -- planning one step -------------------------------------------------------------------
def test_plan_puts_every_decode_row_first_and_shares_the_rest():
    plan = plan_step([3, 0], [(1, 100), (2, 5)], batch_tokens=16)
    assert plan.decode == (3, 0)
    assert plan.prefill == ((1, 9), (2, 5))  # 14 left after two decode rows: 5 for the small prompt
    assert plan.n_tokens == 16 and plan.sequences == 4
    assert plan.layout() == ((0, 1), (1, 9), (2, 5), (3, 1))  # rows in sequence-id order


def test_plan_rejects_more_decode_rows_than_the_budget():
    with pytest.raises(ValueError, match="do not fit batch_tokens=2"):
        plan_step([0, 1, 2], [], batch_tokens=2)


def test_prefills_without_a_share_are_left_out_of_the_step():
    plan = plan_step([0, 1, 2], [(3, 10), (4, 10)], batch_tokens=4)
    assert plan.prefill == ((3, 1),)
    assert StepPlan((), ()).n_tokens == 0


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 64).flatmap(
        lambda n: st.tuples(
            st.permutations(range(n)),
            st.integers(0, n),
            st.lists(st.integers(1, 300), min_size=n, max_size=n),
            st.integers(n, 1024),
        )
    )
)
def test_plans_fit_the_budget_and_never_starve_decoding(args):
    ids, n_decode, prompts, budget = args
    decoding, prefilling = list(ids[:n_decode]), [(s, prompts[s]) for s in ids[n_decode:]]
    plan = plan_step(decoding, prefilling, budget)
    assert plan.n_tokens <= budget
    assert plan.decode == tuple(decoding)  # every decoding sequence gets its row, every step
    assert all(n <= dict(prefilling)[s] for s, n in plan.prefill)
    if prefilling:
        assert plan.prefill  # budget >= sequences, so some prompt always advances
    layout = plan.layout()
    assert [s for s, _ in layout] == sorted(s for s, _ in layout)
    assert sum(n for _, n in layout) == plan.n_tokens


# -- keeping sequence ids consecutive ---------------------------------------------------------
def test_admissions_take_an_id_next_to_the_running_sequences():
    assert next_sequence_id([], [0, 1, 2, 3]) == 0
    assert next_sequence_id([0, 2], [1, 3]) == 1  # fill the gap first
    assert next_sequence_id([2, 3], [0, 1, 4]) == 4  # then extend upwards
    assert next_sequence_id([2, 3], [0, 1]) == 1  # then downwards
    assert next_sequence_id([0, 3], [1, 2]) == 1
    with pytest.raises(ValueError):
        next_sequence_id([0], [])


@given(st.integers(1, 16).flatmap(lambda n: st.tuples(st.just(n), st.lists(st.booleans(), min_size=n, max_size=n))))
def test_admitting_from_consecutive_ids_keeps_them_consecutive(args):
    n, mask = args
    active = [i for i in range(n) if mask[i]]
    if not active or len(active) == n or active[-1] - active[0] + 1 != len(active):
        return
    free = [i for i in range(n) if not mask[i]]
    new = next_sequence_id(active, free)
    ids = sorted(active + [new])
    assert new in free and ids[-1] - ids[0] + 1 == len(ids)


def test_compaction_moves_the_fewest_sequences():
    assert compaction_moves([0, 2, 3], 4) == ((3, 1),)  # one move either way: the lower window wins a tie
    assert compaction_moves([0, 1, 3], 4) == ((3, 2),)
    assert compaction_moves([0, 1, 2], 4) == ()
    assert compaction_moves([5], 8) == ()  # a lone sequence is one micro-batch wherever it is
    assert compaction_moves([1, 5, 6], 8) == ((1, 4),)  # not two moves towards 0
    assert compaction_moves([], 4) == ()


@given(st.integers(1, 32).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1), min_size=1))))
def test_compaction_makes_ids_consecutive_with_minimal_moves(args):
    n_ids, active = args
    moves = compaction_moves(sorted(active), n_ids)
    ids = set(active)
    for src, dst in moves:
        assert src in ids and dst not in ids and 0 <= dst < n_ids
        ids = (ids - {src}) | {dst}
    assert max(ids) - min(ids) + 1 == len(ids) == len(active)
    best = max(len(active & set(range(w, w + len(active)))) for w in range(n_ids - len(active) + 1))
    assert len(moves) == len(active) - best


# -- who gives way when the KV is full ----------------------------------------------------------
def test_kv_victim_is_the_newest_prefill_else_the_newest():
    assert kv_victim([(0, 1, False), (1, 4, True), (2, 3, True), (3, 9, False)]) == 1
    assert kv_victim([(0, 1, False), (5, 7, False)]) == 5
    with pytest.raises(ValueError):
        kv_victim([])


# -- logits rows and the CPU output kernel ------------------------------------------------------
def test_output_rows_pads_odd_counts_only_where_the_kernel_pairs_columns():
    assert [output_rows(n, True) for n in range(9)] == [0, 1, 2, 4, 4, 6, 6, 8, 8]
    assert [output_rows(n, False) for n in range(9)] == list(range(9))


@pytest.mark.parametrize("info, expected", [
    ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |", True),
    ("CPU : AVX2 = 1 | LLAMAFILE = 1 |", True),
    ("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | LLAMAFILE = 1 |", False),  # 32 registers
    ("CPU : AVX = 1 | AVX2 = 1 | LLAMAFILE = 0 |", False),  # ggml's own kernels
    ("CPU : NEON = 1 | ARM_FMA = 1 | DOTPROD = 1 | LLAMAFILE = 1 |", False),
    ("CUDA : ARCHS = 890 | CPU : AVX2 = 1 | LLAMAFILE = 1 |", True),
])
def test_column_pairing_is_read_from_the_build_flags(info, expected):
    from aner_nb.llm._engine import pairs_batch_columns

    assert pairs_batch_columns("Q8_0", info) is expected
    assert pairs_batch_columns("Q5_0", info) is expected
    assert pairs_batch_columns("Q6_K", info) is False  # not a tinyBLAS Q0 type
    assert pairs_batch_columns(None, info) is False


# -- the per-request outbox ---------------------------------------------------------------------
def test_outbox_is_bounded_and_wakes_the_scheduler_when_room_appears():
    wakes = []
    box = Outbox(2, wake=lambda: wakes.append(1), guard=lambda what: None)
    assert box.has_room()
    box.put("a")
    box.put("b")
    assert not box.has_room()
    assert box.get() == "a" and wakes == [1]  # it was full: the scheduler may resume the sequence
    assert box.get() == "b" and wakes == [1]
    box.close()
    assert box.get() is None


def test_outbox_get_blocks_until_a_piece_or_the_end():
    box = Outbox(4, wake=lambda: None, guard=lambda what: None)
    got = []
    t = threading.Thread(target=lambda: got.extend([box.get(), box.get()]))
    t.start()
    box.put("x")
    box.close()
    t.join(5)
    assert got == ["x", None]


def test_outbox_refuses_a_reader_on_the_scheduler_thread():
    def guard(what):
        raise errors.BusyError(what)

    box = Outbox(1, wake=lambda: None, guard=guard)
    with pytest.raises(errors.BusyError, match="reading a stream"):
        box.get()
