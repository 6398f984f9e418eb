"""The notebook layer on a real IPython shell (and one real kernel): %llm, %%generate, %%chat.

Every subcommand, every usage error, streaming into one display, Ctrl-C,
handle release on del / overwrite / %reset / failed cells / re-run load
cells, and unload symmetry. Tiny fixtures everywhere; the demo model only
for the %reset RSS drop and the DESIGN.md "A user writes" check.
"""

from __future__ import annotations

import gc

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import aner_nb
from aner_nb import llm, magics as magics_pkg
from aner_nb.llm import _engine
from aner_nb.magics import display as display_mod
from aner_nb.magics import interpolate, kv_table
from aner_nb.magics.magics import LLMMagics
from aner_nb.magics.magics import SUBCOMMANDS
from test_notebook_kernel import execute  # a cell in a real kernel: (reply, IOPub messages)

CTX = 256


# -- helpers (the shell and ip fixtures are in conftest.py) ------------------------------
def run(ip, cell, *, history=False):
    """Run a cell; fail the test with the cell's own exception if it raised."""
    result = ip.run_cell(cell, store_history=history)
    if result.error_before_exec or result.error_in_exec:
        raise result.error_before_exec or result.error_in_exec
    return result


def load(ip, path, name="base", extra=""):
    run(ip, f"%llm load {path} --as {name} --context {CTX} {extra}")
    return ip.user_ns[name]


def native_of(ip, name):
    """The owner of the weights (its free_calls counter), without keeping the lease alive."""
    return ip.user_ns[name]._weights.native


def ext_of(ip):
    return magics_pkg.extension_for(ip)


def html_of(output) -> str:
    return output.data.get("text/html", "")


# -- loading and the extension itself -------------------------------------------------------
def test_load_ext_registers_magics_hook_config_and_completer(ip):
    ext = ext_of(ip)
    assert "llm" in ip.magics_manager.magics["line"]
    assert {"generate", "chat"} <= set(ip.magics_manager.magics["cell"])
    assert ext.post_run_cell in ip.events.callbacks["post_run_cell"]
    assert ext.magics in ip.configurables
    assert ext.matcher in ip.Completer.custom_matchers
    assert aner_nb.load_ipython_extension is not None and "llm" in aner_nb.__all__


class _AtexitRecorder:
    """Stands in for the atexit module (atexit._ncallbacks counts unregistered slots too)."""

    def __init__(self):
        self.live = []

    def register(self, func):
        self.live.append(func)

    def unregister(self, func):
        self.live = [f for f in self.live if f != func]


def test_unload_is_symmetric_and_closes_handles(ip, llama_path, monkeypatch):
    from aner_nb.magics import magics as magics_module

    recorder = _AtexitRecorder()
    monkeypatch.setattr(magics_module, "atexit", recorder)
    ext = ext_of(ip)
    base = load(ip, llama_path)
    run(ip, "%%chat base --max-tokens 2 --quiet\nhi")
    session = ip.user_ns["base_chat"]
    ip.run_line_magic("unload_ext", "aner_nb")
    baseline = {
        "line": set(ip.magics_manager.magics["line"]),
        "cell": set(ip.magics_manager.magics["cell"]),
        "callbacks": {k: list(v) for k, v in ip.events.callbacks.items()},
        "configurables": list(ip.configurables),
        "matchers": list(ip.Completer.custom_matchers),
        "atexit": list(recorder.live),
    }
    assert base.closed and session.closed  # unloading closes what it tracked
    assert "llm" not in baseline["line"] and not {"generate", "chat"} & baseline["cell"]
    assert not any(getattr(cb, "__self__", None) is ext for cbs in baseline["callbacks"].values() for cb in cbs)
    assert not any(isinstance(c, LLMMagics) for c in ip.configurables)
    assert ext.matcher not in ip.Completer.custom_matchers
    assert "LLMMagics" not in dict(ip.magics_manager.registry)
    with pytest.raises(UsageError):
        ip.run_line_magic("llm", "list")
    del base, session

    ip.run_line_magic("load_ext", "aner_nb")
    assert len(recorder.live) == len(baseline["atexit"]) + 1
    assert "llm" in ip.magics_manager.magics["line"]
    ip.run_line_magic("unload_ext", "aner_nb")
    assert set(ip.magics_manager.magics["line"]) == baseline["line"]
    assert set(ip.magics_manager.magics["cell"]) == baseline["cell"]
    assert {k: list(v) for k, v in ip.events.callbacks.items()} == baseline["callbacks"]
    assert list(ip.configurables) == baseline["configurables"]
    assert list(ip.Completer.custom_matchers) == baseline["matchers"]
    assert recorder.live == baseline["atexit"]
    ip.run_line_magic("load_ext", "aner_nb")


def test_at_exit_closes_every_tracked_handle(ip, llama_path):
    load(ip, llama_path)
    native = native_of(ip, "base")
    ext_of(ip).at_exit()
    assert ip.user_ns["base"].closed and native.free_calls == 1


def test_config_traits_through_percent_config(ip, llama_path):
    load(ip, llama_path)
    run(ip, "%config LLMMagics.max_tokens = 3")
    run(ip, "%config LLMMagics.display = 'none'")
    with capture_output() as cap:
        run(ip, "%%generate base\nhello")
    assert ip.user_ns["_"].usage.completion_tokens <= 3
    assert cap.outputs == []
    run(ip, "%config LLMMagics.display = 'loud'")  # %config logs the trait error and keeps the value
    assert ext_of(ip).magics.display == "none"


# -- %llm subcommands ----------------------------------------------------------------------
def test_load_binds_a_lease_and_prints_a_summary(ip, llama_path, capsys):
    base = load(ip, llama_path)
    assert isinstance(base, llm.LLMModel) and base.context == CTX and not base.closed
    out = capsys.readouterr().out
    assert out.startswith("base = <LLMModel") and "SHA-256 verified" in out
    assert run(ip, "%llm load {p} --as other --context 128 --device cpu --kv-cache-type f16 --flash-attention off".format(
        p=llama_path)).result is None  # the handle is not returned (no hidden Out reference)
    assert ip.user_ns["other"].context == 128
    run(ip, f"%llm load {llama_path} --as forced --context 128 --cpu-extra-buffers off")
    summary = ip.user_ns["forced"].load_summary()
    assert summary.cpu_extra_buffers == "off" and "forced" in summary.cpu_extra_buffers_reason


def test_load_expands_variables_in_the_line(ip, llama_path):
    ip.user_ns["model_path"] = str(llama_path)
    run(ip, "%llm load {model_path} --as base --context 128")
    assert ip.user_ns["base"].path == str(llama_path)


def test_list_is_a_dataframe_of_live_handles(ip, llama_path):
    load(ip, llama_path)
    run(ip, "%%chat base --max-tokens 2 --quiet\nhi")
    ip.user_ns["llm"] = llm
    run(ip, f"m = llm.load(r'{llama_path}', context=128)")  # made with the Python API: adopted
    frame = ip.run_line_magic("llm", "list")
    assert list(frame.columns) == ["name", "kind", "architecture", "profile", "device", "context", "fingerprint", "state"]
    rows = frame.set_index("name")
    assert set(rows.index) == {"base", "base_chat", "m"}
    assert rows.loc["base", "kind"] == "lease" and rows.loc["base_chat", "kind"] == "session"
    assert rows.loc["base_chat", "architecture"] == "llama"  # from the lease the session was opened on
    assert rows.loc["m", "context"] == 128 and rows.loc["base", "profile"] == "ordinary"
    assert rows.loc["base", "fingerprint"] == ip.user_ns["base"].fingerprint[:12]
    ip.run_line_magic("llm", "close m")
    assert ip.run_line_magic("llm", "list").set_index("name").loc["m", "state"] == "closed"


def test_info_shows_metadata_load_and_memory(ip, llama_path):
    base = load(ip, llama_path)
    info = ip.run_line_magic("llm", "info base")["value"]
    assert info["architecture"] == "llama" and info["fingerprint"] == base.fingerprint
    assert info["load.file_bytes"] == llama_path.stat().st_size
    assert info["memory.kv_bytes"] == base.memory_summary().kv_bytes and info["memory.rss_bytes"] > 0
    assert "generate" in info["supports"]
    run(ip, "%llm close base")
    assert ip.run_line_magic("llm", "info base")["value"]["state"] == "closed"


def test_info_of_a_session_shows_its_lease(ip, llama_path):
    base = load(ip, llama_path)
    run(ip, "%%chat base --max-tokens 2 --quiet\nhi")
    info = ip.run_line_magic("llm", "info base_chat")["value"]
    assert info["kind"] == "session" and info["turns"] == 1 and info["cached_tokens"] > 0
    assert info["fingerprint"] == base.fingerprint and info["architecture"] == "llama"


def test_kv_matches_the_library_formula(ip, llama_path):
    base = load(ip, llama_path)
    facts = llm.inspect_model(llama_path)
    frame = ip.run_line_magic("llm", "kv base")
    assert list(frame["kv_cache_type"]) == list(llm.KV_CACHE_TYPES)
    f16 = frame.set_index("kv_cache_type").loc["f16"]
    assert bool(f16["current"])
    assert f16["bytes_per_slot"] == llm.kv_estimate(CTX, facts.layers, facts.kv_heads, facts.head_dim_k, facts.head_dim_v)
    one = ip.run_line_magic("llm", "kv base --context 1024 --kv-cache-type q8_0 --slots 3")
    per = llm.kv_estimate(1024, facts.layers, facts.kv_heads, facts.head_dim_k, facts.head_dim_v, "q8_0")
    assert len(one) == 1 and one["total_bytes"][0] == 3 * per and one["slots"][0] == 3
    assert kv_table(base, context=1024, kv_cache_type="q8_0", slots=3).equals(one)


def test_close_by_name_and_all(ip, llama_path, capsys):
    load(ip, llama_path, "a")
    load(ip, llama_path, "b")
    native_a = native_of(ip, "a")
    run(ip, "%llm close a")
    assert ip.user_ns["a"].closed and not ip.user_ns["b"].closed and native_a.free_calls == 1
    run(ip, "%llm close --all")
    assert ip.user_ns["b"].closed
    assert "closed" in capsys.readouterr().out


def test_optimize_derives_a_latency_lease(ip, llama_path):
    base = load(ip, llama_path)
    run(ip, "%llm optimize base --as fast --prefix-cache-entries 1 --speculative-tokens 4 --batch-tokens 256")
    fast = ip.user_ns["fast"]
    assert fast is not base and fast.fingerprint == base.fingerprint
    assert fast.profile.kind == "latency" and fast.profile.optimizer.speculative_tokens == 4
    assert base.profile.kind == "ordinary"
    run(ip, "%%generate fast --max-tokens 4 --quiet\nhello")
    assert ip.user_ns["_"].timings.speculative_tokens == 4


def test_pool_derives_a_lease_with_idle_contexts(ip, llama_path):
    load(ip, llama_path)
    run(ip, "%llm pool base --as pooled --max-idle 2")
    assert ip.user_ns["pooled"].profile.max_idle_contexts == 2


def test_batch_derives_a_throughput_lease_that_streams(ip, llama_path):
    load(ip, llama_path)
    run(ip, "%llm batch base --as many --max-sequences 2")
    many = ip.user_ns["many"]
    assert many.supports("continuous_batching")
    assert ip.run_line_magic("llm", "list").set_index("name").loc["many", "profile"] == "throughput"
    run(ip, "%%generate many --max-tokens 4 --quiet\nhello")
    assert ip.user_ns["_"].usage.completion_tokens >= 1
    with pytest.raises(UsageError, match="no chat sessions|not available on a batching lease"):
        ip.run_cell_magic("chat", "many", "hi")


def test_batch_with_speculative_tokens_derives_a_speculating_throughput_lease(ip, llama_path):
    load(ip, llama_path)
    run(ip, "%llm batch base --as spec --max-sequences 2 --speculative-tokens 4")
    spec = ip.user_ns["spec"]
    assert spec.supports("continuous_batching") and spec.supports("speculative")
    assert spec.profile.optimizer.speculative_tokens == 4


def test_adapter_derives_an_adapter_lease(ip, llama_path, fixture_models, tmp_path):
    import shutil

    base = load(ip, llama_path)
    shutil.copy(fixture_models["lora"], tmp_path / "tiny-lora.gguf")
    manifest = llm.write_manifest(tmp_path / "tiny-lora.gguf", base_sha256=base.fingerprint, architecture="llama")
    ip.user_ns["manifest"] = str(manifest)
    run(ip, "%llm adapter base {manifest} --as tuned")
    tuned = ip.user_ns["tuned"]
    assert tuned.supports("adapter") and tuned.fingerprint == base.fingerprint and not base.supports("adapter")
    run(ip, "%%generate tuned --max-tokens 4 --quiet\nhello")
    assert ip.user_ns["_"].usage.completion_tokens >= 1
    with pytest.raises(UsageError, match="one adapter"):
        ip.run_line_magic("llm", "adapter tuned {manifest} --as twice")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UsageError, match="schema"):
        ip.run_line_magic("llm", f"adapter base {tmp_path / 'bad.json'} --as broken")


BENCH_PREFIX = "You are a careful assistant. Answer briefly and plainly. The question is: "


def test_bench_pairs_a_lease_with_its_prefix_cached_optimizer(ip, llama_path):
    from aner_nb import bench
    from aner_nb.magics import bench_outputs, bench_table

    load(ip, llama_path)
    run(ip, "%llm optimize base --as fast --prefix-cache-entries 1")
    ip.user_ns["q"] = "what is two plus two?"
    with capture_output() as cap:
        run(ip, f'%llm bench base fast --prompt "{BENCH_PREFIX}{{q}}" --prompt "{BENCH_PREFIX}why is the sky blue?" '
                "--max-tokens 4 --rounds 1 --warmup 1 --as res")
    result = ip.user_ns["res"]
    assert isinstance(result, bench.BenchResult) and ip.user_ns["_"] is result
    assert result.baseline == "base" and result.manifest["model"]["fingerprint"] == ip.user_ns["fast"].fingerprint
    frame = result.frame
    assert set(frame.side) == {"base", "fast"} and set(frame.case) == {"p1", "p2"} and len(frame) == 4
    # the optimizer side reuses the shared prefix (warm-up filled its cache); the plain lease never does
    assert (frame[frame.side == "fast"].cached_input_tokens > 0).all()
    assert (frame[frame.side == "base"].cached_input_tokens == 0).all()
    assert result.same_outputs("fast").all()
    # the displayed tables are the pure functions' output
    summary, outputs = bench_table(result), bench_outputs(result)
    assert list(summary.side.unique()) == ["base", "fast"]
    assert set(summary.metric) >= {"first_token_ms", "total_ms"}
    assert {"median", "min", "max", "ratio_to_baseline"} <= set(summary.columns)
    assert (summary[summary.side == "base"].ratio_to_baseline == 1.0).all()
    assert list(outputs.case) == ["p1", "p1", "p2", "p2"] and outputs.same_output_as_baseline.all()
    assert (outputs[outputs.side == "fast"].cached_input_tokens > 0).all()
    shown = "".join(o.data.get("text/plain", "") for o in cap.outputs)
    assert "ratio_to_baseline" in shown and "same_output_as_baseline" in shown
    from aner_nb.llm._engine import default_threads

    d, b = default_threads()
    assert f"threads (decode/batch): base {d}/{b}, fast {d}/{b}" in cap.stdout and "different threads" not in cap.stdout
    assert result.manifest["baseline_settings"]["n_threads"] == d
    run(ip, "%llm optimize base --as skewed --threads 1 --prefill-threads 2")
    with capture_output() as cap:
        run(ip, "%llm bench base skewed --max-tokens 2 --rounds 1 --warmup 0")
    if (d, b) != (1, 2):
        assert "different threads" in cap.stdout
    # without --prompt: one built-in prompt; the result still goes to _
    with capture_output():
        run(ip, "%llm bench fast base --max-tokens 2 --rounds 1 --warmup 0")
    default = ip.user_ns["_"]
    assert default.baseline == "fast" and list(default.frame.case.unique()) == ["p1"]
    assert not ip.user_ns["base"].closed and not ip.user_ns["fast"].closed


def test_bench_usage_errors(ip, llama_path):
    load(ip, llama_path)
    ip.run_line_magic("config", "LLMMagics.default_to_latest = False")  # a NAME is required: its errors
    run(ip, "%llm optimize base --as fast")
    ip.user_ns["x"] = 3
    ip.user_ns["blank"] = "  "  # {var} in --prompt is expanded: this prompt is empty
    for line, message in [
        ("bench base", "required: B"),
        ("bench base nope", "no handle named 'nope'; handles: base, fast|no handle named 'nope'; handles: fast, base"),
        ("bench x base", "'x' is a int, not a model handle"),
        ("bench base base", "name two different handles"),
        ("bench base fast --rounds 0", "--rounds must be >= 1, got 0"),
        ("bench base fast --warmup -1", "--warmup must be >= 0"),
        ("bench base fast --max-tokens 0", "--max-tokens must be >= 1"),
        ("bench base fast --rounds two", "argument --rounds: invalid int value"),
        ("bench base fast --as 1x", "not a valid Python variable name"),
        ('bench base fast --prompt " "', "--prompt must not be empty"),
        ('bench base fast --prompt "{blank}"', "--prompt must not be empty"),
    ]:
        with pytest.raises(UsageError, match=message) as info:
            ip.run_line_magic("llm", line)
        assert "\n" not in str(info.value), line
    run(ip, "%%chat base --max-tokens 1 --quiet\nhi")
    with pytest.raises(UsageError, match="'base_chat' is a session; bench compares leases"):
        ip.run_line_magic("llm", "bench base base_chat")
    ip.user_ns["fast"].close()
    with pytest.raises(UsageError, match="'fast' is closed"):
        ip.run_line_magic("llm", "bench base fast --rounds 1 --warmup 0")


def test_bench_help_shows_the_python_equivalent(ip, capsys):
    ip.run_line_magic("llm", "help bench")
    out = capsys.readouterr().out
    assert "--rounds" in out and "--prompt" in out and "Python equivalent" in out
    assert "bench.run_sides(" in out and "bench.lease_side(" in out and "bench_table(" in out


def test_serve_and_stop_run_the_http_service(ip, llama_path):
    httpx = pytest.importorskip("httpx")
    load(ip, llama_path)
    run(ip, "%llm batch base --as many --max-sequences 2")
    server = ip.run_line_magic("llm", "serve many --port 0")
    assert server.running and server.url in server._repr_html_()
    r = httpx.post(f"{server.url}/chat", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
    assert r.status_code == 200 and r.json()["timings"]["batch_max_sequences"] == 2
    with pytest.raises(UsageError, match="already served"):
        ip.run_line_magic("llm", "serve many --port 0")
    with pytest.raises(UsageError, match="'base' is not served"):
        ip.run_line_magic("llm", "stop base")
    with pytest.raises(UsageError, match="no handle named"):
        ip.run_line_magic("llm", "serve nothing")
    ip.run_line_magic("llm", "stop")
    assert not server.running and not ip.user_ns["many"].closed  # stopping leaves the handle open
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)

    again = ip.run_line_magic("llm", "serve base --port 0")  # closing a served handle stops its server
    run(ip, "%llm close base")
    assert not again.running
    served = ip.run_line_magic("llm", "serve many --port 0")  # kernel exit (and unload: same close_all) too
    ext_of(ip).at_exit()
    assert not served.running and ip.user_ns["many"].closed


def test_help_shows_every_magic_with_its_python_equivalent(ip, capsys):
    ip.run_line_magic("llm", "help")
    text = capsys.readouterr().out
    for sub in SUBCOMMANDS:
        assert f"%llm {sub}" in text
    assert "%%generate NAME" in text and "%%chat NAME" in text
    assert text.count("Python:") == len(SUBCOMMANDS) + 2
    assert "llm.load(PATH" in text and ".with_optimizer(" in text and ".session(" in text
    ip.run_line_magic("llm", "")  # bare %llm shows the overview too
    assert "Python:" in capsys.readouterr().out
    ip.run_line_magic("llm", "help load")
    ip.run_line_magic("llm", "load -h")
    ip.run_line_magic("llm", "help generate")
    out = capsys.readouterr().out
    assert out.count("Python equivalent") == 3 and "--kv-cache-type" in out
    # %llm? / %%generate? show the magic's docstring
    assert "Python:" in ip.find_line_magic("llm").__doc__
    assert "Python equivalent" in ip.find_cell_magic("generate").__doc__
    assert "Python equivalent" in ip.find_cell_magic("chat").__doc__
    ip.run_cell_magic("generate", "-h", "prompt")  # help, not an error


def test_tab_completion_of_subcommands_and_handle_names(ip, llama_path):
    from IPython.core.completer import provisionalcompleter

    def complete(text):
        with provisionalcompleter():
            return [c.text for c in ip.Completer.completions(text, len(text))]

    load(ip, llama_path, "basemodel")
    assert "basemodel" in complete("%llm info ba")
    assert "optimize" in complete("%llm op")
    assert "basemodel" in complete("%%generate bas")
    assert "basemodel" in complete("%%chat basemodel --session bas")
    assert "basemodel" not in complete("%llm load ba")
    assert "basemodel" in complete("%llm bench basemodel bas")


# -- usage errors ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def err_paths(fixture_models):
    return fixture_models


LINE_ERRORS = [
    ("lod x", "unknown subcommand 'lod'; did you mean 'load'"),
    ("load", "required: PATH"),
    ("load {llama} --as 1bad", "not a valid Python variable name"),
    ("load {missing} --as m", "InvalidArtifactError|FileNotFoundError|not found|No such file"),
    ("load {not_gguf} --as m", "InvalidArtifactError"),
    ("load {split} --as m", "UnsupportedModelError"),
    ("load {llama} --as m --context abc", "argument --context: invalid int value"),
    ("load {llama} --as m --kv-cache-type q5", "argument --kv-cache-type: invalid choice"),
    ("load {llama} --as m --cpu-extra-buffers maybe", "argument --cpu-extra-buffers: invalid choice"),
    ("load {llama} --as m --context 0", "ConfigurationError: context must be in 1..65536"),
    ("load {llama} --as m --device metal --context 128", "DeviceUnavailableError"),
    ("load {llama} --as m --kv-cache-type q8_0 --flash-attention off", "needs flash attention"),
    ("load {no_template} --as m --context 128", "ChatTemplateError"),
    ("load {llama} --as m --chat-template nosuch --context 128", "ChatTemplateError"),
    ('load "{llama} --as m', "check the quotes"),
    ("load {llama} --as m --bogus 1", "unrecognized arguments: --bogus 1"),
    ("optimize nope --as f", "no handle named 'nope'; handles: base"),
    ("optimize x --as f", "'x' is a int, not a model handle"),
    ("optimize base --as f --prefix-cache-entries 99", "prefix_cache_entries must be in 0..16"),
    ("pool base --as p", "required: --max-idle"),
    ("batch base --as b", "required: --max-sequences"),
    ("adapter base --as a", "required: MANIFEST"),
    ("info", "required: NAME"),
    ("info nope", "no handle named 'nope'"),
    ("kv base --slots 0", "slots must be an integer >= 1"),
    ("kv base --kv-cache-type q9", "invalid choice"),
    ("kv base --context 0", "context must be an integer >= 1"),
    ("close", "name the handles to close, or give --all"),
    ("close base --all", "not both"),
    ("close base nope", "no handle named 'nope'"),
    ("help nope", "unknown topic 'nope'"),
]
LINE_ERRORS += [
    ("pool base --as p --max-idle 9", "max_idle must be in 0..4"),
    ("batch base --as b --max-sequences 0", "ConfigurationError"),
]

CELL_ERRORS = [
    ("generate", "", "hello", "required: NAME"),
    ("generate", "nope", "hello", "no handle named 'nope'"),
    ("generate", "base --max-tokens x", "hello", "argument --max-tokens: invalid int value"),
    ("generate", "base --temperature 5", "hello", "InvalidRequestError: temperature must be"),
    ("generate", "base --seed -1", "hello", "InvalidRequestError: seed must be"),
    ("generate", "base --max-tokens 100000", "hello", "max_tokens must be in 0..65536"),
    ("generate", "base --max-tokens 250", "hello " * 40, "ContextOverflowError"),
    ("generate", "base --as 1x", "hello", "--as '1x' is not a valid Python variable name"),
    ("generate", "base --stream --quiet", "hello", "not allowed with argument"),
    ("generate", "base", "  \n\n", "the cell body is the prompt, and it is empty"),
    ("generate", "x", "hello", "'x' is a int, not a model handle"),
    ("chat", "base --session 1x", "hello", "--session '1x' is not a valid Python variable name"),
    ("chat", "base --session x", "hello", "'x' is a int, not a chat session"),
    ("chat", "base --temperature -1", "hello", "InvalidRequestError"),
]


@pytest.fixture
def err_ip(ip, llama_path):
    load(ip, llama_path)
    ip.run_line_magic("config", "LLMMagics.default_to_latest = False")  # so a missing NAME is an error
    ip.user_ns["x"] = 5
    return ip


@pytest.mark.parametrize("line, message", LINE_ERRORS, ids=[e[0] for e in LINE_ERRORS])
def test_line_usage_errors_are_one_line(err_ip, err_paths, tmp_path, line, message):
    paths = {k: str(v) for k, v in err_paths.items()}
    paths["missing"] = str(tmp_path / "missing.gguf")
    with pytest.raises(UsageError) as info:
        err_ip.run_line_magic("llm", line.format(**paths))
    text = str(info.value)
    assert "\n" not in text
    import re

    assert re.search(message, text), text
    assert not err_ip.user_ns["base"].closed  # a rejected command leaves the handles alone
    assert "m" not in err_ip.user_ns and "f" not in err_ip.user_ns


@pytest.mark.parametrize("magic, line, body, message", CELL_ERRORS, ids=[f"{e[0]} {e[1]}" for e in CELL_ERRORS])
def test_cell_usage_errors_are_one_line(err_ip, magic, line, body, message):
    with pytest.raises(UsageError) as info:
        err_ip.run_cell_magic(magic, line, body)
    text = str(info.value)
    assert "\n" not in text and message in text, text
    assert err_ip.user_ns["base"].generate("ok", max_tokens=1).usage.completion_tokens <= 1  # still usable


def test_a_usage_error_in_a_cell_prints_one_line_without_traceback(err_ip, capsys):
    result = err_ip.run_cell("%llm load")
    assert isinstance(result.error_in_exec, UsageError)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "UsageError: %llm load: the following arguments are required: PATH" in text
    assert "Traceback" not in text
    result = err_ip.run_cell("%%generate base --temperature 5\nhello")  # the failed cell's frames hold `base`
    assert isinstance(result.error_in_exec, UsageError)
    assert not err_ip.user_ns["base"].closed  # ... but the namespace does too: not released


def test_chat_on_a_session_with_another_system_prompt_needs_new(ip, llama_path):
    load(ip, llama_path)
    run(ip, '%%chat base --system "Be brief." --max-tokens 2 --quiet\nhi')
    run(ip, '%%chat base --system "Be brief." --max-tokens 2 --quiet\nagain')  # re-running the cell is fine
    with pytest.raises(UsageError, match="another system prompt; add --new"):
        ip.run_cell_magic("chat", 'base --system "Be long."', "hi")
    run(ip, '%%chat base --system "Be long." --new --max-tokens 2 --quiet\nhi')
    assert ip.user_ns["base_chat"].messages[0]["content"] == "Be long."


# -- %%generate ------------------------------------------------------------------------------------
def test_interpolate_replaces_known_names_only():
    ns = {"evidence": "E=mc^2", "n": 3}
    assert interpolate("Summarize: {evidence} ({n})", ns) == "Summarize: E=mc^2 (3)"
    assert interpolate("{unknown} stays, {{evidence}} is literal", ns) == "{unknown} stays, {evidence} is literal"
    assert interpolate('json {"a": {n}} and {obj.attr} and { n }', ns) == 'json {"a": 3} and {obj.attr} and { n }'


def test_generate_interpolates_streams_and_stores_the_response(ip, llama_path):
    base = load(ip, llama_path)
    ip.user_ns["evidence"] = "the cat sat on the mat"
    run(ip, "%config LLMMagics.stream_interval = 0")
    with capture_output() as cap:
        run(ip, "%%generate base --max-tokens 12 --seed 7 --as answer\nSummarize: {evidence} {unknown}\n")
    response = ip.user_ns["answer"]
    assert ip.user_ns["_"] is response
    assert isinstance(response, llm.Response) and 1 <= response.usage.completion_tokens <= 12
    expected = base.prompt_tokens("Summarize: the cat sat on the mat {unknown}")
    assert response.usage.prompt_tokens == len(expected)
    assert response.text == base.generate("Summarize: the cat sat on the mat {unknown}", max_tokens=12).text

    outputs = cap.outputs
    display_id = outputs[0].transient["display_id"]
    assert not outputs[0].update
    assert all(o.update and o.transient["display_id"] == display_id for o in outputs[1:])  # ONE display
    assert "aner-response" in html_of(outputs[-1]) and "length" in html_of(outputs[-1])  # ends with timings
    streamed = [o for o in outputs[1:-1]]
    assert streamed and "aner-stream" in html_of(streamed[-1])
    assert streamed[-1].data["text/plain"].startswith(response.text[: len(response.text) // 2])


def test_stream_updates_are_throttled(ip, llama_path):
    load(ip, llama_path)
    run(ip, "%config LLMMagics.stream_interval = 3600")
    with capture_output() as cap:
        run(ip, "%%generate base --max-tokens 16\nhello")
    assert [o.update for o in cap.outputs] == [False, True]  # created, then replaced by the panel
    assert "aner-response" in html_of(cap.outputs[-1])

    ticks = iter([0.0, 0.05, 0.1, 0.12, 0.19, 0.25, 0.3])
    with capture_output() as cap:
        view = display_mod.UpdatingView(0.1, clock=lambda: next(ticks))
        view.start()
        for piece in "abcdef":
            view.add(piece)
    assert view.updates == 2  # at 0.1 and 0.25: at most one update per 0.1 s
    assert len(cap.outputs) == 1 + view.updates


def test_no_stream_and_quiet(ip, llama_path):
    load(ip, llama_path)
    with capture_output() as cap:
        run(ip, "%%generate base --max-tokens 4 --no-stream\nhello")
    assert len(cap.outputs) == 1 and not cap.outputs[0].update and "aner-response" in html_of(cap.outputs[0])
    with capture_output() as cap:
        run(ip, "%%generate base --max-tokens 4 --quiet --as r\nhello")
    assert cap.outputs == [] and ip.user_ns["r"] is ip.user_ns["_"]


def test_terminal_view_prints_pieces_then_a_timings_line(ip, llama_path):
    import io

    base = load(ip, llama_path)
    out = io.StringIO()
    view = display_mod.PrintView(stream=True, out=out)
    stream = base.stream("hello", max_tokens=6)
    view.start()
    for piece in stream:
        view.add(piece)
    view.finish(stream.response)
    text = out.getvalue()
    r = stream.response
    assert text.startswith(r.text) and f"[{r.finish_reason}] {r.usage.completion_tokens} tokens" in text
    assert "prefill" in text
    assert isinstance(display_mod.make_view("stream", interval=0.1, terminal=True), display_mod.PrintView)
    assert isinstance(display_mod.make_view("final", interval=0.1, terminal=False), display_mod.FinalView)


def test_ctrl_c_in_the_display_loop_cancels_and_keeps_the_handle(ip, llama_path, monkeypatch):
    base = load(ip, llama_path)
    ip.run_line_magic("config", "LLMMagics.on_interrupt = 'keep'")  # the cell ends normally (default: raise)
    calls = {"n": 0}
    real_add = display_mod.UpdatingView.add

    def interrupted_add(self, piece):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        real_add(self, piece)

    monkeypatch.setattr(display_mod.UpdatingView, "add", interrupted_add)
    with capture_output() as cap:
        result = ip.run_cell("%%generate base --max-tokens 40 --as r\nhello", store_history=False)
    assert result.success  # cancelled cleanly, no traceback
    response = ip.user_ns["r"]
    assert response.finish_reason == "cancelled" and response.usage.completion_tokens < 40
    assert "cancelled" in html_of(cap.outputs[-1])
    monkeypatch.undo()
    assert base.generate("again", max_tokens=3).finish_reason in ("length", "stop")  # not busy, not closed
    run(ip, "%%generate base --max-tokens 3 --quiet\nagain")


def test_ctrl_c_inside_the_engine_step_cancels_and_keeps_the_handle(ip, llama_path, monkeypatch):
    base = load(ip, llama_path)
    ip.run_line_magic("config", "LLMMagics.on_interrupt = 'keep'")  # the cell ends normally (default: raise)
    real_decode = _engine.NativeContext.decode
    calls = {"n": 0}

    def interrupted_decode(self, batch):
        calls["n"] += 1
        if calls["n"] == 4:  # prefill, then a few decode steps, then the user presses Ctrl-C
            raise KeyboardInterrupt
        return real_decode(self, batch)

    monkeypatch.setattr(_engine.NativeContext, "decode", interrupted_decode)
    with capture_output() as cap:
        result = ip.run_cell("%%generate base --max-tokens 40\nhello", store_history=False)
    monkeypatch.undo()
    assert result.success
    assert ip.user_ns["_"].finish_reason == "cancelled"
    assert "cancelled" in html_of(cap.outputs[-1])
    assert [o.update for o in cap.outputs].count(False) == 1
    run(ip, "%%generate base --max-tokens 3 --quiet\nagain")
    assert ip.user_ns["_"].finish_reason in ("length", "stop")
    assert not base.closed


def test_ctrl_c_in_a_chat_turn_keeps_the_session(ip, llama_path, monkeypatch):
    load(ip, llama_path)
    ip.run_line_magic("config", "LLMMagics.on_interrupt = 'keep'")  # the cell ends normally (default: raise)
    run(ip, "%%chat base --max-tokens 3 --quiet\nfirst")
    real_decode = _engine.NativeContext.decode
    calls = {"n": 0}

    def interrupted_decode(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_decode(self, batch)

    monkeypatch.setattr(_engine.NativeContext, "decode", interrupted_decode)
    run(ip, "%%chat base --max-tokens 30 --quiet\nsecond")
    monkeypatch.undo()
    assert ip.user_ns["_"].finish_reason == "cancelled"
    run(ip, "%%chat base --max-tokens 3 --quiet\nthird")
    session = ip.user_ns["base_chat"]
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["first", "third"]


# -- %%chat -----------------------------------------------------------------------------------------------
def test_chat_keeps_a_session_across_cells(ip, llama_path):
    load(ip, llama_path)
    run(ip, "%%chat base --max-tokens 4 --no-stream --as first\nHello there")
    session = ip.user_ns["base_chat"]
    assert isinstance(session, llm.Session)
    run(ip, "%%chat base --max-tokens 4 --quiet\nAnd again")
    second = ip.user_ns["_"]
    assert ip.user_ns["base_chat"] is session
    assert second.usage.cached_input_tokens > 0  # the history stayed in the session's KV
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    run(ip, "%%chat base_chat --max-tokens 2 --quiet\nDirectly to the session")
    assert len(session.messages) == 6
    run(ip, "%%chat base --session other --max-tokens 2 --quiet\nA second conversation")
    assert ip.user_ns["other"] is not session and len(ip.user_ns["other"].messages) == 2
    run(ip, "%%chat base --new --max-tokens 2 --quiet\nStart over")
    assert session.closed and len(ip.user_ns["base_chat"].messages) == 2


# -- handle lifetime ------------------------------------------------------------------------------------------
def test_reset_releases_the_weights(ip, llama_path):
    load(ip, llama_path)
    run(ip, "%%chat base --max-tokens 2 --quiet\nhi")
    run(ip, "base", history=True)  # displayed: IPython's Out/_ now reference the lease too
    native = native_of(ip, "base")
    assert native.free_calls == 0
    run(ip, "%reset -f", history=True)
    assert native.free_calls == 1 and not native.alive
    assert len(ext_of(ip).handles) == 0


def test_del_releases_even_a_displayed_handle(ip, llama_path):
    load(ip, llama_path)
    run(ip, "base", history=True)
    run(ip, "base", history=True)
    native = native_of(ip, "base")
    assert any(v is ip.user_ns["base"] for v in ip.user_ns["_oh"].values())
    run(ip, "del base", history=True)
    assert native.free_calls == 1 and not native.alive


def test_overwriting_a_name_releases_the_old_handle(ip, llama_path):
    load(ip, llama_path)
    native = native_of(ip, "base")
    run(ip, "base = 'something else'")
    assert native.free_calls == 1


def test_a_handle_kept_elsewhere_survives_del(ip, llama_path):
    load(ip, llama_path)
    native = native_of(ip, "base")
    run(ip, "keep = [base]\ndel base")
    assert native.free_calls == 0 and not ip.user_ns["keep"][0].closed
    run(ip, "del keep")
    gc.collect()
    assert native.free_calls == 1


def test_rerunning_a_load_cell_does_not_leak(ip, llama_path):
    load(ip, llama_path)
    run(ip, "%%chat base --max-tokens 2 --quiet\nhi")
    first, first_session = native_of(ip, "base"), ip.user_ns["base_chat"]
    load(ip, llama_path)  # the same cell again
    assert first.free_calls == 1 and not first.alive  # the old lease and its session were closed first
    assert first_session.closed
    run(ip, "%%chat base --max-tokens 2 --quiet\nhi")  # a fresh session on the new lease
    assert not ip.user_ns["base_chat"].closed and ip.user_ns["base_chat"] is not first_session
    names = ip.run_line_magic("llm", "list").query("state == 'open'")["name"].tolist()
    assert sorted(names) == ["base", "base_chat"]


def test_rerunning_a_notebook_with_derived_leases_does_not_leak(ip, llama_path):
    load(ip, llama_path)
    run(ip, "%llm optimize base --as fast --speculative-tokens 2")
    first = native_of(ip, "base")
    load(ip, llama_path)
    assert first.alive  # `fast` still uses the old weights
    run(ip, "%llm optimize base --as fast --speculative-tokens 2")
    assert first.free_calls == 1 and not first.alive


def test_a_failed_cell_releases_handles_only_its_traceback_holds(ip, llama_path):
    ip.user_ns.update(llm=llm, natives=[], keep=[])
    cell = (
        "def make(keep_it):\n"
        f"    m = llm.load(r'{llama_path}', context=128)\n"
        "    natives.append(m._weights.native)\n"
        "    if keep_it:\n"
        "        keep.append(m)\n"
        "    raise RuntimeError('boom')\n"
    )
    run(ip, cell)
    result = ip.run_cell("make(False)")
    assert isinstance(result.error_in_exec, RuntimeError)
    lost = ip.user_ns["natives"][0]
    assert lost.free_calls == 1  # only the traceback referenced it: closed
    result = ip.run_cell("make(True)")
    kept = ip.user_ns["natives"][1]
    assert kept.free_calls == 0 and not ip.user_ns["keep"][0].closed  # still the user's


def test_python_api_handles_are_adopted_and_closed_with_the_rest(ip, llama_path):
    ip.user_ns["llm"] = llm
    run(ip, f"m = llm.load(r'{llama_path}', context=128)")
    assert ip.user_ns["m"] in list(ext_of(ip).handles)
    assert ext_of(ip).handles.close_all() == 1 and ip.user_ns["m"].closed


# -- a real kernel ---------------------------------------------------------------------------------------------
def test_real_kernel_streams_into_one_display(llama_path):
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        reply, _ = execute(kc, "%load_ext aner_nb")
        assert reply["status"] == "ok"
        reply, msgs = execute(kc, f"%llm load {llama_path} --as base --context {CTX}")
        assert reply["status"] == "ok", reply
        assert any(m["msg_type"] == "stream" and "base = <LLMModel" in m["content"]["text"] for m in msgs)
        reply, msgs = execute(kc, "%config LLMMagics.stream_interval = 0")
        reply, msgs = execute(kc, "word = 'cat'\n")
        reply, msgs = execute(kc, "%%generate base --max-tokens 12\nSay {word}")
        assert reply["status"] == "ok", reply
        shown = [m for m in msgs if m["msg_type"] in ("display_data", "update_display_data")]
        assert shown[0]["msg_type"] == "display_data"
        display_id = shown[0]["content"]["transient"]["display_id"]
        assert all(m["msg_type"] == "update_display_data" for m in shown[1:]) and len(shown) >= 2
        assert {m["content"]["transient"]["display_id"] for m in shown} == {display_id}
        assert "aner-response" in shown[-1]["content"]["data"]["text/html"]
        assert not any(m["msg_type"] == "error" for m in msgs)
        reply, msgs = execute(kc, "print(_.finish_reason, _.usage.completion_tokens)")
        out = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")
        assert out.split()[0] in ("length", "stop")
        reply, msgs = execute(kc, "%llm lod")
        assert reply["status"] == "error" and reply["ename"] == "UsageError", (reply, msgs)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_save_and_resume_a_chat_in_the_shell(ip, llama_path, tmp_path):
    load(ip, llama_path)
    run(ip, "%%chat base --max-tokens 4 --quiet\nHello there")
    state = tmp_path / "chat.kvs"
    with capture_output() as cap:
        run(ip, f"%llm save base {state}")
    assert "saved 1 turn(s)" in cap.stdout and state.exists()
    run(ip, "%%chat base --max-tokens 6 --quiet\nAnd again")
    want = ip.user_ns["_"]
    run(ip, f"%%chat base --session again --resume {state} --max-tokens 6 --quiet\nAnd again")
    got = ip.user_ns["_"]
    assert got.tokens == want.tokens and got.usage.cached_input_tokens == want.usage.cached_input_tokens > 0
    run(ip, f"%llm save again {tmp_path / 'again.kvs'}")  # NAME may be the session itself
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(UsageError, match="cannot resume .*: truncated: "):
        run(ip, f"%%chat base --resume {state} --quiet\nhi")
    with pytest.raises(UsageError, match="cannot be combined"):
        run(ip, f"%%chat base --resume {state} --new --quiet\nhi")
    with pytest.raises(UsageError, match="no chat session in 'nothing'"):
        run(ip, f"%llm save base {state} --session nothing")


def test_real_kernel_chat_saved_restarted_resumed(llama_path, tmp_path):
    """A %%chat conversation saved, the kernel restarted, resumed: the next answer is the uninterrupted one."""
    from jupyter_client.manager import start_new_kernel

    state = tmp_path / "conversation.kvs"
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        setup = f"%load_ext aner_nb\n%llm load {llama_path} --as base --context {CTX}"
        for code in (setup, "%%chat base --max-tokens 5 --quiet\nHello there", f"%llm save base {state}",
                     "%%chat base --max-tokens 8 --quiet\nAnd again", "want = list(_.tokens)"):
            reply, msgs = execute(kc, code)
            assert reply["status"] == "ok", (code, reply)
        reply, msgs = execute(kc, "print(want)")
        want = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream").strip()
        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=60)
        for code in (setup, f"%%chat base --resume {state} --max-tokens 8 --quiet\nAnd again",
                     "got = list(_.tokens); cached = _.usage.cached_input_tokens"):
            reply, msgs = execute(kc, code)
            assert reply["status"] == "ok", (code, reply)
        reply, msgs = execute(kc, "print(got, cached > 0, 'want' in dir())")
        out = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream").strip()
        assert out == f"{want} True False"  # same tokens, the saved KV reused, and it was a new kernel
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# -- the demo model ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_path():
    from aner_nb.demo_model import gemma_model_path

    return gemma_model_path()


@pytest.mark.demo
def test_demo_reset_releases_weights_and_rss(ip, demo_path):
    import psutil

    run(ip, f"%llm load {demo_path} --as base --context 512 --chat-template gemma")
    run(ip, "%%generate base --max-tokens 2 --quiet\nHi")  # touch the weights
    native = native_of(ip, "base")
    gc.collect()
    before = psutil.Process().memory_info().rss
    run(ip, "%reset -f", history=True)
    after = psutil.Process().memory_info().rss
    assert native.free_calls == 1 and not native.alive
    assert before - after > 100 * 2**20, (before, after)  # the mapped weights (~250 MB touched) left the process


@pytest.mark.demo
def test_demo_a_user_writes(ip, demo_path):
    """DESIGN.md's "A user writes" example, with the demo model (its Gemma template passed explicitly)."""
    ip.user_ns["demo"] = str(demo_path)
    ip.user_ns["evidence"] = (
        "Ada Lovelace published the first algorithm for Charles Babbage's Analytical Engine in 1843, "
        "in her notes on Luigi Menabrea's memoir."
    )
    run(ip, "%llm load {demo} --as base --context 4096 --chat-template gemma")
    run(ip, "%llm optimize base --as fast --prefix-cache-entries 1 --speculative-tokens 6")
    with capture_output() as cap:
        run(ip, "%%generate fast --max-tokens 16 --seed 7\n"
                "Summarize the evidence below using its original names and terms: {evidence}")
    response = ip.user_ns["_"]
    assert response.usage.completion_tokens >= 1 and response.timings.prompt_tokens > 30
    assert "aner-response" in html_of(cap.outputs[-1])
    assert len({o.transient["display_id"] for o in cap.outputs}) == 1
    assert response.timings.speculative_tokens == 6
    kv = ip.run_line_magic("llm", "kv base")
    assert kv.set_index("kv_cache_type").loc["f16", "total_bytes"] > 0


def test_generate_raw_and_sampling_flags_reach_the_library(ip, llama_path):
    """%%generate --raw continues the text without the template; sampling flags are the library's options."""
    load(ip, llama_path)
    model = ip.user_ns["base"]
    ip.run_cell_magic("generate", "base --raw --quiet --max-tokens 6 --as r1", "the cat")
    assert ip.user_ns["r1"].tokens == model.complete("the cat", max_tokens=6).tokens
    ip.run_cell_magic("generate", "base --quiet --max-tokens 6 --temperature 1 --top-k 1 --seed 4 --as r2", "the cat")
    assert ip.user_ns["r2"].tokens == model.generate("the cat", max_tokens=6).tokens  # top_k=1 is greedy
    ip.user_ns["yes_no"] = 'root ::= "yes" | "no"'
    ip.run_cell_magic("generate", "base --quiet --max-tokens 4 --grammar yes_no --as r3", "answer")
    assert ip.user_ns["r3"].text in ("yes", "no")
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    ip.run_cell_magic("generate", f"base --quiet --max-tokens 30 --json-schema '{schema}' --as r4", "json")
    assert ip.user_ns["r4"].text.replace(" ", "") in ('{"ok":true}', '{"ok":false}')
    with pytest.raises(UsageError, match="top_p must be"):
        ip.run_cell_magic("generate", "base --quiet --top-p 3", "x")
    with pytest.raises(UsageError, match="--grammar"):
        ip.run_cell_magic("generate", "base --quiet --grammar missing_var", "x")
    for inline in ("{not json", "[" * 5000):  # the second is nested deeper than the JSON parser recurses
        with pytest.raises(UsageError, match="--json-schema takes inline JSON"):
            ip.run_cell_magic("generate", f"base --quiet --json-schema '{inline}'", "x")
