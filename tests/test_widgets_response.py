"""How a ``%%generate`` answer ends (the text, then the timings dashboard), and displays driven by
the metadata of the ``Timings`` fields instead of hand-written column lists."""

from __future__ import annotations

import dataclasses
import io
import re

import pandas as pd
import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from traitlets.config import Config

from aner_nb import llm
from aner_nb.magics import display as display_mod
from aner_nb.widgets import ResponsePanel, response_panel, segments_ns, timings_panel
from aner_nb.widgets.timings import SEGMENTS, SUMMARY_PARTS, summary_fields, timings_line

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def shell():
    """display() publishes to an IPython shell (capture_output records what it publishes)."""
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    return InteractiveShell.instance(config=config)


@pytest.fixture(scope="module")
def response(llama_path):
    with llm.load(llama_path, context=256) as model:
        yield model.generate("the cat and the dog", max_tokens=6)


def test_summary_columns_are_the_timings_metadata(response):
    counts, times = summary_fields()
    for f in counts + times:
        assert f.metadata["part"] in SUMMARY_PARTS
    assert {f.metadata["unit"] for f in counts} == {"tokens", "count"} and {f.metadata["unit"] for f in times} == {"ns"}
    expected = [f.metadata["label"] for f in counts] + [f"{f.metadata['label']} ms" for f in times]
    assert [f.name for f in llm.timing_fields(part="run", unit="ns")] == [
        f.name for f in times if f.metadata["part"] == "run"
    ]
    frame = timings_panel(response).summary_frame()
    assert list(frame.columns) == ["finish", *expected, "tokens/s"]
    assert frame.iloc[0]["prompt tokens"] == response.timings.prompt_tokens
    labels = {f.name: f.metadata["label"] for f in llm.timing_fields(unit="ns")}
    assert [name for name, _ in SEGMENTS] == [
        labels[n] for n in ("queue_duration", "context_clear_duration", "prompt_eval_duration",
                            "first_token_duration", "decode_duration")
    ] + ["other"]
    assert list(segments_ns(response)) == [name for name, _ in SEGMENTS]


def test_timings_line_lists_what_was_measured(response):
    line = timings_line(response)
    t = response.timings
    assert line.startswith(f"[{response.finish_reason}] {response.usage.completion_tokens} tokens; ")
    assert f"prompt tokens {t.prompt_tokens}" in line and f"generated tokens {t.generated_tokens}" in line
    assert f"prefill {t.prompt_eval_duration / 1e6:.1f} ms" in line and "tok/s" in line
    assert "queue" not in line  # an ordinary lease does not queue: -1 is left out, never shown as 0
    unmeasured = dataclasses.replace(response, timings=t.replace(decode_duration=-1))
    assert "tok/s" not in timings_line(unmeasured) and not re.search(r", decode \d", timings_line(unmeasured))


def test_response_panel_is_the_text_then_the_timings_dashboard(response):
    panel = response_panel(response)
    assert isinstance(panel, ResponsePanel) and panel.response is response
    page = panel._repr_html_()
    assert page.startswith("<div class='aner-response'><pre")
    assert page.index("<pre") < page.index("aner-timings")  # the text first, the dashboard below it
    assert panel.timings._repr_html_() in page  # the same static fallback as timings_panel(response)
    data = panel._repr_mimebundle_()
    assert WIDGET_MIME in data and data["text/html"] == page
    assert data["text/plain"] == f"{response.text}\n{timings_line(response)}"
    text_box, dashboard = panel.widget.children
    assert dashboard is panel.timings.widget and "<pre" in text_box.value
    assert panel.to_frame().equals(timings_panel(response).to_frame())


def test_a_generate_display_ends_with_the_dashboard(shell, response):
    with capture_output() as cap:
        display_mod.FinalView().finish(response)
        view = display_mod.UpdatingView(3600)
        view.start()
        view.add(response.text)
        view.finish(response)
    final, created, replaced = cap.outputs
    for shown in (final, replaced):
        assert WIDGET_MIME in shown.data and "aner-timings" in shown.data["text/html"]
        assert "aner-response" in shown.data["text/html"]
    assert not created.update and replaced.update
    assert created.transient["display_id"] == replaced.transient["display_id"]

    out = io.StringIO()
    printed = display_mod.PrintView(stream=False, out=out)
    printed.finish(response)
    assert out.getvalue() == f"{response.text}\n{timings_line(response)}\n"


def test_a_display_without_a_response_stays_plain(shell, response):
    with capture_output() as cap:
        display_mod.FinalView().finish(None, cancelled=True)
    assert "cancelled" in cap.outputs[0].data["text/html"] and WIDGET_MIME not in cap.outputs[0].data
    cancelled = dataclasses.replace(response, finish_reason="cancelled")
    assert pd.Series(response_panel(cancelled).timings.summary_frame()["finish"]).tolist() == ["cancelled"]
