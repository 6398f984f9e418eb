"""``map`` over DataFrames (``aner_nb.llm.frame_map``): columns, typed extraction, bad rows, resuming.

The oracle for every answer is the same request made alone with ``generate``
on an ordinary lease (greedy): a row of ``map`` must be exactly that request.
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pandas as pd
import pytest

from aner_nb import llm
from aner_nb.llm import _engine
from aner_nb.llm.errors import ConfigurationError, InvalidRequestError
from aner_nb.llm.faults import Fault, inject
from aner_nb.llm.frame_map import INTERRUPTED, map_frame
from aner_nb.llm import map_checkpoint, map_result
from aner_nb.llm.map_checkpoint import Checkpoint
from aner_nb.llm.map_result import RESULT_COLUMNS
from aner_nb.llm.row_prompts import check_template, fill_template, template_fields

CTX = 1024
TICKETS = pd.DataFrame(
    {"text": ["my card was charged twice", "the app crashes on start", "how do I change my email",
              "refund not received", "login page is blank", "cancel my subscription"],
     "channel": ["mail", "chat", "mail", "phone", "chat", "mail"]},
    index=pd.Index([101, 102, 103, 104, 105, 106], name="ticket"),
)
SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["billing", "bug", "account"]},
                   "urgency": {"type": "integer"}},
    "required": ["label", "urgency"],
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one engine thread for this module


@pytest.fixture(scope="module")
def base(llama_path, one_thread):
    with llm.load(llama_path, context=CTX, progress=False) as m:
        yield m


@pytest.fixture(scope="module")
def batched(base):
    with base.with_batching(3) as b:
        yield b


def alone(base, text: str, **options) -> llm.Response:
    return base.generate(text, **options)


# -- templates -------------------------------------------------------------------------------------
def test_templates_read_columns_and_leave_other_braces_alone():
    template = 'Ticket {text} via {channel}; answer as {"label": ...} or {{text}}; {text} again'
    assert template_fields(template) == ("text", "channel")
    filled = fill_template(template, {"text": "hi", "channel": float("nan")})
    assert filled == 'Ticket hi via ; answer as {"label": ...} or {text}; hi again'
    with pytest.raises(InvalidRequestError, match="txt") as err:
        check_template("Classify {txt}", ["text", "channel"])
    assert err.value.param == "prompt" and "text, channel" in str(err.value)


def test_a_missing_column_fails_before_any_row_runs(base, tmp_path):
    checkpoint = tmp_path / "run.jsonl"
    with inject(Fault("tokenize", times=10**6, error=AssertionError("a row was tokenized"))):
        with pytest.raises(InvalidRequestError, match="tex"):
            map_frame(base, TICKETS, "Classify: {tex}", max_tokens=4, checkpoint=checkpoint)
        with pytest.raises(InvalidRequestError) as err:
            map_frame(base, TICKETS, "Classify: {text}", max_tokens=4, temperature=7.0)
    assert err.value.param == "temperature" and not checkpoint.exists()


# -- answers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("lease", ["ordinary", "batching"])
def test_each_row_is_the_request_made_alone(base, batched, lease):
    model = base if lease == "ordinary" else batched
    out = map_frame(model, TICKETS, "Classify: {text} ({channel})", max_tokens=12, progress=False)
    assert list(out.columns) == list(RESULT_COLUMNS) and out.index.equals(TICKETS.index)
    assert str(out["prompt_tokens"].dtype) == "Int64" and str(out["total_ms"].dtype) == "Float64"
    for ticket, row in TICKETS.iterrows():
        expected = alone(base, f"Classify: {row.text} ({row.channel})", max_tokens=12)
        got = out.loc[ticket]
        assert got.answer == expected.text and got.finish_reason == expected.finish_reason
        assert got.prompt_tokens == expected.usage.prompt_tokens and got.error == ""
        assert got.completion_tokens == expected.usage.completion_tokens and got.total_ms > 0
    stats = out.attrs["aner_nb.map"]
    assert (stats.rows, stats.generated, stats.failed, stats.interrupted) == (6, 6, 0, False)


def test_a_series_is_read_as_its_name_or_text(base):
    series = TICKETS["text"].rename(None)
    out = map_frame(base, series, "Summarise: {text}", max_tokens=6)
    assert out.loc[104, "answer"] == alone(base, "Summarise: refund not received", max_tokens=6).text
    named = map_frame(base, TICKETS["channel"], "Channel {channel}", max_tokens=3, system="Be brief.")
    expected = base.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Channel chat"}],
                         max_tokens=3)
    assert named.loc[102, "answer"] == expected.text


def test_schema_extraction_gives_typed_columns_that_validate(batched):
    out = map_frame(batched, TICKETS, "Classify: {text}", json_schema=SCHEMA, expand=True, max_tokens=64)
    assert (out["finish_reason"] == "stop").all(), out[["answer", "finish_reason"]]
    for answer in out["answer"]:
        jsonschema.validate(json.loads(answer), SCHEMA)
    assert isinstance(out["label"].dtype, pd.CategoricalDtype)
    assert list(out["label"].cat.categories) == ["billing", "bug", "account"]
    assert str(out["urgency"].dtype) == "Int64"
    assert [int(v) for v in out["urgency"]] == [json.loads(a)["urgency"] for a in out["answer"]]
    with pytest.raises(InvalidRequestError, match="json_schema"):
        map_frame(batched, TICKETS, "x {text}", expand=True)
    bounded = {**SCHEMA, "properties": {**SCHEMA["properties"], "urgency": {"type": "integer", "maximum": 5}}}
    with pytest.raises(InvalidRequestError, match="cannot enforce") as err:  # the call fails, not every row
        map_frame(batched, TICKETS, "Classify: {text}", json_schema=bounded, max_tokens=8)
    assert err.value.param == "json_schema"


@pytest.mark.parametrize("lease", ["ordinary", "batching"])
def test_a_bad_row_is_reported_and_the_others_complete(base, batched, lease):
    model = base if lease == "ordinary" else batched
    frame = TICKETS.copy()
    frame.loc[102, "text"] = "word " * 2000  # far more tokens than the context holds
    frame.loc[105, "text"] = "POISON login page is blank"  # its tokenization fails in the engine
    with inject(Fault("tokenize", times=10**6, when=lambda model, text: "POISON" in text)):
        out = map_frame(model, frame, "Classify: {text}", max_tokens=8)
    assert "ContextOverflowError" in out.loc[102, "error"] and "EngineError" in out.loc[105, "error"]
    assert pd.isna(out.loc[102, "answer"]) and pd.isna(out.loc[105, "prompt_tokens"])
    fine = [101, 103, 104, 106]
    assert (out.loc[fine, "error"] == "").all()
    for ticket in fine:
        assert out.loc[ticket, "answer"] == alone(base, f"Classify: {frame.loc[ticket, 'text']}", max_tokens=8).text
    assert out.attrs["aner_nb.map"].failed == 2


# -- checkpoints -------------------------------------------------------------------------------------
def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_changed_prompt_or_setting_reruns_only_the_rows_it_changes(base, tmp_path):
    checkpoint = tmp_path / "tickets.jsonl"
    first = map_frame(base, TICKETS, "Classify: {text}", max_tokens=6, checkpoint=checkpoint)
    assert first.attrs["aner_nb.map"].generated == 6 and len(lines(checkpoint)) == 6
    again = map_frame(base, TICKETS, "Classify: {text}", max_tokens=6, checkpoint=checkpoint)
    assert again.attrs["aner_nb.map"].generated == 0 and again.attrs["aner_nb.map"].from_checkpoint == 6
    pd.testing.assert_frame_equal(again, first)
    edited = TICKETS.copy()
    edited.loc[103, "text"] = "how do I change my password"
    third = map_frame(base, edited, "Classify: {text}", max_tokens=6, checkpoint=checkpoint)
    assert third.attrs["aner_nb.map"].generated == 1
    assert third.loc[103, "answer"] == alone(base, "Classify: how do I change my password", max_tokens=6).text
    other = map_frame(base, TICKETS, "Classify: {text}", max_tokens=5, checkpoint=checkpoint)
    assert other.attrs["aner_nb.map"].generated == 6  # another setting: every row's key changed


def test_bad_checkpoint_lines_are_skipped_never_trusted(base, tmp_path):
    checkpoint = tmp_path / "tickets.jsonl"
    first = map_frame(base, TICKETS, "Classify: {text}", max_tokens=4, checkpoint=checkpoint)
    good = checkpoint.read_text().splitlines()
    forged = json.loads(good[0])
    forged["result"]["prompt_tokens"] = "many"  # a mistyped value: the row runs again
    tampered = [json.dumps(forged), "not json", '{"format": 2}', json.dumps([1, 2]), *good[1:], good[0][:40]]
    checkpoint.write_text("\n".join(tampered))  # the last line is torn (no newline)
    again = map_frame(base, TICKETS, "Classify: {text}", max_tokens=4, checkpoint=checkpoint)
    stats = again.attrs["aner_nb.map"]
    assert stats.generated == 1 and stats.from_checkpoint == 5 and stats.checkpoint_lines_skipped == 4
    pd.testing.assert_frame_equal(again.drop(columns=["first_token_ms", "total_ms"]),
                                  first.drop(columns=["first_token_ms", "total_ms"]))
    last = checkpoint.read_text().splitlines()[-1]
    assert json.loads(last)["row"] == forged["row"]  # the re-run row's line is whole, after the torn one
    with pytest.raises(ConfigurationError, match="jsonl"):
        Checkpoint(tmp_path / "run.csv")


def test_checkpoint_values_out_of_range_and_overlong_lines_are_skipped(base, tmp_path, monkeypatch):
    """A count that no Int64 column holds, a negative count, a NaN duration and a line over the cap each re-run
    their row; the lines after an over-long one are still read (it is skipped in pieces, never held whole)."""
    monkeypatch.setattr(map_checkpoint, "MAX_LINE_BYTES", 2048)
    checkpoint = tmp_path / "tickets.jsonl"
    first = map_frame(base, TICKETS, "Classify: {text}", max_tokens=4, checkpoint=checkpoint)
    good = [json.loads(line) for line in checkpoint.read_text().splitlines()]
    forged = [json.loads(json.dumps(e)) for e in good[:4]]
    forged[0]["result"]["prompt_tokens"] = 2**70
    forged[1]["result"]["completion_tokens"] = -1
    forged[2]["result"]["first_token_ms"] = float("nan")
    forged[3]["result"]["answer"] += " " * 10_000
    checkpoint.write_text("".join(json.dumps(e) + "\n" for e in [*forged, *good[4:]]))
    again = map_frame(base, TICKETS, "Classify: {text}", max_tokens=4, checkpoint=checkpoint)
    stats = again.attrs["aner_nb.map"]
    assert (stats.generated, stats.from_checkpoint, stats.checkpoint_lines_skipped) == (4, 2, 1)  # 1: the long line
    pd.testing.assert_frame_equal(again.drop(columns=["first_token_ms", "total_ms"]),
                                  first.drop(columns=["first_token_ms", "total_ms"]))


def test_an_answer_nested_past_the_parser_expands_to_nothing():
    assert map_result._parsed('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}") is None


CHILD = r"""
import sys, pandas as pd
from aner_nb import llm
from aner_nb.llm.frame_map import map_frame
frame = pd.DataFrame({"text": [f"row number {i}" for i in range(%(rows)d)]})
model = llm.load(sys.argv[1], context=1024, progress=False, warmup=False)
out = map_frame(model, frame, "Repeat: {text}", max_tokens=%(max_tokens)d, checkpoint=sys.argv[2],
                grammar='root ::= "a " root')
stats = out.attrs["aner_nb.map"]
print("STATS", stats.generated, stats.from_checkpoint, stats.interrupted, flush=True)
out.to_json(sys.argv[3])
"""


def test_a_killed_run_resumes_in_a_fresh_process_without_generating_a_row_twice(llama_path, tmp_path):
    rows, max_tokens = 8, 300
    script = tmp_path / "child.py"
    script.write_text(CHILD % {"rows": rows, "max_tokens": max_tokens})
    checkpoint, out = tmp_path / "run.jsonl", tmp_path / "out.json"
    env = {**os.environ, _engine.THREADS_ENV: "1"}
    child = subprocess.Popen([sys.executable, str(script), str(llama_path), str(checkpoint), str(out)], env=env,
                             stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not (checkpoint.exists() and len(checkpoint.read_text().splitlines()) >= 2):
        assert child.poll() is None and time.monotonic() < deadline, "the child ended before two rows finished"
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)  # a kernel restart: no cleanup, maybe half a line written
    child.wait()
    finished = len([line for line in checkpoint.read_text().splitlines() if line.endswith("}")])
    assert 2 <= finished < rows, "the run was not cut short: nothing to resume"
    resumed = subprocess.run([sys.executable, str(script), str(llama_path), str(checkpoint), str(out)], env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    generated, from_checkpoint, interrupted = resumed.stdout.split("STATS ")[1].split()
    assert (int(generated), int(from_checkpoint), interrupted) == (rows - finished, finished, "False")
    entries = lines(checkpoint) if checkpoint.read_text().endswith("\n") else []
    keys = [(e["row"], e["key"]) for e in entries if isinstance(e, dict) and "row" in e]
    assert len(keys) == len(set(keys)) == rows  # every row once: none generated twice
    frame = pd.read_json(out)
    assert (frame["completion_tokens"] == max_tokens).all() and (frame["error"].fillna("") == "").all()
    assert all(set(answer.replace(" ", "")) == {"a"} for answer in frame["answer"])  # the grammar's text, whole


@pytest.mark.parametrize("kind", ["batched", "base"])
def test_ctrl_c_stops_admission_and_returns_what_finished(kind, request, tmp_path):
    """Whenever Ctrl-C lands, every row counted as generated has its checkpoint line, and no other row does."""
    lease = request.getfixturevalue(kind)
    checkpoint = tmp_path / "run.jsonl"
    frame = pd.DataFrame({"text": [f"row {i}" for i in range(12)]})
    options = dict(max_tokens=300, grammar='root ::= "a " root', checkpoint=checkpoint)  # 341 cells per sequence
    mapped = threading.Event()

    def interrupt_after_two() -> None:
        while not (checkpoint.exists() and len(checkpoint.read_text().splitlines()) >= 2):
            if mapped.wait(0.005):
                return  # map returned first: no interrupt may land in a later test
        _thread.interrupt_main()

    threading.Thread(target=interrupt_after_two, daemon=True).start()
    try:
        out = map_frame(lease, frame, "Go on: {text}", **options)
    finally:
        mapped.set()
    stats = out.attrs["aner_nb.map"]
    assert stats.interrupted and 2 <= stats.generated < 12, out["error"].unique()
    done = out[out["error"] == ""]
    assert len(done) == stats.generated == len(lines(checkpoint))
    assert (done["completion_tokens"] == 300).all()
    assert (out.loc[out["error"] != "", "error"] == INTERRUPTED).all()
    if kind == "batched":
        assert (lease.stats().active, lease.stats().waiting) == (0, 0)  # in-flight rows were cancelled and ended
    resumed = map_frame(lease, frame, "Go on: {text}", **options)
    assert resumed.attrs["aner_nb.map"].generated == 12 - stats.generated and (resumed["error"] == "").all()


# -- the magic form ------------------------------------------------------------------------------------
def test_generate_over_a_frame_writes_the_answers_into_a_column(ip, llama_path, base):
    from IPython.core.error import UsageError
    from test_magics import run

    run(ip, f"%llm load {llama_path} --as m --context {CTX}")
    ip.user_ns["tickets"] = TICKETS.copy()
    run(ip, "%%generate m --over tickets --into label --max-tokens 6 --as result\nClassify: {text} ({channel})")
    frame, result = ip.user_ns["tickets"], ip.user_ns["result"]
    expected = map_frame(base, TICKETS, "Classify: {text} ({channel})", max_tokens=6)
    assert list(frame["label"]) == list(expected["answer"]) and (result["error"] == "").all()
    assert ip.user_ns["_"] is result
    with pytest.raises(UsageError, match="tickets_x is nothing"):
        run(ip, "%%generate m --over tickets_x\nClassify: {text}")
    with pytest.raises(UsageError, match="missing|does not have"):
        run(ip, "%%generate m --over tickets\nClassify: {subject}")
