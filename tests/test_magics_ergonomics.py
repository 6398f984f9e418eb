"""Notebook ergonomics on a real IPython shell: %llm models, --as left out, LLMMagics.timings,
{Err[n]} in cell prompts, %llm chat (the chat box), and the split of LLMMagics by topic."""

from __future__ import annotations

import io
import shutil
import sys

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from aner_nb import llm, magics as magics_pkg
from aner_nb.magics import display as display_mod
from aner_nb.magics.magics import COMMANDS, LLMMagics
from aner_nb.magics.naming import NameClaims, identifier
from aner_nb.magics.prompt import ErrorLog, PromptError, interpolate
from aner_nb.widgets.chat import ChatBox
from test_magics import run  # a cell in the shell fixture, failing with the cell's own exception

CTX = 256



def ext_of(ip):
    return magics_pkg.extension_for(ip)


def html_of(output) -> str:
    return output.data.get("text/html", "")


@pytest.fixture
def store(tmp_path, monkeypatch, llama_path):
    """A model folder ($ANER_NB_MODELS) holding the tiny llama as Tiny-Llama.Q8.gguf; no other store."""
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(llama_path, folder / "Tiny-Llama.Q8.gguf")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("ANER_NB_MODELS", str(folder))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hf"))
    monkeypatch.setenv("OLLAMA_MODELS", str(home / "ollama"))
    return folder


# -- the split: one configurable class, dispatch and help unchanged ------------------------------
def test_llmmagics_is_one_configurable_class_assembled_from_topic_mixins(ip):
    from aner_nb.magics import generation, inspection, loading, serving

    for topic in (loading.LoadingMagics, generation.GenerationMagics, serving.ServingMagics,
                  inspection.InspectionMagics):
        assert issubclass(LLMMagics, topic)
    assert [c for c in ip.configurables if type(c).__name__ == "LLMMagics"] == [ext_of(ip).magics]
    assert set(LLMMagics.class_trait_names(config=True)) >= {"timings", "max_tokens", "display", "format"}
    assert LLMMagics.magics == {"line": {"llm": "llm"}, "cell": {"generate": "generate", "chat": "chat"}}
    assert set(COMMANDS) >= {"models", "chat"}


def test_servers_are_kept_apart_from_the_handle_registry(ip):
    ext = ext_of(ip)
    assert not hasattr(ext.handles, "add_server") and not hasattr(ext.handles, "stop_servers")
    assert ext.magics.servers is ext.servers and ext.servers.running() == {}


def test_no_magics_module_over_600_lines_nor_function_over_60():
    sys.path.insert(0, "scripts")
    try:
        import size_report
    finally:
        sys.path.remove("scripts")
    assert [w for _, w in size_report.long_functions(60) if "/magics/" in w] == []
    assert [w for _, w in size_report.long_modules(600) if "/magics/" in w] == []


# -- %llm models and %llm load NAME ---------------------------------------------------------------
def test_models_shows_the_store_and_load_takes_a_name(ip, store, capsys):
    frame = ip.run_line_magic("llm", "models")
    assert list(frame.columns) == list(llm.models().columns)
    row = frame[frame.name == "Tiny-Llama.Q8"]
    assert len(row) == 1 and row.iloc[0].store == "folder" and bool(row.iloc[0].admitted)
    run(ip, f"%llm load Tiny-Llama.Q8 --context {CTX}")
    assert "tiny_llama_q8" in capsys.readouterr().out  # the derived name is printed
    assert ip.user_ns["tiny_llama_q8"].path == str(store / "Tiny-Llama.Q8.gguf")
    ip.user_ns["which"] = "tiny-llama.q8"  # {var} in the line, and a case-insensitive name
    run(ip, f"%llm load {{which}} --as named --context {CTX}")
    assert ip.user_ns["named"].path == str(store / "Tiny-Llama.Q8.gguf")
    with pytest.raises(UsageError, match=r"%llm load: ModelNotFoundError: no file 'nope'"):
        ip.run_line_magic("llm", "load nope")


# -- --as left out ---------------------------------------------------------------------------------
def test_identifier_from_paths_and_names():
    assert identifier("models/SmolLM2-135M-Instruct-Q8_0.gguf") == "smollm2_135m_instruct_q8_0"
    assert identifier("qwen2.5:0.5b") == "qwen2_5_0_5b"
    assert identifier("bartowski/Llama-3.2-1B/x.gguf") == "x"
    assert identifier("7b.gguf") == "m_7b" and identifier("list.gguf") == "list_" and identifier("if") == "if_"
    assert identifier("---.gguf") == "model" and identifier("a/tiny-lora.manifest.json") == "tiny_lora_manifest"
    claims, ns = NameClaims(), {"m": 5}
    assert claims.choose("m", "k", ns) == "m_2"  # a variable is never shadowed


def test_load_without_as_names_the_handle_after_the_file(ip, llama_path, tmp_path, capsys):
    run(ip, f"%llm load {llama_path} --context {CTX}")
    first = ip.user_ns["tiny_llama"]
    assert "tiny_llama = " in capsys.readouterr().out
    run(ip, f"%llm load {llama_path} --context {CTX}")  # re-running the cell replaces it, no _2
    assert first.closed and not ip.user_ns["tiny_llama"].closed and "tiny_llama_2" not in ip.user_ns
    other = tmp_path / "elsewhere"
    other.mkdir()
    shutil.copy(llama_path, other / "tiny-llama.gguf")
    run(ip, f"%llm load {other / 'tiny-llama.gguf'} --context {CTX}")  # another file: a new name
    assert not ip.user_ns["tiny_llama"].closed and ip.user_ns["tiny_llama_2"].path == str(other / "tiny-llama.gguf")
    ip.user_ns["tiny_llama_3"] = "my variable"
    run(ip, f"%llm load {llama_path} --as tiny_llama_4 --context {CTX}")  # chosen by the user: not claimed
    third = tmp_path / "third"
    third.mkdir()
    shutil.copy(llama_path, third / "tiny-llama.gguf")
    run(ip, f"%llm load {third / 'tiny-llama.gguf'} --context {CTX}")
    assert ip.user_ns["tiny_llama_3"] == "my variable" and not ip.user_ns["tiny_llama_4"].closed
    assert ip.user_ns["tiny_llama_5"].path == str(third / "tiny-llama.gguf")
    run(ip, f"%llm load {other / 'tiny-llama.gguf'} --context {CTX}")  # re-run: the same command's name
    assert ip.user_ns["tiny_llama_2"].path == str(other / "tiny-llama.gguf") and "tiny_llama_6" not in ip.user_ns


def test_builders_without_as_derive_from_the_source(ip, llama_path, fixture_models, tmp_path, capsys):
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    run(ip, "%llm optimize base --prefix-cache-entries 1")
    run(ip, "%llm batch base --max-sequences 2")
    run(ip, "%llm pool base --max-idle 1")
    out = capsys.readouterr().out
    assert "base_latency = " in out and "no --as: the handle is named base_batch" in out
    latency = ip.user_ns["base_latency"]
    assert latency.kind == "latency" and ip.user_ns["base_batch"].kind == "throughput"
    assert not ip.user_ns["base_pool"].closed
    run(ip, "%llm optimize base --prefix-cache-entries 1")  # re-run: replaced in place
    assert latency.closed and not ip.user_ns["base_latency"].closed and "base_latency_2" not in ip.user_ns
    shutil.copy(fixture_models["lora"], tmp_path / "tiny-lora.gguf")
    manifest = llm.write_manifest(tmp_path / "tiny-lora.gguf", base_sha256=ip.user_ns["base"].fingerprint,
                                  architecture="llama")
    ip.user_ns["manifest"] = str(manifest)
    run(ip, "%llm adapter base {manifest}")
    assert ip.user_ns["base_tiny_lora_manifest"].kind == "adapter"


# -- %config LLMMagics.timings -----------------------------------------------------------------------
def test_timings_full_compact_and_off(ip, llama_path):
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    with capture_output() as cap:
        run(ip, "%%generate base --max-tokens 4\nhello")
    assert "aner-timings" in html_of(cap.outputs[-1])  # full (default): the dashboard
    run(ip, "%config LLMMagics.timings = 'compact'")
    for flags in ("", "--no-stream"):
        with capture_output() as cap:
            run(ip, f"%%generate base --max-tokens 4 {flags}\nhello")
        last = html_of(cap.outputs[-1])
        response = ip.user_ns["_"]
        assert "aner-timings'" not in last and "aner-timings-line" in last
        assert "first token " in last and "tok/s" in last and "answered by base" in last
        assert f"{response.usage.completion_tokens} tokens" in last and "cached input tokens" in last
        assert cap.outputs[-1].data["text/plain"].startswith(response.text)
    run(ip, "%config LLMMagics.timings = 'off'")
    with capture_output() as cap:
        run(ip, "%%generate base --max-tokens 4\nhello")
    last = html_of(cap.outputs[-1])
    assert "aner-response" in last and "tok/s" not in last and "aner-timings" not in last.replace(
        "aner-timings-line", "")
    run(ip, "%config LLMMagics.timings = 'loud'")  # rejected; the value stays
    assert ext_of(ip).magics.timings == "off"


def test_terminal_view_follows_the_timings_setting(ip, llama_path):
    base = llm.load(llama_path, context=CTX, progress=False)
    try:
        response = base.generate("hello", max_tokens=3)
    finally:
        base.close()
    lines = {}
    for timings in display_mod.TIMINGS:
        out = io.StringIO()
        view = display_mod.PrintView(stream=False, out=out, source="base", timings=timings)
        view.finish(response)
        lines[timings] = out.getvalue()
    assert "[length]" in lines["full"] or "[stop]" in lines["full"]
    assert display_mod.compact_line(response) in lines["compact"] and "answered by base" in lines["compact"]
    assert lines["off"] == f"{response.text}\nanswered by base\n"


# -- {Err[n]} ------------------------------------------------------------------------------------------
def test_error_log_is_bounded_and_counts_back():
    log = ErrorLog(size=2)
    for n in (3, 5, 8):
        try:
            raise ValueError(f"cell {n}")
        except ValueError as exc:
            log.record(n, exc)
    assert len(log) == 2 and log.get(3) is None and "ValueError: cell 5" in log.get(5)
    assert log.get(-1) == log.get(8) and log.get(-2) == log.get(5) and log.get(-3) is None
    assert interpolate("why: {Err[5]} {{Err[5]}}", {}, errors=log).endswith("ValueError: cell 5 {Err[5]}")
    with pytest.raises(PromptError, match=r"\{Err\[4\]\}: cell 4 raised no exception"):
        interpolate("{Err[4]}", {}, errors=log)
    with pytest.raises(PromptError):
        interpolate("{Err[5]}", {})  # no log: nothing to look up


def test_err_n_fills_in_the_exception_cell_n_raised(ip, llama_path):
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    failed = ip.run_cell("def boom():\n    raise KeyError('missing key')\nboom()", store_history=True)
    n = failed.execution_count
    ip.run_cell("1 / 0", store_history=True)  # a later error: {Err} is this one, {Err[n]} still cell n's
    text = ext_of(ip).errors.get(n)
    assert text.startswith("Traceback") and "KeyError: 'missing key'" in text and "boom()" in text
    run(ip, f"%%generate base --max-tokens 1 --quiet\nExplain: {{Err[{n}]}}")
    expected = ip.user_ns["base"].prompt_tokens(f"Explain: {text}")
    assert ip.user_ns["_"].usage.prompt_tokens == len(expected)
    with pytest.raises(UsageError, match=r"^%%generate: \{Err\[9999\]\}: cell 9999 raised no exception"):
        ip.run_cell_magic("generate", "base --max-tokens 1", "Explain {Err[9999]}")
    ok = ip.run_cell("x = 1", store_history=True)
    assert ext_of(ip).errors.get(ok.execution_count) is None


# -- %llm chat ------------------------------------------------------------------------------------------
def test_chat_shows_a_box_that_close_closes(ip, llama_path):
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    with capture_output() as cap:
        run(ip, '%llm chat base --system "Be brief." --max-tokens 3 --seed 1')
    box = ip.user_ns["base_box"]
    assert isinstance(box, ChatBox) and len(cap.outputs) == 1 and cap.outputs[0].transient["display_id"]
    assert box.session.messages[0] == {"role": "system", "content": "Be brief."}
    assert box.options["settings"].max_tokens == 3 and box.options["settings"].seed == 1
    box.send("hi")
    assert box.wait(60)
    assert [m["role"] for m in box.session.messages] == ["system", "user", "assistant"]
    first = box.session
    run(ip, "%llm chat base --as talk")  # another name: another box
    assert not first.closed and ip.user_ns["talk"].session.messages == ()
    run(ip, "%llm chat base")  # re-running the cell replaces the box and closes its session
    assert first.closed and ip.user_ns["base_box"] is not box
    newer = ip.user_ns["base_box"].session
    run(ip, "%llm close base")
    assert newer.closed and ip.user_ns["talk"].session.closed and ip.user_ns["base"].closed


def test_chat_usage_errors(ip, llama_path):
    run(ip, f"%llm load {llama_path} --as base --context {CTX}")
    run(ip, "%llm batch base --as many --max-sequences 2")
    ip.user_ns["x"] = 5
    for line, message in [
        ("chat base --as x", "'x' is a int, not a chat box"),
        ("chat base --as 1x", "--as '1x' is not a valid Python variable name"),
        ("chat base --temperature 5", "InvalidRequestError: temperature must be"),
        ("chat nope", "no handle named 'nope'"),
        ("chat many", "has no chat sessions"),
    ]:
        with pytest.raises(UsageError, match=message):
            ip.run_line_magic("llm", line)
    assert ip.user_ns["x"] == 5 and "base_box" not in ip.user_ns


def test_help_lists_models_chat_timings_and_err_n(ip, capsys):
    ip.run_line_magic("llm", "help")
    text = capsys.readouterr().out
    assert "%llm models" in text and "%llm chat [NAME]" in text and "llm.models()" in text
    assert "timings" in text and "{Err[n]}" in text and "widgets.chat_box(" in text
    ip.run_line_magic("llm", "help chat")
    ip.run_line_magic("llm", "help %%chat")
    out = capsys.readouterr().out
    assert "usage: %llm chat" in out and "usage: %%chat" in out
