"""The batching step policy, without a model: admission, budget sharing, row layout, compaction, padding.

These are the pure functions of ``aner_nb.llm.step_policy``; the scheduler
thread that applies them to the engine is tested in ``test_batching.py``.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from hypothesis import assume, given, settings, strategies as st

from aner_nb.llm import errors
from aner_nb.llm.outbox import Outbox
from aner_nb.llm.scheduler_stats import SchedulerStats, stat_fields
from aner_nb.llm.step_policy import (
    FifoAdmission,
    Rows,
    StepPlan,
    admit_count,
    compaction_moves,
    kv_victim,
    next_sequence_id,
    output_rows,
    plan_batch,
    plan_step,
    share_budget,
)


# -- admission ----------------------------------------------------------------------
@given(st.integers(0, 20), st.integers(0, 64))
def test_admission_takes_the_oldest_requests_one_per_free_sequence(waiting, free):
    assert admit_count(waiting, free) == min(waiting, free)


def test_fifo_admission_starts_the_oldest_requests_in_order():
    fifo = FifoAdmission()
    assert fifo.admit(["a", "b", "c"], [4, 7]) == ("a", "b")  # the oldest first, one per free id
    assert fifo.admit(["a"], [0, 1, 2]) == ("a",)
    assert fifo.admit(["a", "b"], []) == ()
    assert fifo.admit([], [0]) == ()


@given(st.lists(st.integers(), unique=True, max_size=20), st.sets(st.integers(0, 63)))
def test_fifo_admission_is_a_prefix_of_the_queue(waiting, free):
    chosen = FifoAdmission().admit(waiting, sorted(free))
    assert list(chosen) == waiting[: admit_count(len(waiting), len(free))]


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


def step_inputs(max_ids: int, max_prompt: int, max_budget: int):
    """(sequence ids in random order, a split point, a prompt length per id, a budget of a row per id at least)."""
    return st.integers(1, max_ids).flatmap(
        lambda n: st.tuples(
            st.permutations(range(n)),
            st.integers(0, n),
            st.lists(st.integers(1, max_prompt), min_size=n, max_size=n),
            st.integers(n, max_budget),
        )
    )


@settings(max_examples=200, deadline=None)
@given(step_inputs(64, 300, 1024))
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


# -- the batch of one step, row by row ----------------------------------------------------------
def test_batch_plan_lays_rows_out_by_sequence_id_and_samples_ends_of_prompts():
    plan = plan_batch([2, 0], [(1, 3), (3, 50)], batch_tokens=8)
    assert plan.rows == (
        Rows(0, 0, 1, "decode", True),
        Rows(1, 1, 3, "prefill", True),  # the whole rest of its prompt: its last row is sampled
        Rows(2, 4, 1, "decode", True),
        Rows(3, 5, 3, "prefill", False),  # a chunk of a longer prompt: no logits
    )
    assert plan.sampled == ((0, 0), (1, 3), (2, 4)) and plan.participants == (0, 1, 2, 3)
    assert plan.n_tokens == plan.step.n_tokens == 8
    assert not plan.padded and plan.spare_row == plan.pad_seq == -1  # the kernel pairs no columns


def test_an_odd_sampled_count_pads_with_an_unsampled_prompt_row_first():
    # the chunk of sequence 3 (rows 5..7) is not sampled: its last row gets the extra logits
    plan = plan_batch([2, 0], [(1, 3), (3, 50)], batch_tokens=8, pair_columns=True, free=[4, 5])
    assert plan.spare_row == 7 and plan.pad_seq == -1 and plan.padded
    # a prompt that ends here has unsampled rows before its sampled last one
    plan = plan_batch([2, 0], [(1, 3)], batch_tokens=8, pair_columns=True, free=[3])
    assert plan.spare_row == 2 and plan.pad_seq == -1 and plan.sampled == ((0, 0), (1, 3), (2, 4))


def test_without_a_spare_prompt_row_the_padding_token_takes_an_id_next_to_the_active_ones():
    plan = plan_batch([1, 2, 3], [], batch_tokens=8, pair_columns=True, active=[1, 2, 3, 5], free=[0, 4, 6, 7])
    assert plan.pad_seq == 4 and plan.spare_row == -1  # fills the gap between the active ids
    assert plan.rows[3] == Rows(4, 3, 1, "pad", False)
    assert plan.sampled == ((1, 0), (2, 1), (3, 2)) and plan.participants == (1, 2, 3)
    assert plan.n_tokens == 4 and plan.step.n_tokens == 3
    # the padding token sorts into the middle of the batch: rows after it shift by one
    plan = plan_batch([0, 2], [(3, 1)], batch_tokens=8, pair_columns=True, free=[1])
    assert plan.pad_seq == 1 and plan.sampled == ((0, 0), (2, 2), (3, 3))


def test_a_step_goes_unpadded_without_a_free_id_or_batch_room():
    assert not plan_batch([0, 1, 2], [], batch_tokens=8, pair_columns=True, free=[]).padded
    assert not plan_batch([0, 1, 2], [], batch_tokens=3, pair_columns=True, free=[3]).padded
    assert not plan_batch([0], [], batch_tokens=3, pair_columns=True, free=[1]).padded  # one row: no pairing
    assert plan_batch([0, 1], [(2, 1)], batch_tokens=4, pair_columns=True, free=[3]).pad_seq == 3


@settings(max_examples=300, deadline=None)
@given(step_inputs(12, 40, 64), st.integers(0, 11), st.booleans())
def test_batch_plans_sample_exactly_the_right_rows_and_pad_only_where_the_kernel_pairs(args, n_free, pair):
    ids, n_decode, prompts, budget = args
    n_active = max(len(ids) - n_free, 1)
    active, free = list(ids[:n_active]), sorted(ids[n_active:])
    decoding = active[:n_decode]
    prefilling = [(s, prompts[s]) for s in active[n_decode:]]
    plan = plan_batch(decoding, prefilling, budget, pair_columns=pair, active=active, free=free)
    assert [r.first for r in plan.rows] == [sum(r.count for r in plan.rows[:i]) for i in range(len(plan.rows))]
    assert [r.seq for r in plan.rows] == sorted(r.seq for r in plan.rows)
    ending = {s for s, n in plan.step.prefill if n == dict(prefilling)[s]}
    assert {s for s, _ in plan.sampled} == set(decoding) | ending
    assert plan.n_tokens == plan.step.n_tokens + (plan.pad_seq >= 0) <= budget
    want = output_rows(len(plan.sampled), pair)
    assert len(plan.sampled) + plan.padded in (want, len(plan.sampled))  # padded only where asked for
    if plan.spare_row >= 0:
        assert plan.pad_seq < 0 and plan.spare_row not in {row for _, row in plan.sampled}
        assert any(r.kind == "prefill" and r.first <= plan.spare_row <= r.last for r in plan.rows)
    if plan.pad_seq >= 0:
        assert plan.pad_seq in free and plan.pad_seq not in plan.participants
    if want > len(plan.sampled) and not plan.padded:
        # no prompt row to spare, and no id or no room for a padding token
        assert all(r.sampled and r.count == 1 for r in plan.rows)
        assert not free or plan.n_tokens == budget


# -- keeping sequence ids consecutive ---------------------------------------------------------
def test_admissions_take_an_id_next_to_the_running_sequences():
    assert next_sequence_id([], [0, 1, 2, 3]) == 0
    assert next_sequence_id([0, 2], [1, 3]) == 1  # fill the gap first
    assert next_sequence_id([2, 3], [0, 1, 4]) == 4  # then extend upwards
    assert next_sequence_id([2, 3], [0, 1]) == 1  # then downwards
    assert next_sequence_id([0, 3], [1, 2]) == 1
    with pytest.raises(ValueError):
        next_sequence_id([0], [])


def consecutive_runs(max_ids: int):
    """(n ids, a run of consecutive active ids that leaves at least one id free): only valid examples."""
    return st.integers(2, max_ids).flatmap(
        lambda n: st.integers(1, n - 1).flatmap(
            lambda length: st.tuples(st.just(n), st.integers(0, n - length), st.just(length))
        )
    )


@given(consecutive_runs(16))
def test_admitting_from_consecutive_ids_keeps_them_consecutive(args):
    # Every example is a valid one (a random mask was consecutive, non-empty and not full in only a
    # small fraction of examples, and the test returned early, asserting nothing, for the rest).
    n, start, length = args
    active = list(range(start, start + length))
    assume(active and len(active) < n)  # holds by construction; an invalid example would be counted
    free = [i for i in range(n) if i not in active]
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


# -- one statistics vocabulary ------------------------------------------------------------------
def test_scheduler_stats_declare_the_monitor_and_prometheus_names():
    from aner_nb.widgets.batching import OPTIONAL_STATS_FIELDS, STATS_ALIASES, STATS_FIELDS

    assert STATS_FIELDS == ("active_sequences", "queue_length", "scheduler_steps", "decoded_tokens")
    assert OPTIONAL_STATS_FIELDS == ("max_sequences", "queue_capacity", "completed_requests")
    assert STATS_ALIASES["queue_length"] == ("waiting",) and "decoded_tokens" not in STATS_ALIASES
    metrics = {f.name: (f.metadata["metric"], f.metadata["metric_type"]) for f in stat_fields("metric")}
    assert metrics["waiting"] == ("aner_queue_length", "gauge")
    assert metrics["steps"] == ("aner_scheduler_steps_total", "counter")
    assert len({name for name, _ in metrics.values()}) == len(metrics)
    assert all(f.metadata["help"] for f in dataclasses.fields(SchedulerStats))


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
