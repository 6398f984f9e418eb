"""The main job's plumbing (``python -m aner_nb report``) and the health of the saved tutorials.

The tutorials themselves run under ``pytest --nbval`` (see notebooks/conftest.py);
these tests need no model: they check the command line, the HTML export and
that every saved notebook is a complete, error-free run whose checked outputs
outnumber the ignored ones.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from aner_nb import report
from aner_nb.__main__ import COMMANDS, main

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
TUTORIALS = [
    "01_quickstart.ipynb",
    "02_prefix_cache.ipynb",
    "03_prompt_lookup.ipynb",
    "04_continuous_batching.ipynb",
    "05_kv_budget.ipynb",
    "06_measurement.ipynb",
    "07_chat_and_serving.ipynb",
    "08_dataframes.ipynb",
    "09_tools_logprobs_embeddings.ipynb",
]
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def test_cli_offers_report_and_keeps_demo(capsys):
    assert COMMANDS[0] == "report" and "demo" in COMMANDS
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "report" in err and "demo" in err
    assert main(["--help"]) == 0


def test_find_notebook_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert report.find_notebook() == NOTEBOOKS / "01_quickstart.ipynb"
    assert report.find_notebook("05_kv_budget.ipynb") == NOTEBOOKS / "05_kv_budget.ipynb"
    with pytest.raises(FileNotFoundError, match="--notebook"):
        report.find_notebook("no_such_notebook.ipynb")


def _ignored(cell) -> bool:
    comments = [line.strip().lstrip("#").strip() for line in cell.source.splitlines() if line.strip().startswith("#")]
    return "NBVAL_IGNORE_OUTPUT" in comments or "nbval-ignore-output" in cell.metadata.get("tags", [])


@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_is_saved_as_a_complete_run(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{name} has no code"
    counts = [c.execution_count for c in code]
    assert None not in counts, f"{name}: re-execute it in place so every cell has its saved output"
    assert counts == sorted(counts), f"{name}: cells were saved out of order; re-run it top to bottom"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{name}: saved with an error output"
    checked = sum(1 for c in code if not _ignored(c) and c.outputs)
    ignored = sum(1 for c in code if _ignored(c))
    assert checked > ignored, f"{name}: {checked} checked outputs vs {ignored} ignored"


def test_tutorials_are_all_present():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == TUTORIALS


def test_html_keeps_widget_state_and_each_static_view():
    nb = new_notebook()
    cell = new_code_cell("panel", execution_count=1)
    cell.outputs = [
        new_output(
            "display_data",
            data={
                WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": "m1"},
                "text/html": "<b>static view</b>",
                "text/plain": "<Panel>",
            },
        )
    ]
    nb.cells = [cell]
    model = {"model_name": "HTMLModel", "model_module": "@jupyter-widgets/controls", "model_module_version": "2.0.0",
             "state": {"value": "live view"}}
    nb.metadata["widgets"] = {WIDGET_STATE: {"version_major": 2, "version_minor": 0, "state": {"m1": model}}}
    html = report.export_html(nb)
    assert f'<script type="{WIDGET_STATE}">' in html
    assert f'<script type="{WIDGET_VIEW}">' in html
    assert "aner-static-fallback" in html and "<b>static view</b>" in html


def test_report_runs_the_notebook_in_this_python(tmp_path):
    source = tmp_path / "tiny.ipynb"
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "no-such-kernelspec", "display_name": "x", "language": "python"}
    nb.cells = [new_code_cell("import sys\nprint(sys.executable)"), new_code_cell("import ipywidgets\nipywidgets.IntSlider(3)")]
    nbformat.write(nb, source)
    out = io.StringIO()
    html = report.run_report(str(source), str(tmp_path / "reports"), timeout=120, out=out)
    assert html == (tmp_path / "reports" / "tiny.html").resolve() and html.is_file()
    assert f"report  : {html}" in out.getvalue()
    executed = nbformat.read(tmp_path / "reports" / "tiny.ipynb", as_version=4)
    assert executed.cells[0].outputs[0].text.strip() == sys.executable
    state = executed.metadata["widgets"][WIDGET_STATE]["state"]
    assert any(m["model_name"] == "IntSliderModel" for m in state.values())
    assert "IntSliderModel" in html.read_text(encoding="utf-8")


def test_report_fails_fast_naming_the_cell_and_signal_when_the_kernel_dies(tmp_path, capsys):
    """A kernel killed by a signal (SIGILL, as on a CPU that faults on AMX) ends the report at once."""
    source = tmp_path / "dies.ipynb"
    nb = new_notebook()
    nb.cells = [
        new_code_cell("x = 1"),
        new_code_cell("import os, signal\nos.kill(os.getpid(), signal.SIGILL)"),
        new_code_cell("print('never runs')"),
    ]
    nbformat.write(nb, source)
    # The cell timeout (3600 s) is beyond this test's own timeout (pytest-timeout, 900 s): the report
    # can only end in time through the kernel liveness check, never by waiting the cell out.
    with pytest.raises(report.KernelDiedError) as info:
        report.run_report(str(source), str(tmp_path / "reports"), timeout=3600, out=io.StringIO())
    message = str(info.value)
    assert "SIGILL" in message and "cell 2" in message and "import os, signal" in message
    assert main(["report", "--notebook", str(source), "--output-dir", str(tmp_path / "r2")]) == 1
    assert "SIGILL" in capsys.readouterr().err


# nbval matches a whole comment line against these names (nbval/plugin.py, comment_markers).
NBVAL_MARKERS = {"NBVAL_IGNORE_OUTPUT", "NBVAL_CHECK_OUTPUT", "NBVAL_RAISES_EXCEPTION", "NBVAL_SKIP"}


@pytest.mark.parametrize("name", TUTORIALS)
def test_every_nbval_marker_is_one_nbval_recognises(name):
    """`# NBVAL_IGNORE_OUTPUT: reason` is silently not a marker: the output would be compared."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for line in cell.source.splitlines():
            stripped = line.strip()
            if stripped.startswith("#") and "NBVAL" in stripped.upper():
                comment = stripped.lstrip("#").strip()
                assert comment in NBVAL_MARKERS, f"{name} cell {i}: {stripped!r} is not a marker nbval recognises"
        assert "NBVAL_SKIP" not in cell.source, f"{name} cell {i}: skipped cells test nothing"
