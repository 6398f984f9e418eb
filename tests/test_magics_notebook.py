"""The notebook experience on an in-process IPython shell: the default handle, %llm use, answer
formats, {In[n]} / {Out[n]} / {Err} in prompts, the Ctrl-C policy, flag completion and the
load line's phases. ``tests/test_notebook_kernel.py`` checks the same through a real kernel.
"""

from __future__ import annotations

import re

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from aner_nb import magics as magics_pkg
from aner_nb.llm import _engine
from aner_nb.magics import interpolate, last_error
from aner_nb.magics.prompt import PromptError
from aner_nb.widgets import ANSWER_FORMATS, answer_html
from test_magics import run

CTX = 256


def magics(ip):
    return magics_pkg.extension_for(ip).magics


def answered_by(output) -> str | None:
    found = re.search(r"answered by <code>(\w+)</code>", output.data.get("text/html", ""))
    return found.group(1) if found else None


# -- the default handle ----------------------------------------------------------------------------
def test_without_a_name_the_configured_or_latest_handle_answers_and_says_so(ip, llama_path):
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    run(ip, "%llm optimize base --as fast --prefix-cache-entries 1")
    run(ip, "%config LLMMagics.default_to_latest = False")  # the explicit policy: a NAME is required
    with pytest.raises(UsageError, match=r"required: NAME \(or choose a default handle with %llm use NAME\)"):
        ip.run_cell_magic("generate", "--quiet", "hello")
    run(ip, "%config LLMMagics.default_to_latest = True")  # the default
    with capture_output() as cap:
        run(ip, "%%generate --no-stream --max-tokens 2\nhello")
    assert answered_by(cap.outputs[-1]) == "fast"  # the most recently derived handle
    assert cap.outputs[-1].data["text/plain"].endswith("; answered by fast")
    run(ip, "%config LLMMagics.default_handle = 'base'")  # a configured default wins over the latest
    with capture_output() as cap:
        run(ip, "%%generate --no-stream --max-tokens 2\nhello")
    assert answered_by(cap.outputs[-1]) == "base"
    with capture_output() as cap:
        run(ip, "%%generate fast --no-stream --max-tokens 2\nhello")  # a name still wins
    assert answered_by(cap.outputs[-1]) == "fast"


def test_llm_use_sets_the_default_for_cells_info_kv_and_bench(ip, llama_path, capsys):
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    run(ip, "%llm optimize base --as fast --prefix-cache-entries 1")
    capsys.readouterr()
    run(ip, "%llm use")
    assert "no default handle" in capsys.readouterr().out
    run(ip, "%llm use base")
    assert capsys.readouterr().out.strip() == "default handle: base"
    assert magics(ip).default_handle == "base"
    info = ip.run_line_magic("llm", "info")
    assert "%llm info base  (the default handle)" in capsys.readouterr().out
    named = ip.run_line_magic("llm", "info base")  # the same rows (RSS figures move between calls)
    assert list(info.index) == list(named.index)
    assert info.loc["fingerprint", "value"] == named.loc["fingerprint", "value"]
    assert ip.run_line_magic("llm", "kv").equals(ip.run_line_magic("llm", "kv base"))
    with capture_output() as cap:
        run(ip, "%llm bench fast --max-tokens 2 --rounds 1 --warmup 0")
    assert ip.user_ns["_"].baseline == "base" and "(base is the default handle)" in cap.stdout
    run(ip, "%%chat --max-tokens 2 --quiet\nhi")  # the default lease's session: base_chat
    assert len(ip.user_ns["base_chat"].messages) == 2
    with pytest.raises(UsageError, match="no handle named 'nope'"):
        ip.run_line_magic("llm", "use nope")
    with pytest.raises(UsageError, match="not both"):
        ip.run_line_magic("llm", "use base --none")
    run(ip, "del base")
    with pytest.raises(UsageError, match="default handle 'base' is gone; name a handle, or choose another"):
        ip.run_cell_magic("generate", "--quiet", "hello")
    run(ip, "%llm use --none")
    assert magics(ip).default_handle == ""
    run(ip, "%config LLMMagics.default_to_latest = False")
    with pytest.raises(UsageError, match="required: B"):
        ip.run_line_magic("llm", "bench fast")


def test_the_latest_handle_skips_closed_and_deleted_ones(ip, llama_path):
    run(ip, "%config LLMMagics.default_to_latest = True")
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    run(ip, "%llm pool base --as pooled --max-idle 1")
    run(ip, "%llm close pooled")
    assert magics(ip).handles.latest() == "base"
    from aner_nb import llm

    ip.user_ns["llm"] = llm
    run(ip, f"made = llm.load(r'{llama_path}', context={CTX})")  # the Python API's handles count too
    assert magics(ip).handles.latest() == "made"
    run(ip, "del made")
    assert magics(ip).handles.latest() == "base"


# -- formats ------------------------------------------------------------------------------------------
def test_answer_html_renders_markdown_safely():
    page = answer_html("# Title\n\n- **one**\n- two\n\n| a | b |\n|---|---|\n| 1 | 2 |\n", "markdown")
    assert "jp-RenderedMarkdown" in page and "<h1>Title</h1>" in page and "<strong>one</strong>" in page
    assert "<table>" in page
    hostile = answer_html("<img src=x onerror=alert(1)> <script>x()</script> [y](javascript:alert(1))", "markdown")
    assert "<img" not in hostile and "<script" not in hostile and "href" not in hostile
    assert "&lt;script&gt;" in hostile
    code = answer_html("```python\nprint(1 < 2)\n```", "code")
    assert "language-python" in code and "print(1 &lt; 2)" in code and "```" not in code
    assert answer_html('{"a": [1, 2]}', "json").count("\n") > 2  # pretty-printed
    assert "not valid JSON" in answer_html("{oops", "json")
    assert answer_html("a < b", "text") == "<pre style='white-space:pre-wrap'>a &lt; b</pre>"
    with pytest.raises(ValueError, match="format must be one of markdown, text, code, json"):
        answer_html("x", "html")


@pytest.mark.parametrize("fmt, marker", [("markdown", "jp-RenderedMarkdown"), ("text", "<pre style"),
                                         ("code", "aner-code"), ("json", "aner-json")])
def test_each_format_shows_the_whole_answer(ip, llama_path, fmt, marker):
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    constraint = f" --json-schema '{schema}'" if fmt == "json" else ""
    with capture_output() as cap:
        run(ip, f"%%generate base --no-stream --max-tokens 30 --format {fmt}{constraint} --as r\nanswer")
    response, shown = ip.user_ns["r"], cap.outputs[-1].data
    assert marker in shown["text/html"] and "aner-timings" in shown["text/html"]
    assert shown["text/plain"].startswith(response.text + "\n")  # the whole text, never shortened
    assert fmt in ANSWER_FORMATS


def test_markdown_is_the_default_and_streams_as_markdown(ip, llama_path):
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    run(ip, "%config LLMMagics.stream_interval = 0")
    with capture_output() as cap:
        run(ip, "%%generate base --max-tokens 12\nhello")
    streamed = [o for o in cap.outputs[1:-1]]
    assert streamed and all("aner-stream" in o.data["text/html"] for o in streamed)
    assert all("jp-RenderedMarkdown" in o.data["text/html"] for o in streamed)
    assert "base: generating..." in streamed[-1].data["text/html"]
    assert "jp-RenderedMarkdown" in cap.outputs[-1].data["text/html"] and answered_by(cap.outputs[-1]) == "base"
    run(ip, "%config LLMMagics.format = 'text'")
    with capture_output() as cap:
        run(ip, "%%generate base --no-stream --max-tokens 3\nhello")
    assert "jp-RenderedMarkdown" not in cap.outputs[-1].data["text/html"]


# -- {In[n]}, {Out[n]}, {Err} ------------------------------------------------------------------------------
def test_interpolate_reads_cells_and_the_last_error():
    ns = {"In": ["", "x = 1", "x + 1"], "Out": {2: 2}, "x": 1}
    assert interpolate("{In[1]} then {In[2]} gives {Out[2]} ({x})", ns) == "x = 1 then x + 1 gives 2 (1)"
    assert interpolate("{{In[1]}} {{Err}} {{x}}", ns) == "{In[1]} {Err} {x}"
    assert interpolate("why: {Err}", ns, error=lambda: "Traceback...") == "why: Traceback..."
    with pytest.raises(PromptError, match=r"\{In\[7\]\}: cell 7 has no input"):
        interpolate("{In[7]}", ns)
    with pytest.raises(PromptError, match=r"\{Out\[1\]\}: cell 1 has no output"):
        interpolate("{Out[1]}", ns)
    with pytest.raises(PromptError, match="no cell has raised one yet"):
        interpolate("{Err}", ns, error=lambda: None)
    assert interpolate('{"json": {x}}', ns) == '{"json": 1}'


def test_cell_prompts_interpolate_in_out_and_err(ip, llama_path):
    base = f"%llm load {llama_path} --as base --context {CTX}"
    run(ip, base)
    first = run(ip, "21 * 2", history=True).execution_count
    run(ip, f"%%generate base --quiet --max-tokens 1 --as r\nCode: {{In[{first}]}} -> {{Out[{first}]}}")
    model = ip.user_ns["base"]
    assert ip.user_ns["r"].usage.prompt_tokens == len(model.prompt_tokens("Code: 21 * 2 -> 42"))
    with pytest.raises(UsageError, match="no cell has raised one yet"):
        ip.run_cell_magic("generate", "base --quiet", "Explain: {Err}")
    failed = ip.run_cell("1 / 0", store_history=True)
    assert isinstance(failed.error_in_exec, ZeroDivisionError)
    error = last_error()
    assert error.startswith("Traceback (most recent call last):") and "ZeroDivisionError: division by zero" in error
    assert "interactiveshell.py" not in error  # IPython's own frames are left out, as IPython shows it
    run(ip, "%%generate base --quiet --max-tokens 1 --as r\nExplain: {Err}")
    assert ip.user_ns["r"].usage.prompt_tokens == len(model.prompt_tokens("Explain: " + error))
    with pytest.raises(UsageError, match=r"%%generate: \{In\[9999\]\}: cell 9999 has no input"):
        ip.run_cell_magic("generate", "base --quiet", "{In[9999]}")


# -- Ctrl-C -----------------------------------------------------------------------------------------------
def _interrupt_decode(monkeypatch, at: int = 4):
    real_decode = _engine.NativeContext.decode
    calls = {"n": 0}

    def interrupted(self, batch):
        calls["n"] += 1
        if calls["n"] == at:
            raise KeyboardInterrupt
        return real_decode(self, batch)

    monkeypatch.setattr(_engine.NativeContext, "decode", interrupted)


def test_ctrl_c_raises_after_storing_the_partial_response(ip, llama_path, monkeypatch):
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    assert magics(ip).on_interrupt == "raise"  # the default: queued cells of Run All stop
    _interrupt_decode(monkeypatch)
    with capture_output() as cap:
        result = ip.run_cell("%%generate base --max-tokens 40 --as r\nhello", store_history=False)
    monkeypatch.undo()
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert "cancelled; the partial Response is in _ and r" in str(result.error_in_exec)
    partial = ip.user_ns["r"]
    assert partial.finish_reason == "cancelled" and ip.user_ns["_"] is partial
    assert "cancelled" in cap.outputs[-1].data["text/html"]
    run(ip, "%%generate base --max-tokens 3 --quiet\nagain")  # the handle is free and open
    assert ip.user_ns["_"].finish_reason in ("length", "stop")


def test_ctrl_c_with_keep_ends_the_cell_normally(ip, llama_path, monkeypatch):
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    run(ip, "%config LLMMagics.on_interrupt = 'keep'")
    _interrupt_decode(monkeypatch, at=3)
    with capture_output():
        result = ip.run_cell("%%chat base --max-tokens 30 --as r\nhello", store_history=False)
    monkeypatch.undo()
    assert result.success and ip.user_ns["r"].finish_reason == "cancelled"
    run(ip, "%config LLMMagics.on_interrupt = 'loud'")  # %config logs the trait error and keeps the value
    assert magics(ip).on_interrupt == "keep"


# -- completion and the load line --------------------------------------------------------------------------
def test_completion_offers_flags_choices_and_handles(ip, llama_path):
    from IPython.core.completer import provisionalcompleter

    def complete(text):
        with provisionalcompleter():
            return [c.text for c in ip.Completer.completions(text, len(text))]

    run(ip, f"%llm load {llama_path} --as basemodel --context {CTX}")
    assert "--kv-cache-type" in complete("%llm load x --kv")
    assert "--no-warmup" in complete("%llm load x --as m --no-")
    assert {"f16", "q8_0", "q4_0"} <= set(complete("%llm load x --as m --kv-cache-type "))
    assert "--format" in complete("%%generate basemodel --for")
    assert set(ANSWER_FORMATS) <= set(complete("%%generate --format "))
    assert "markdown" in complete("%%chat basemodel --format mar")
    assert "basemodel" in complete("%llm use bas")
    assert "basemodel" in complete("%llm kv --slots 2 bas")  # after a flag's value, the NAME slot
    assert "basemodel" not in complete("%llm adapter basemodel bas")  # MANIFEST is a path
    assert "--none" in complete("%llm use --n")


def test_the_load_line_times_each_phase(ip, llama_path, capsys):
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    out = capsys.readouterr().out
    assert re.search(r"\(loaded and SHA-256 verified in \d+\.\d\d s: hash \d+\.\d\d s alongside load \d+\.\d\d s, "
                     r"verify \d+\.\d\d s, warm-up \d+\.\d\d s\)$", out.strip()), out
    run(ip, f"%llm load {llama_path} --as base --context {CTX} --no-warmup")
    assert capsys.readouterr().out.strip().endswith(", warm-up skipped)")
    assert ip.user_ns["base"].load_summary().warmup_duration == -1
