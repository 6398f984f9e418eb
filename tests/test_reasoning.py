"""Reasoning models: ``chat_template_kwargs`` reach the template, thinking text is kept apart from the answer.

The Qwen3-style fixture template (``fixtures/tool_templates.py``) writes an empty thinking span into the
generation prompt when ``enable_thinking`` is false. The fixture's random weights never write ``<think>`` by
themselves, so an answer with a thinking span is produced through a grammar (the splitting is what is
tested, on text the engine really generated, token by token and streamed).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from IPython.utils.capture import capture_output

from aner_nb import llm
from aner_nb.llm.errors import InvalidRequestError
from aner_nb.llm.reasoning import THINK, ReasoningSplitter, split_reasoning, starts_inside, thinking_markers
from fixtures.leases import one_thread_lease
from fixtures.tool_templates import QWEN3_TOOLS, write_qwen3_tools_model

THOUGHT = 'root ::= "<think>\\nthe user says hi\\n</think>\\n\\n" [a-z]{3,6}'
PLAIN = 'root ::= [a-z]{3,6}'
ASK = [{"role": "user", "content": "hi"}]


# -- pure splitting ----------------------------------------------------------------------------------
def test_markers_come_from_the_template():
    assert thinking_markers(QWEN3_TOOLS) == THINK
    assert thinking_markers("{{ messages }}") is None
    assert thinking_markers("{{ messages }}", lambda text: text in ("<think>", "</think>")) == THINK


@pytest.mark.parametrize("text, inside, content, reasoning", [
    ("<think>\nsteps\n</think>\n\nAnswer.", False, "Answer.", "steps"),
    ("  <think>a</think>b", False, "b", "a"),
    ("Answer only.", False, "Answer only.", None),
    ("steps</think>\nAnswer", True, "Answer", "steps"),
    ("<think>\nunfinished", False, "", "unfinished"),
    ("<think></think>Answer", False, "Answer", ""),
    ("a <think> in the middle", False, "a <think> in the middle", None),
])
def test_split_reasoning(text, inside, content, reasoning):
    assert split_reasoning(text, THINK, inside) == (content, reasoning)


def test_a_prompt_that_opened_the_span_starts_inside():
    assert starts_inside("<|im_start|>assistant\n<think>\n", THINK)
    assert not starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)


@settings(max_examples=80, deadline=None)
@given(thought=st.text(alphabet="ab <>/\n", max_size=15), answer=st.text(alphabet="ab <>/\n", max_size=15),
       cut=st.integers(1, 6), wrapped=st.booleans())
def test_streamed_split_equals_the_whole_split(thought, answer, cut, wrapped):
    text = f"<think>{thought}</think>{answer}" if wrapped else answer
    splitter = ReasoningSplitter(THINK)
    parts = []
    for at in range(0, len(text), cut):
        parts += splitter.feed(text[at:at + cut])
    parts += splitter.finish()
    content, reasoning = split_reasoning(text, THINK)
    assert "".join(t for c, t in parts if c == "content") == content
    assert "".join(t for c, t in parts if c == "reasoning") == (reasoning or "")


# -- the library -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    with one_thread_lease(write_qwen3_tools_model(tmp_path_factory.mktemp("qwen3-think") / "qwen3-think.gguf"),
                          1024) as model:
        yield model


def test_template_kwargs_reach_the_template(qwen3):
    on = qwen3.prompt_tokens(ASK)
    off = qwen3.prompt_tokens(ASK, chat_template_kwargs={"enable_thinking": False})
    think = qwen3.prompt_tokens("<think>\n\n</think>\n\n", raw=True)
    assert off[:len(on)] == on and len(off) > len(on)
    assert off[len(on):] == think[len(think) - (len(off) - len(on)):]
    with pytest.raises(InvalidRequestError) as caught:
        qwen3.chat(ASK, chat_template_kwargs={"messages": []})
    assert caught.value.param == "chat_template_kwargs.messages"


def test_reasoning_is_separated_with_thinking_on(qwen3):
    r = qwen3.chat(ASK, grammar=THOUGHT, max_tokens=40)
    assert r.reasoning == "the user says hi"
    assert r.text and "<think>" not in r.text and "</think>" not in r.text
    assert r.finish_reason == "stop"
    assert "aner-reasoning" in r._repr_html_()


def test_thinking_off_yields_no_reasoning(qwen3):
    r = qwen3.chat(ASK, grammar=PLAIN, max_tokens=10, chat_template_kwargs={"enable_thinking": False})
    assert r.reasoning is None and r.text
    assert "aner-reasoning" not in r._repr_html_()


def test_a_stream_yields_the_raw_text_and_ends_with_the_split(qwen3):
    stream = qwen3.stream(ASK, grammar=THOUGHT, max_tokens=40)
    raw = "".join(stream)
    assert raw.startswith("<think>") and stream.response.reasoning == "the user says hi"
    assert raw.endswith(stream.response.text)


def test_a_session_keeps_the_content_without_reasoning(qwen3):
    session = qwen3.session()
    try:
        r = session.send("hi", grammar=THOUGHT, max_tokens=40)
        assert r.reasoning == "the user says hi"
        assert session.messages[-1] == {"role": "assistant", "content": r.text}
        session.send("again", grammar=PLAIN, max_tokens=6)
    finally:
        session.close()


def test_a_streaming_view_shows_the_thinking_apart_as_it_comes(qwen3):
    from aner_nb.llm.output import OutputSplitter
    from aner_nb.magics.display import UpdatingView

    stream = qwen3.stream(ASK, grammar=THOUGHT, max_tokens=40)
    view = UpdatingView(0.0)
    view.splitter = OutputSplitter(stream.output_format)
    updates = []

    class Handle:
        def update(self, data, raw=False):
            updates.append(data)

    view._handle = Handle()
    for piece in stream:
        view.add(piece)
    assert "".join(view.thought) == stream.response.reasoning
    assert "<think>" not in view.text and stream.response.text.startswith(view.text)
    assert any("aner-reasoning" in u["text/html"] for u in updates if isinstance(u, dict))


# -- the magics ----------------------------------------------------------------------------------------
def _html(cap) -> str:
    return "".join(o.data.get("text/html", "") for o in cap.outputs)


def test_magics_show_reasoning_collapsed_above_the_answer(ip, qwen3):
    """Runs last here: the shell's teardown closes the handles in its namespace."""
    ip.user_ns["q3"] = qwen3
    ip.user_ns["thought"] = THOUGHT
    ip.user_ns["plain"] = PLAIN
    with capture_output() as cap:
        ip.run_cell_magic("generate", "q3 --no-stream --max-tokens 40 --grammar thought --as r1", "hi")
    shown = _html(cap)
    r1 = ip.user_ns["r1"]
    assert r1.reasoning == "the user says hi"
    assert "<details class='aner-reasoning'>" in shown and shown.index("aner-reasoning") < shown.index(r1.text)
    with capture_output() as cap:
        ip.run_cell_magic("generate", "q3 --no-stream --max-tokens 10 --grammar plain "
                          "--chat-template-kwargs '{\"enable_thinking\": false}' --as r2", "hi")
    assert ip.user_ns["r2"].reasoning is None and "aner-reasoning" not in _html(cap)
    assert ip.user_ns["r2"].usage.prompt_tokens > r1.usage.prompt_tokens
    with capture_output() as cap:
        ip.run_cell_magic("chat", "q3 --no-stream --max-tokens 40 --grammar thought --as r3", "hi")
    assert ip.user_ns["r3"].reasoning == "the user says hi" and "aner-reasoning" in _html(cap)

