"""Measured verification-row costs: what is measured, how it is cached, and what a cache file may not do."""

import json

import pytest

from aner_nb import llm
from aner_nb.llm import row_costs as rc
from aner_nb.llm.draft_policy import RowCosts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ANER_NB_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def base(llama_path, one_thread):
    with llm.load(llama_path, context=512) as model:
        yield model


def _params(lease):
    from aner_nb.llm.requests import context_params

    return context_params(lease._weights, lease._profile)


def test_a_speculative_lease_measures_its_rows_once_and_caches_them(base, cache, monkeypatch):
    with base.with_optimizer(speculative_tokens=6) as spec:
        files = list((cache / "row-costs").glob("*.json"))
        assert len(files) == 1
        record = json.loads(files[0].read_text())
        assert record["key"]["model"] == base.fingerprint and record["key"]["threads"] == spec.generate(
            "x", max_tokens=1).timings.threads
        rows = [k for k, _ in record["points"]]
        assert rows[0] == 1 and rows[-1] == 7 and rows == sorted(set(rows))  # 1..speculative_tokens + 1
        assert spec._speculator.costs == RowCosts.from_points([tuple(p) for p in record["points"]])

    def no_measuring(*args, **kwargs):
        raise AssertionError("a cached measurement was measured again")

    monkeypatch.setattr(rc, "measure_row_costs", no_measuring)
    with base.with_optimizer(speculative_tokens=4) as again:  # fewer rows: the cached table covers them
        assert again._speculator.costs.of(5) > 0
    with pytest.raises(AssertionError, match="measured again"):  # other threads: another measurement
        base.with_optimizer(speculative_tokens=6, threads=2, prefill_threads=2)


def test_more_rows_than_cached_are_measured_again(base, cache):
    params = _params(base)
    first = rc.row_costs(base._weights.native, base.fingerprint, params, 3)
    assert len(first.ratios) == 3
    wider = rc.row_costs(base._weights.native, base.fingerprint, params, 9)
    assert len(wider.ratios) == 9


@pytest.mark.parametrize("content", [
    "not json",
    json.dumps([1, 2]),
    "KEY:other-model",
    "POINTS:[[1, -0.001], [2, 0.002]]",
    "POINTS:[[1, NaN], [2, 0.002]]",
    "POINTS:[[2, 0.001], [1, 0.002]]",
    "POINTS:[[1, 0.001], [1, 0.002], [3, 0.003]]",
    "POINTS:[[1, 0.001], [66, 0.002]]",
    "POINTS:[[1, 1000.0], [3, 0.002]]",
    "POINTS:[[1, \"0.001\"], [3, 0.002]]",
    "POINTS:[[1, 0.001], [2, 0.002]]",  # covers fewer rows than asked for
    "HUGE",
    "[" * 50_000,  # under the size cap, nested deeper than the JSON parser recurses
], ids=["garbage", "list", "foreign-key", "negative", "nan", "unsorted", "duplicate", "too-many-rows",
        "implausible", "string", "too-few", "huge", "nested"])
def test_a_bad_cache_file_is_measured_again_and_replaced(base, cache, content):
    params = _params(base)
    key = rc.cost_key(base.fingerprint, params)
    path = rc.cost_path(key)
    path.parent.mkdir(parents=True)
    if content.startswith("KEY:"):
        text = json.dumps({"key": {**key, "model": content[4:]}, "points": [[1, 0.001], [3, 0.002]]})
    elif content.startswith("POINTS:"):
        text = '{"key": ' + json.dumps(key) + ', "points": ' + content[7:] + "}"
    elif content == "HUGE":
        text = json.dumps({"key": key, "points": [[1, 0.001], [3, 0.002]], "pad": "x" * 100_000})
    else:
        text = content
    path.write_text(text)
    costs = rc.row_costs(base._weights.native, base.fingerprint, params, 3)
    record = json.loads(path.read_text())  # replaced by a fresh, valid measurement
    assert record["key"] == key and [k for k, _ in record["points"]] == [1, 2, 3]
    assert costs == RowCosts.from_points([tuple(p) for p in record["points"]])


def test_an_unwritable_cache_still_measures(base, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ANER_NB_CACHE", str(blocker))  # a file where the directory would go
    costs = rc.row_costs(base._weights.native, base.fingerprint, _params(base), 2)
    assert len(costs.ratios) == 2


def test_rows_out_of_range_are_refused(base, cache):
    with pytest.raises(ValueError, match="rows must be in 1..65"):
        rc.row_costs(base._weights.native, base.fingerprint, _params(base), 66)


def test_paired_ratios_take_each_count_over_its_own_neighbours():
    steady = [(1, 0.010, 0.010), (4, 0.025, 0.010), (12, 0.050, 0.010)]
    slow = [(1, 0.020, 0.020), (4, 0.050, 0.020), (12, 0.100, 0.020)]  # a slow minute: every step twice as long
    assert rc.paired_ratios([steady, slow, steady]) == {1: 1.0, 4: 2.5, 12: 5.0}
    # only the one-row steps slow: separate medians would call 4 rows 1.25 steps; the neighbours say 2.5 ...
    spiked = [(1, 0.020, 0.020), (4, 0.025, 0.010), (12, 0.050, 0.010)]
    assert rc.paired_ratios([spiked, spiked, steady])[4] == 2.5
    # ... and one round whose neighbours were caught slow does not move the median
    odd = [(1, 0.010, 0.010), (4, 0.025, 0.030), (12, 0.050, 0.030)]
    assert rc.paired_ratios([steady, odd, steady]) == {1: 1.0, 4: 2.5, 12: 5.0}


def test_the_probe_times_each_count_between_one_row_steps(base, decode_sizes):
    points = rc.measure_row_costs(base._weights.native, _params(base), 5, rounds=2)
    assert [k for k, _ in points] == [1, 2, 3, 4, 5]
    assert all(s > 0 for _, s in points)
    steps = decode_sizes[1:]  # after the prefix
    assert len(steps) == 3 * 5 * 3  # (warm-up + 2 rounds) x 5 counts x (one row, the count, one row)
    assert all(steps[i] == 1 and steps[i + 2] == 1 for i in range(0, len(steps), 3))
    assert [steps[i] for i in range(1, len(steps), 3)] == [5, 4, 3, 2, 1, 1, 2, 3, 4, 5, 5, 4, 3, 2, 1]
