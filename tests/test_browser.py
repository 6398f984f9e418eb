"""The notebook experience in a real browser: JupyterLab on loopback, driven by Debian's Chromium.

JupyterLab (from pip) serves a temporary copy of the tutorials with a token;
Playwright drives the system Chromium (``/usr/bin/chromium``, installed by
``.ci/run`` with apt; nothing downloads a browser; skipped where it is not
installed, like the nginx test). The tests assert what only
a browser shows: widget views rendered by the widget manager (not their static
HTML fallbacks), the streamed answer as one Markdown output, the load progress
bar at 100%, and that JupyterLab's interrupt stops a running ``%%generate``
and the queued cells after it. Screenshots go to ``test-artifacts/browser/``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("ANER_NB_TEST_ARTIFACTS", REPO / "test-artifacts")) / "browser"
CHROMIUM = os.environ.get("ANER_NB_CHROMIUM", "/usr/bin/chromium")
# Chromium as root in a sandboxed machine with no network: no sandbox, no GPU, no background traffic.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
RUN_TIMEOUT_S = 420
# A system package, like nginx for the replicas test: .ci/run installs it, so CI always runs these.
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (apt-get install -y chromium; .ci/run does)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on loopback serving a scratch folder; yields ``(base_url, token, root)``."""
    root = tmp_path_factory.mktemp("lab")
    settings = root / ".settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    # No news or update checks: this machine has no network and the pop-up would cover the page.
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(root / ".settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(root / ".workspaces"), PYTHONPATH=str(REPO / "tests"))
    log_path = tmp_path_factory.mktemp("lab-log") / "lab.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.news_url=None"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start: {log_path.read_text()[-2000:]}")
                time.sleep(0.5)
        yield base, token, root
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def open_notebook(browser, lab, name):
    base, token, _ = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    # A workspace of its own, reset: JupyterLab would otherwise restore the tabs another test opened.
    workspace = Path(name).stem.replace("_", "-")
    page.goto(f"{base}/lab/workspaces/{workspace}/tree/{name}?reset&token={token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
    wait_idle(page)
    return page


def wait_idle(page, timeout_s: float = 120) -> None:
    """Until the notebook's kernel reports Idle in the status bar."""
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-StatusBar-TextItem')].some(e => /\\|\\s*Idle/.test(e.textContent))",
        timeout=timeout_s * 1000,
    )


def command(page, label: str) -> None:
    """Run a JupyterLab command by its label through the command palette."""
    page.keyboard.press("Control+Shift+C")
    page.wait_for_selector(".lm-CommandPalette-input", state="visible")
    page.fill(".lm-CommandPalette-input", label)
    page.wait_for_selector(f".lm-CommandPalette-item.lm-mod-active:has-text('{label}')", timeout=10_000)
    page.keyboard.press("Enter")


def prompts(page) -> list[str]:
    return page.eval_on_selector_all(".jp-CodeCell .jp-InputArea-prompt", "els => els.map(e => e.textContent.trim())")


def wait_all_run(page, timeout_s: float = RUN_TIMEOUT_S) -> None:
    page.wait_for_function(
        "() => { const p = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(e => e.textContent);"
        " return p.length > 0 && p.every(t => /\\[\\d+\\]/.test(t)); }",
        timeout=timeout_s * 1000,
    )
    wait_idle(page)


def cell(page, source_fragment: str):
    """The code cell whose source contains ``source_fragment`` (exactly one)."""
    cells = page.locator(".jp-CodeCell").filter(has=page.locator(".jp-InputArea-editor", has_text=source_fragment))
    assert cells.count() == 1, f"expected one cell with {source_fragment!r}, found {cells.count()}"
    return cells.first


def outputs(cell_locator):
    return cell_locator.locator(".jp-OutputArea-output")


def shot(target, name: str) -> Path:
    """A screenshot of the page, or of one cell (scrolled into view and rendered first)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    if hasattr(target, "locator") and not hasattr(target, "goto"):  # a cell
        target.scroll_into_view_if_needed()
        target.page.wait_for_timeout(300)  # offscreen cells are laid out lazily (content-visibility)
        target.screenshot(path=str(path))
    else:
        target.screenshot(path=str(path), full_page=False)
    return path


def test_quickstart_runs_in_jupyterlab_with_live_widgets(lab, browser):
    shutil.copy(REPO / "notebooks" / "01_quickstart.ipynb", lab[2] / "01_quickstart.ipynb")
    page = open_notebook(browser, lab, "01_quickstart.ipynb")
    try:
        command(page, "Run All Cells")
        wait_all_run(page)
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        assert "Traceback" not in " ".join(errors.all_inner_texts())

        load = cell(page, "%llm load {MODEL}")
        bar = load.locator(".widget-hprogress, .widget-progress")  # ipywidgets 8 / 7 class names
        assert bar.count() >= 1, "the load shows no progress bar widget"
        assert "100%" in load.text_content()

        answer = cell(page, "%%generate base --max-tokens 32")
        assert outputs(answer).count() == 1, "the streamed answer must be one output area"
        assert answer.locator(".jp-RenderedMarkdown").count() >= 1, "the answer is not rendered as Markdown"
        shot(answer, "quickstart-generate")

        for fragment in ("timings_panel(answer)", "kv_budget(model)"):
            view = cell(page, fragment)
            out = outputs(view)
            assert out.count() == 1
            # The widget manager rendered the view: widget DOM, not the text/html fallback.
            assert view.locator(".jupyter-widgets").count() >= 1, f"{fragment}: no widget view"
            assert view.locator(".jp-RenderedHTML").count() == 0, f"{fragment}: the static fallback was shown"
            shot(view, "quickstart-" + fragment.split("(")[0])
    finally:
        shot(page, "quickstart-end")
        page.close()


INTERRUPT_NOTEBOOK = {
    "cells": [
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": [
            "%load_ext aner_nb\n",
            "from fixtures.models import write_tiny_model\n",
            "path = write_tiny_model('tiny.gguf', n_ctx_train=8192)\n",
            "%llm load {path} --as m --context 8192",
        ]},
        # A grammar that never accepts keeps the answer going to max_tokens: the stream is long.
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": [
            "never_done = 'root ::= \"a \" root'\n",
        ]},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": [
            "%%generate m --raw --max-tokens 8000 --grammar never_done --as partial\n",
            "go on",
        ]},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": [
            "print('queued cell ran')",
        ]},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": [
            "%%generate m --raw --max-tokens 4 --as after\n",
            "hello",
        ]},
    ],
    "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}},
    "nbformat": 4,
    "nbformat_minor": 5,
}


def test_interrupt_stops_a_streaming_generate_and_the_queued_cells(lab, browser):
    (lab[2] / "interrupt.ipynb").write_text(json.dumps(INTERRUPT_NOTEBOOK))
    page = open_notebook(browser, lab, "interrupt.ipynb")
    try:
        command(page, "Run All Cells")
        stream = cell(page, "--grammar never_done")
        page.wait_for_function(  # mid-stream: text is arriving
            "el => el.textContent.includes('a a a')", arg=stream.element_handle(), timeout=120_000,
        )
        command(page, "Interrupt Kernel")
        wait_idle(page)
        time.sleep(1)
        assert "KeyboardInterrupt" in stream.text_content()
        queued = cell(page, "queued cell ran")
        assert "queued cell ran" not in " ".join(outputs(queued).all_inner_texts())
        assert not any(c.isdigit() for c in queued.locator(".jp-InputArea-prompt").text_content())
        shot(stream, "interrupt")

        after = cell(page, "--as after")
        after.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        page.wait_for_function(
            "el => /\\[\\d+\\]/.test(el.querySelector('.jp-InputArea-prompt').textContent)",
            arg=after.element_handle(), timeout=60_000,
        )
        wait_idle(page)
        assert "Traceback" not in after.text_content() and outputs(after).count() >= 1
    finally:
        shot(page, "interrupt-end")
        page.close()


# The second box's answer must still be running when the Stop click lands: the tiny model decodes
# thousands of tokens a second, so an 8,000-token answer could end first on a loaded machine (seen in
# CI). 65,000 tokens at a 65,536-cell context (16 MB of KV on this model) run for a minute or more.
CHAT_NOTEBOOK = {
    "cells": [
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": [
            "from aner_nb import llm\n",
            "from aner_nb.widgets import chat_box\n",
            "from fixtures.models import write_tiny_model\n",
            "m = llm.load(write_tiny_model('tiny-chat.gguf', n_ctx_train=65536), context=65536)\n",
            "never_done = 'root ::= \"a \" root'",
        ]},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": [
            "chat_box(m, system='Be brief.', max_tokens=6)  # short answers",
        ]},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": [
            "chat_box(m, max_tokens=65000, grammar=never_done)  # an answer that runs until stopped",
        ]},
    ],
    "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}},
    "nbformat": 4,
    "nbformat_minor": 5,
}


def _chat_turn(page, box, text: str) -> None:
    box.locator(".widget-textarea textarea").fill(text)
    box.locator(".widget-button", has_text="Send").click()


def test_the_chat_box_streams_stops_and_is_saved_as_a_transcript(lab, browser):
    (lab[2] / "chat.ipynb").write_text(json.dumps(CHAT_NOTEBOOK))
    page = open_notebook(browser, lab, "chat.ipynb")
    try:
        command(page, "Run All Cells")
        wait_all_run(page)
        short = cell(page, "# short answers")
        box = outputs(short).locator(".jupyter-widgets").first
        box.wait_for(timeout=60_000)
        _chat_turn(page, box, "Hello from the browser")
        page.wait_for_function(  # the turn ended: the transcript shows it with its timings line
            "el => el.textContent.includes('Hello from the browser') && el.textContent.includes('tok/s')",
            arg=short.element_handle(), timeout=120_000,
        )
        shot(short, "chat-turn")

        long = cell(page, "# an answer that runs until stopped")
        long_box = outputs(long).locator(".jupyter-widgets").first
        _chat_turn(page, long_box, "Go on forever")
        page.wait_for_function(  # mid-stream: text is arriving while the kernel handles the widgets
            "el => el.textContent.includes('a a a') && el.textContent.includes('answering')",
            arg=long.element_handle(), timeout=120_000,
        )
        # Stop is idempotent; a click that lands while the box re-renders its streaming transcript can
        # be lost (seen once in CI: no "stopped" within 60 s), so it is clicked again until the box says so.
        for attempt in range(4):
            long_box.locator(".widget-button", has_text="Stop").click()
            try:
                page.wait_for_function(
                    "el => el.textContent.includes('stopped (not kept in the history)')",
                    arg=long.element_handle(), timeout=45_000,
                )
                break
            except Exception as exc:  # playwright's TimeoutError; its module is imported lazily here
                if type(exc).__name__ != "TimeoutError":
                    raise
                if attempt == 3:
                    raise
        shot(long, "chat-stopped")

        command(page, "Save Notebook")
        time.sleep(2)
        saved = json.loads((lab[2] / "chat.ipynb").read_text())
        static = ["".join(o.get("data", {}).get("text/html", "")) for c in saved["cells"] for o in c.get("outputs", [])]
        assert any("Hello from the browser" in h and "tok/s" in h for h in static), "no saved transcript"
        assert any("stopped (not kept in the history)" in h for h in static)
    finally:
        shot(page, "chat-end")
        page.close()
