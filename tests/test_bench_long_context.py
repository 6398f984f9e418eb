"""benchmarks/bench_long_context.py: its --quick run on a fixture, and its reference model of prefix reuse."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aner_nb import llm

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_long_context as blc  # noqa: E402


@pytest.fixture(scope="module")
def quick_run(fixture_models, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("long-context") / "quick.json"
    # The Gemma template folds the system header into the first user turn, as on the demo model.
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_long_context.py"), "--quick", "--model", str(fixture_models["gemma3"]),
         "--chat-template", "gemma", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {"data": json.loads(out.read_text()), "stdout": proc.stdout, "model": fixture_models["gemma3"]}


def test_manifest_names_the_model_machine_and_threads(quick_run):
    m = quick_run["data"]["manifest"]
    assert m["model"]["fingerprint"] == hashlib.sha256(Path(quick_run["model"]).read_bytes()).hexdigest()
    assert m["model"]["n_threads"] == m["model"]["n_threads_batch"] == 1
    for key in ("system_info", "git_revision", "packages", "cpu", "load_average", "load_average_end", "settings"):
        assert key in m
    assert m["quick"] is True and m["scenarios"] == ["sweep", "headers", "retrieval"]


def test_sweep_reports_every_length_with_median_min_max(quick_run):
    sweep = quick_run["data"]["scenarios"]["sweep"]
    assert [t["target"] for t in sweep["table"]] == list(blc.QUICK.sweep_lengths) and not sweep["skipped"]
    for t in sweep["table"]:
        assert 0 < t["prompt_tokens"] <= t["target"]
        for metric in ("prefill_tok_s", "decode_tok_s"):
            s = t[metric]
            assert s["min"] <= s["median"] <= s["max"] and s["n"] == blc.QUICK.rounds
    assert all(r["threads"] == r["prefill_threads"] == 1 for r in sweep["rows"])


def test_headers_reuse_matches_the_token_lists(quick_run):
    turns = quick_run["data"]["scenarios"]["headers"]["turns"]
    assert [t["header"] for t in turns] == list(blc.QUICK.pattern)
    assert all(t["reused"] == t["expected"] for t in turns)
    by_turn = {t["turn"]: t for t in turns}
    # The two headers share only the template's opening: the first of each starts empty.
    assert by_turn[1]["reused"] == by_turn[2]["reused"] == 0
    # A primed header reuses its family's prefix up to the changed fact, not the whole prompt.
    for turn in (3, 4, 5, 6):
        assert 0 < by_turn[turn]["reused"] < by_turn[turn]["prompt_tokens"] - llm.reuse.MIN_ROWS
    # A header repeated unchanged reuses everything but its tail: its last token, or up to a row block of
    # the lease's reuse shape (llm.reuse; on a sliding-window model a block is the softmax's lanes, 8 or 16).
    with llm.load(quick_run["model"], context=512) as m, m.with_optimizer(prefix_cache_entries=1) as lease:
        block = lease.reuse_shape.row_block
    for turn in (7, 8):
        assert 1 <= by_turn[turn]["prompt_tokens"] - by_turn[turn]["reused"] <= block
    assert "reuse assertion: every turn reused exactly the expected tokens" in quick_run["stdout"]


def test_retrieval_scores_three_planted_facts(quick_run):
    (result,) = quick_run["data"]["scenarios"]["retrieval"]["results"]
    assert result["of"] == 3 and result["score"] == sum(a["correct"] for a in result["answers"])
    assert [a["expected"] for a in result["answers"]] == [code for _, code, _ in blc.FACTS]
    # The document is evaluated once: the second and third questions reuse it from the prefix cache.
    assert result["answers"][0]["cached_input_tokens"] == 0
    assert all(a["cached_input_tokens"] > 0.8 * a["prompt_tokens"] for a in result["answers"][1:])


def test_reference_model_takes_the_entry_it_reuses():
    head = [1, 2, 3]  # the template's opening
    a, b = head + list(range(10, 30)), head + list(range(40, 60))  # 23 tokens each: 20 are kept (a row block)
    reuse, kept = blc.expected_reuse(a, [], opening=3, capacity=2, cap_tokens=100)
    assert (reuse, kept) == (0, [a[:20]])
    # Only the opening matches: a new context, the first entry stays.
    reuse, kept = blc.expected_reuse(b, kept, opening=3, capacity=2, cap_tokens=100)
    assert (reuse, kept) == (0, [a[:20], b[:20]])
    # A longer match (15 tokens) reuses (and takes) that entry, to a restore point on a row block (12).
    a2 = head + list(range(10, 22)) + list(range(70, 80))  # 25 tokens
    reuse, kept = blc.expected_reuse(a2, kept, opening=3, capacity=2, cap_tokens=100)
    assert (reuse, kept) == (12, [b[:20], a2[:24]])
    # The same prompt again: everything but its tail, its last token or a few more (24 of 25).
    reuse, kept = blc.expected_reuse(a2, kept, opening=3, capacity=2, cap_tokens=4)
    assert (reuse, kept) == (24, [b[:20], a2[:4]])
    # A full pool and an opening-only match: the oldest entry is recycled.
    c = head + list(range(90, 110))
    reuse, kept = blc.expected_reuse(c, kept, opening=3, capacity=2, cap_tokens=100)
    assert (reuse, kept) == (0, [a2[:4], c[:20]])


def test_longest_fitting_finds_the_boundary():
    assert blc.longest_fitting(lambda n: 10 * n, 95) == 9
    assert blc.longest_fitting(lambda n: 10 * n, 100) == 10
    assert blc.longest_fitting(lambda n: 10 * n, 5) == 0
