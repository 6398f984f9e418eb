"""``aner-nb serve``: options checked before the model is read, environment defaults, version, start-up lines."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import httpx
import pytest

from aner_nb import llm
from aner_nb.api import cli
from fixtures.models import write_tiny_model


def serve(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "aner_nb", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture
def never_load(monkeypatch):
    """Make reading the model a test failure: whatever is checked must be checked before it."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(llm, "load", load)


@pytest.mark.parametrize("args, message", [
    (["--port", "99999"], "--port: expected an integer in 0..65535"),
    (["--kv-cache-type", "q9"], "--kv-cache-type: invalid choice"),
    (["--kv-cache-type", "q8_0", "--flash-attention", "off"], "needs flash attention"),
    (["--device", "tpu"], "device must be one of"),
    (["--max-sequences", "0"], "--max-sequences: expected an integer"),
    (["--context", "2", "--max-sequences", "4"], "--max-sequences 4 must be <= --context 2"),
    (["--sse-keepalive", "-1"], "--sse-keepalive: expected seconds"),
    (["--cors-origin", "ftp://x"], "CORS origin"),
    (["--log-level", "loud"], "--log-level: invalid choice"),
    (["--threads", "999"], "--threads: expected an integer"),
    (["--api-key-env", "ANER_NB_TEST_UNSET"], "ANER_NB_TEST_UNSET is unset or empty"),
    (["--chat-template", "no-such-template"], "unknown chat template"),
    (["--device", "metal" if sys.platform != "darwin" else "cuda:1"], "device="),
])
def test_bad_options_fail_before_the_model_is_read(llama_path, never_load, capsys, args, message):
    with pytest.raises(SystemExit) as ended:  # argparse exits on a bad value; the later checks return 2
        raise SystemExit(cli.main([str(llama_path), *args]))
    assert ended.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_model_file_and_bad_environment_defaults(tmp_path, never_load, capsys, monkeypatch):
    assert cli.main([str(tmp_path / "nope.gguf")]) == 2
    assert "no such file" in capsys.readouterr().err
    monkeypatch.setenv("ANER_NB_PORT", "eleven")
    with pytest.raises(SystemExit) as ended:
        cli.main([str(tmp_path / "nope.gguf")])
    assert ended.value.code == 2 and "ANER_NB_PORT (for --port)" in capsys.readouterr().err
    monkeypatch.delenv("ANER_NB_PORT")
    monkeypatch.setenv("ANER_NB_KV_CACHE_TYPE", "q7")
    with pytest.raises(SystemExit):
        cli.main([str(tmp_path / "nope.gguf")])
    assert "ANER_NB_KV_CACHE_TYPE (for --kv-cache-type): invalid choice 'q7'" in capsys.readouterr().err


def test_environment_defaults_and_the_command_line_wins(monkeypatch):
    for name, value in {"ANER_NB_MODEL": "m.gguf", "ANER_NB_PORT": "9000", "ANER_NB_CORS_ORIGIN": "http://a, http://b",
                        "ANER_NB_ACCESS_LOG": "yes", "ANER_NB_SSE_KEEPALIVE": "2.5", "ANER_NB_DEVICE": "cpu"}.items():
        monkeypatch.setenv(name, value)
    p = cli.parser()
    args = cli.resolve(p, p.parse_args(["--port", "9001", "--no-access-log"]))
    assert (args.model, args.port, args.access_log, args.sse_keepalive) == ("m.gguf", 9001, False, 2.5)
    assert args.cors_origin == ["http://a", "http://b"] and args.device == "cpu"
    assert args.max_output_tokens == cli.DEFAULT_OUTPUT_TOKENS and args.kv_cache_type == "f16"  # the defaults
    assert (args.context, args.max_messages, args.max_body_bytes) == (0, 256, 4 << 20)
    help_text = p.format_help()
    assert all(option.env in help_text for option in cli.OPTIONS)


def test_speculative_tokens_reach_the_batching_lease(llama_path, monkeypatch):
    p = cli.parser()
    assert cli.resolve(p, p.parse_args(["m.gguf", "--speculative-tokens", "16"])).speculative_tokens == 16
    with pytest.raises(SystemExit):
        cli.resolve(p, p.parse_args(["m.gguf", "--speculative-tokens", "65"]))
    args = cli.resolve(p, p.parse_args([str(llama_path), "--speculative-tokens", "4", "--max-sequences", "2"]))
    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(self, **kwargs):
        seen["speculative"] = kwargs["model"].supports("speculative")
        raise Stop

    builder, _ = cli.check(args)
    monkeypatch.setattr(type(builder), "llm", fake_llm)
    with llm.load(llama_path, context=512) as base, pytest.raises(Stop):
        cli._serve(builder, base, args)
    assert seen == {"speculative": True}


def test_a_bad_option_fails_fast_in_a_fresh_process(tmp_path):
    # The model path is a FIFO with no writer: opening it to read (hashing, inspecting, loading) would
    # block the process until serve()'s 60-s hang guard. Returning at all, with the option error,
    # shows that the bad option ended the process before the model was read.
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    result = serve(str(fifo), "--port", "70000")
    assert result.returncode == 2 and "--port" in result.stderr
    version = serve("--version")
    assert version.returncode == 0 and re.match(r"aner-nb \d+\.\d+", version.stdout)


def test_start_prints_url_fingerprint_and_context_and_serves_cors(llama_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "aner_nb", "serve", str(llama_path), "--port", "0", "--context", "512",
         "--max-sequences", "2", "--max-tokens", "4", "--threads", "1", "--cors-origin", "http://nb.example",
         "--log-level", "info", "--access-log", "--cpu-extra-buffers", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        match = re.search(r"at (http://127\.0\.0\.1:\d+)", lines[0])
        assert match, (lines, proc.stderr.read() if proc.poll() is not None else "")
        digest = hashlib.sha256(llama_path.read_bytes()).hexdigest()
        assert digest in lines[1] and "256 tokens per sequence x 2 sequences" in lines[2], lines
        r = httpx.get(f"{match.group(1)}/health", headers={"origin": "http://nb.example"}, timeout=5)
        assert r.headers["access-control-allow-origin"] == "http://nb.example"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read()
        proc.stdout.close()
        proc.stderr.close()
    assert '"GET /health HTTP/1.1" 200' in out  # --access-log: uvicorn's access lines go to stdout


def test_context_0_gives_each_sequence_its_share_of_the_declared_context(llama_path, tmp_path):
    declared = llm.inspect_model(llama_path).context_length
    assert cli.auto_context(str(llama_path), 4) == min(declared, cli.AUTO_CONTEXT_CAP)
    long = write_tiny_model(tmp_path / "long.gguf", n_ctx_train=cli.AUTO_CONTEXT_CAP * 2)
    assert cli.auto_context(str(long), 4) == cli.AUTO_CONTEXT_CAP  # a long-context model is capped


def test_chat_client_limits_come_from_flags(llama_path):
    p = cli.parser()
    args = cli.resolve(p, p.parse_args([str(llama_path), "--max-output-tokens", "77", "--max-messages", "3",
                                        "--max-body-bytes", "4096"]))
    builder, _ = cli.check(args)
    assert (builder.max_tokens, builder.max_rows, builder.max_body_bytes) == (77, 3, 4096)
    old = cli.resolve(p, p.parse_args([str(llama_path), "--max-tokens", "9"]))  # the earlier spelling
    assert old.max_output_tokens == 9
