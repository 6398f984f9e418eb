"""``session.save(path)`` and ``model.session(resume=path)``: a conversation survives a kernel restart.

The oracle is the uninterrupted session: the resumed session, in a fresh process
(a new kernel), must give the same next answer token for token, reusing the saved
KV (its turn evaluates only the new part). Files that do not match raise
``StateMismatchError`` naming the reason, never a silent cold start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aner_nb import llm
from aner_nb.demo_model import demo_model_path, gemma_model_path
from aner_nb.llm import kv_identity, session as session_module
from aner_nb.llm.errors import ConfigurationError, StateMismatchError
from test_adapters import make_manifest  # a LoRA adapter of the tiny llama and its manifest

CTX = 1024

RESUME = textwrap.dedent("""
    import json, sys
    from aner_nb import llm
    args = json.loads(sys.argv[1])
    with llm.load(args["model"], **args["load"]) as model:
        with model.session(resume=args["state"]) as s:
            before = [dict(m) for m in s.messages]
            r = s.send(args["turn"], max_tokens=args["max_tokens"])
            print(json.dumps({"tokens": list(r.tokens), "text": r.text, "cached": r.usage.cached_input_tokens,
                              "messages": before}))
""")


def resumed_in_a_new_process(model: Path, load: dict, state: Path, turn: str, max_tokens: int) -> dict:
    args = {"model": str(model), "load": load, "state": str(state), "turn": turn, "max_tokens": max_tokens}
    env = {**os.environ, "ANER_NB_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", RESUME, json.dumps(args)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_resume_equals_uninterrupted(path: Path, load: dict, tmp_path: Path, turns: list[str], *, system=None,
                                      max_tokens: int = 12) -> None:
    state = tmp_path / "chat.kvs"
    with llm.load(path, **load) as model:
        with model.session(system=system) as s:
            for turn in turns[:-1]:
                s.send(turn, max_tokens=max_tokens)
            assert s.save(state) == state
            history = [dict(m) for m in s.messages]
            want = s.send(turns[-1], max_tokens=max_tokens)  # the uninterrupted session's next answer
    got = resumed_in_a_new_process(path, load, state, turns[-1], max_tokens)
    assert got["messages"] == history
    assert got["tokens"] == list(want.tokens) and got["text"] == want.text
    assert len(want.tokens) > 0
    # the resumed turn reused the saved KV exactly as the uninterrupted one did (not a cold start)
    assert got["cached"] == want.usage.cached_input_tokens > 0


def test_resume_on_the_tiny_llama_equals_the_uninterrupted_session(llama_path, tmp_path, one_thread):
    check_resume_equals_uninterrupted(llama_path, {"context": CTX}, tmp_path, ["hello there", "and again", "more"],
                                      system="be brief")


def test_resume_on_the_tiny_gemma3_equals_the_uninterrupted_session(fixture_models, tmp_path, one_thread):
    turns = ["the quick brown fox " * 6, "jumps over the lazy dog " * 6, "and again"]
    check_resume_equals_uninterrupted(fixture_models["gemma3"], {"context": CTX}, tmp_path, turns)


@pytest.mark.demo
def test_resume_on_smollm2_equals_the_uninterrupted_session(tmp_path, one_thread):
    turns = ["Name three colours.", "Which of them is the colour of the sky?"]
    check_resume_equals_uninterrupted(demo_model_path(), {"context": 2048}, tmp_path, turns,
                                      system="You are a helpful assistant.", max_tokens=16)


@pytest.mark.demo
def test_resume_on_gemma_past_its_sliding_window_equals_the_uninterrupted_session(tmp_path, one_thread):
    # 512-token window: the history is longer, so the saved state holds only the window's cells of the SWA layers
    evidence = " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(70))
    turns = [f"Read this list: {evidence}", "Where is item 12 stored?"]
    check_resume_equals_uninterrupted(gemma_model_path(), {"context": 2048, "chat_template": "gemma"}, tmp_path,
                                      turns, max_tokens=12)


def test_save_before_any_turn_and_resume_keeps_the_system_message(llama_path, tmp_path, one_thread):
    state = tmp_path / "empty.kvs"
    with llm.load(llama_path, context=CTX) as model:
        with model.session(system="be brief") as s:
            s.save(state)
        with model.session(resume=state) as s:
            assert s.messages == ({"role": "system", "content": "be brief"},) and s.cached_tokens == 0
            got = s.send("hello", max_tokens=6)
        with model.session(system="be brief") as s:
            want = s.send("hello", max_tokens=6)
        assert got.tokens == want.tokens
        with pytest.raises(ConfigurationError) as info:
            model.session(system="x", resume=state)
        assert info.value.param == "system"


def _saved(model, tmp_path: Path, name: str = "chat.kvs") -> Path:
    state = tmp_path / name
    with model.session(system="be brief") as s:
        s.send("hello", max_tokens=4)
        s.save(state)
    return state


def _reason(model, state: Path) -> str:
    with pytest.raises(StateMismatchError) as info:
        model.session(resume=state)
    return info.value.reason


def test_mismatched_files_raise_the_reason_and_leak_no_context(llama_path, qwen2_path, tmp_path, one_thread,
                                                               monkeypatch):
    with llm.load(llama_path, context=CTX) as model:
        state = _saved(model, tmp_path)
        data = state.read_bytes()
        natives = model._weights.native.live_contexts()

        with llm.load(qwen2_path, context=CTX) as other:
            assert _reason(other, state) == "foreign_model"
        with llm.load(llama_path, context=CTX // 2) as smaller:
            assert _reason(smaller, state) == "layout"
        with llm.load(llama_path, context=CTX, kv_cache_type="q8_0", flash_attention="on") as quantized:
            assert _reason(quantized, state) == "foreign_kv_type"
        with model.with_adapter(make_manifest(tmp_path / "lora", model)) as tuned:
            assert _reason(tuned, state) == "foreign_adapter"  # saved without the adapter, resumed with it
            tuned_state = _saved(tuned, tmp_path, "tuned.kvs")
            with tuned.session(resume=tuned_state) as s:
                assert s.cached_tokens > 0
        assert _reason(model, tuned_state) == "foreign_adapter"  # and the other way round

        (tmp_path / "cut.kvs").write_bytes(data[: len(data) // 2])
        assert _reason(model, tmp_path / "cut.kvs") == "truncated"
        flipped = bytearray(data)
        flipped[-10] ^= 1
        (tmp_path / "flip.kvs").write_bytes(bytes(flipped))
        assert _reason(model, tmp_path / "flip.kvs") == "corrupt"

        monkeypatch.setattr(session_module, "engine_build", lambda: "llama-cpp-python 9.9.9")
        assert _reason(model, state) == "foreign_build"
        monkeypatch.undo()

        # a valid state file that is not a session: corrupt, nothing loaded
        s = model.session()
        identity = s._identity()
        s.close()
        (tmp_path / "prefix.kvs").write_bytes(kv_identity.pack(identity, [1, 2], b"x", meta={"kind": "prefix"}))
        assert _reason(model, tmp_path / "prefix.kvs") == "corrupt"
        assert model._weights.native.live_contexts() == natives  # every refused resume freed its context
        with pytest.raises(FileNotFoundError):
            model.session(resume=tmp_path / "missing.kvs")

        # and the good file still resumes
        with model.session(resume=state) as s:
            assert s.cached_tokens > 0 and [m["role"] for m in s.messages] == ["system", "user", "assistant"]


def test_save_is_refused_while_a_turn_runs(llama_path, tmp_path, one_thread):
    with llm.load(llama_path, context=CTX) as model:
        with model.session() as s:
            stream = s.stream("hello", max_tokens=8)
            next(iter(stream))
            with pytest.raises(llm.errors.BusyError):
                s.save(tmp_path / "busy.kvs")
            stream.cancel()
            list(stream)
            s.save(tmp_path / "after.kvs")
        with pytest.raises(llm.errors.ClosedError):
            s.save(tmp_path / "closed.kvs")


def test_a_state_llama_cpp_refuses_is_a_layout_mismatch_and_frees_the_context(llama_path, tmp_path, one_thread,
                                                                              monkeypatch):
    with llm.load(llama_path, context=CTX) as model:
        state = _saved(model, tmp_path)
        natives = model._weights.native.live_contexts()

        def refuse(self, seq, data):
            raise llm.errors.EngineError("llama.cpp refused 123 state bytes for sequence 0 (read 0)")

        monkeypatch.setattr(session_module.NativeContext, "seq_state_load", refuse)
        with pytest.raises(StateMismatchError) as info:
            model.session(resume=state)
        assert info.value.reason == "layout" and "refused" in str(info.value)
        assert model._weights.native.live_contexts() == natives
        monkeypatch.undo()
        with model.session(resume=state) as s:
            want = model.chat(list(s.messages) + [{"role": "user", "content": "next"}], max_tokens=6)
            assert s.send("next", max_tokens=6).tokens == want.tokens  # the same answer as a fresh chat
