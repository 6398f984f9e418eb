"""The notebook experience through a real kernel (jupyter_client + ipykernel), as a frontend sees it:
load progress widgets, the default handle and ``%llm use``, the mime bundles of each ``--format``,
``{In[n]}`` / ``{Err}`` in a cell prompt, and a kernel interrupt in the middle of ``%%generate``.

One kernel serves the module; each test loads what it uses. The tiny fixture model answers in
milliseconds, so the interrupted request is a long one: a context of 8192, up to 8000 tokens, and
a grammar that never lets the answer end.
"""

from __future__ import annotations

import json
import time

import pytest

from fixtures.models import write_tiny_model

WIDGET = "application/vnd.jupyter.widget-view+json"
LONG = 8192


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("kernel") / "tiny.gguf", n_ctx_train=LONG)


@pytest.fixture(scope="module")
def kernel(model_path):
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=90)
    try:
        reply, _ = execute(kc, f"%load_ext aner_nb\nMODEL = r'{model_path}'\n"
                               "from aner_nb.magics import extension_for, last_error\n"
                               "MAGICS = extension_for(get_ipython()).magics")
        assert reply["status"] == "ok", reply
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def collect(kc, msg_id, timeout=120, until=None):
    """IOPub messages of one request until the kernel is idle again (or ``until(msg)`` is true)."""
    messages = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if until is not None and until(msg):
            return messages
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages
    raise TimeoutError(f"no idle status for {msg_id} within {timeout} s")


def reply_to(kc, msg_id, timeout=120):
    while True:
        reply = kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


def execute(kc, code, timeout=120):
    msg_id = kc.execute(code)
    messages = collect(kc, msg_id, timeout)
    return reply_to(kc, msg_id, timeout), messages


def value_of(kc, expression):
    """``expression`` evaluated in the kernel, through JSON."""
    reply, messages = execute(kc, f"import json as _json; print(_json.dumps({expression}))")
    assert reply["status"] == "ok", reply
    return json.loads("".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream"))


def shown(messages):
    """The data of every display / update of one cell, in order."""
    return [m["content"]["data"] for m in messages if m["msg_type"] in ("display_data", "update_display_data")]


def answered_by(data):
    html = data.get("text/html", "")
    return html.split("answered by <code>")[1].split("</code>")[0] if "answered by <code>" in html else None


def test_load_shows_progress_widgets_and_its_phases(kernel):
    _, kc = kernel
    reply, messages = execute(kc, "%llm load {MODEL} --as base --context 512")
    assert reply["status"] == "ok", reply
    bars = [d for d in shown(messages) if WIDGET in d]
    assert [d["text/plain"].split(":")[0] for d in bars] == ["sha256 tiny.gguf", "load tiny.gguf", "sha256 tiny.gguf"]
    states = [m["content"]["data"].get("state", {}) for m in messages if m["msg_type"] == "comm_msg"]
    assert any(s.get("value") == 100 for s in states)  # the load bar reached 100%
    text = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    assert "base = <LLMModel" in text and "warm-up" in text and "verify" in text


def test_the_default_handle_and_llm_use(kernel):
    _, kc = kernel
    execute(kc, "%llm load {MODEL} --as base --context 512")
    execute(kc, "%llm pool base --as pooled --max-idle 1")
    execute(kc, "%config LLMMagics.default_to_latest = False")
    reply, _ = execute(kc, "%%generate --quiet\nhello")
    assert reply["status"] == "error" and reply["ename"] == "UsageError" and "%llm use NAME" in reply["evalue"]
    execute(kc, "%config LLMMagics.default_to_latest = True")  # the default
    reply, messages = execute(kc, "%%generate --no-stream --max-tokens 2\nhello")
    assert reply["status"] == "ok" and answered_by(shown(messages)[-1]) == "pooled"
    reply, messages = execute(kc, "%llm use base")
    assert reply["status"] == "ok" and "default handle: base" in "".join(
        m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    reply, messages = execute(kc, "%%generate --no-stream --max-tokens 2\nhello")
    assert reply["status"] == "ok" and answered_by(shown(messages)[-1]) == "base"
    assert value_of(kc, "MAGICS.default_handle") == "base"
    execute(kc, "%llm use --none")


@pytest.mark.parametrize("fmt, marker", [("markdown", "jp-RenderedMarkdown"), ("text", "<pre style"),
                                         ("code", "aner-code"), ("json", "aner-json")])
def test_each_format_is_one_widget_display_with_the_whole_text(kernel, fmt, marker):
    _, kc = kernel
    execute(kc, "%llm load {MODEL} --as base --context 512\n%config LLMMagics.stream_interval = 0")
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    flags = f"--format {fmt} --max-tokens 24" + (f" --json-schema '{schema}'" if fmt == "json" else "")
    reply, messages = execute(kc, f"%%generate base {flags} --as r\nanswer")
    assert reply["status"] == "ok", reply
    data = shown(messages)
    ids = {m["content"]["transient"]["display_id"] for m in messages
           if m["msg_type"] in ("display_data", "update_display_data")}
    assert len(ids) == 1  # one output, updated in place
    final = data[-1]
    assert WIDGET in final and marker in final["text/html"] and answered_by(final) == "base"
    text = value_of(kc, "r.text")
    assert final["text/plain"].startswith(text + "\n")  # the whole answer, not a preview
    if fmt == "markdown":
        assert all("jp-RenderedMarkdown" in d["text/html"] for d in data[1:-1])  # streamed as Markdown too


def test_in_out_and_err_fill_a_cell_prompt(kernel):
    _, kc = kernel
    execute(kc, "%llm load {MODEL} --as base --context 512")
    reply, _ = execute(kc, "21 * 2")
    n = reply["execution_count"]
    reply, _ = execute(kc, f"%%generate base --quiet --max-tokens 1 --as r\nCode: {{In[{n}]}} -> {{Out[{n}]}}")
    assert reply["status"] == "ok", reply
    assert value_of(kc, "r.usage.prompt_tokens == len(base.prompt_tokens('Code: 21 * 2 -> 42'))")
    reply, _ = execute(kc, "1 / 0")
    assert reply["ename"] == "ZeroDivisionError"
    reply, _ = execute(kc, "%%generate base --quiet --max-tokens 1 --as r\nExplain: {Err}")
    assert reply["status"] == "ok", reply
    assert value_of(kc, "'ZeroDivisionError: division by zero' in last_error()")
    assert value_of(kc, "r.usage.prompt_tokens == len(base.prompt_tokens('Explain: ' + last_error()))")


LONG_CELL = "%%generate m --raw --max-tokens 8000 --grammar never_done --as partial\ngo on"


def _interrupt_mid_stream(km, kc):
    """Run LONG_CELL with a cell queued behind it, interrupt once text streams; return both replies."""
    execute(kc, f"%llm load {{MODEL}} --as m --context {LONG}\nnever_done = 'root ::= \"a \" root'\n"
                "%config LLMMagics.stream_interval = 0")
    long_id = kc.execute(LONG_CELL)
    queued_id = kc.execute("queued_ran = True")
    collect(kc, long_id, until=lambda m: m["msg_type"] == "update_display_data")  # text is arriving
    km.interrupt_kernel()
    collect(kc, long_id)
    return reply_to(kc, long_id), reply_to(kc, queued_id)


def test_an_interrupt_cancels_keeps_the_partial_response_and_stops_queued_cells(kernel):
    km, kc = kernel
    assert value_of(kc, "MAGICS.on_interrupt") == "raise"  # a kernel's default
    long_reply, queued_reply = _interrupt_mid_stream(km, kc)
    assert long_reply["status"] == "error" and long_reply["ename"] == "KeyboardInterrupt", long_reply
    assert "partial Response is in _ and partial" in long_reply["evalue"]
    assert queued_reply["status"] == "aborted"  # Run All stops at the interrupted cell
    assert value_of(kc, "[partial.finish_reason, 0 < partial.usage.completion_tokens < 8000, _ is partial]") == [
        "cancelled", True, True]
    assert value_of(kc, "'queued_ran' in globals()") is False
    reply, _ = execute(kc, "%%generate m --raw --max-tokens 4 --quiet --as after\nhello")
    assert reply["status"] == "ok" and value_of(kc, "after.finish_reason") in ("length", "stop")


def test_on_interrupt_keep_ends_the_cell_normally(kernel):
    km, kc = kernel
    execute(kc, "%config LLMMagics.on_interrupt = 'keep'")
    try:
        long_reply, queued_reply = _interrupt_mid_stream(km, kc)
    finally:
        execute(kc, "%config LLMMagics.on_interrupt = 'raise'")
    assert long_reply["status"] == "ok" and queued_reply["status"] == "ok"
    assert value_of(kc, "[partial.finish_reason, queued_ran]") == ["cancelled", True]
