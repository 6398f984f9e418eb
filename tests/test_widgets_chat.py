"""The chat box: turns stream on a worker thread into the transcript, Stop cancels, history in the session."""

from __future__ import annotations

import threading

import pytest

from aner_nb import llm
from aner_nb.widgets import ChatBox, chat_box

# A grammar whose output never ends: the answer runs to max_tokens unless stopped.
NEVER_DONE = 'root ::= "a" root'


@pytest.fixture
def model(llama_path):
    with llm.load(llama_path, context=2048, warmup=False) as m:
        yield m


def test_a_turn_streams_into_the_transcript_and_joins_the_session_history(model):
    box = chat_box(model, system="Be brief.", max_tokens=8)
    assert isinstance(box, ChatBox) and box.session.kind == "session"
    box.send("Hello there")
    assert box.wait(60)
    messages = box.session.messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    expected = model.chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}], max_tokens=8)
    assert messages[-1]["content"] == expected.text  # the same greedy answer as a plain chat request
    html = box._repr_html_()
    assert "Hello there" in html and "tok/s" in html  # the static transcript, with the turn's timings line
    box.send("And again?")
    assert box.wait(60)
    assert box.session.cached_tokens > 0 and len(box.session.messages) == 5
    box.close()
    assert box.session.closed and not model.closed  # the box closes the session it opened, not the lease


def test_stop_cancels_the_streaming_turn_which_is_shown_but_not_kept(model):
    box = chat_box(model, max_tokens=1900, grammar=NEVER_DONE)
    streamed, release = threading.Event(), threading.Event()
    original = box._refresh

    def refresh(final=False):  # runs on the worker thread: hold the turn until Stop was pressed
        if box._partial and not streamed.is_set():
            streamed.set()
            release.wait(60)
        original(final)

    box._refresh = refresh
    box.send("Write forever")
    assert streamed.wait(60), "no text streamed"
    assert box.busy
    with pytest.raises(RuntimeError, match="still answering"):
        box.send("another")
    box.stop()
    release.set()
    assert box.wait(60)
    assert [m["role"] for m in box.session.messages] == []  # the stopped turn is not in the history
    html = box._repr_html_()
    assert "stopped (not kept in the history)" in html and "Write forever" in html
    box.options = {"max_tokens": 4}
    box.send("Now briefly")  # the session answers again after a stop
    assert box.wait(60) and len(box.session.messages) == 2
    box.close()


def test_the_widget_has_transcript_input_and_buttons_and_a_static_fallback(model):
    box = chat_box(model, max_tokens=4)
    widget = box.widget
    transcript, area, buttons = widget.children
    assert [b.description for b in buttons.children] == ["Send", "Stop"]
    area.value = "Hi from the input"
    buttons.children[0].click()
    assert box.wait(60)
    assert area.value == "" and "Hi from the input" in transcript.value
    bundle = box._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "Hi from the input" in bundle["text/html"]
    box.close()


def test_a_box_on_an_existing_session_keeps_it_open(model):
    with model.session() as session:
        box = chat_box(session, max_tokens=4)
        box.send("Hi")
        assert box.wait(60)
        box.close()
        assert not session.closed and len(session.messages) == 2
        with pytest.raises(ValueError, match="system"):
            chat_box(session, system="x")
