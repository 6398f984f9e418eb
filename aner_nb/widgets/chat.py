"""A chat box for a notebook: the transcript as Markdown, an input, Send and Stop, streaming.

:func:`chat_box` opens a :class:`~aner_nb.llm.Session` on a lease (or takes
one), so the conversation's history stays in the session's KV and each turn
evaluates only what is new. Each answer streams into the transcript from a
worker thread, so the kernel keeps handling the Stop button (a comm message)
while tokens arrive; Stop cancels the stream, and a stopped turn is shown as
stopped and does not join the history (the session's rule for a cancelled
turn). The widget's static view is the transcript itself: once a turn ends the
display is updated in place, so a saved notebook (and nbval) shows the
conversation, not an empty box.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any

from ..llm import Session
from ._static import StaticView
from .answer import answer_html
from .timings import timings_line

__all__ = ["ChatBox", "chat_box"]

_REFRESH_S = 0.1  # at most ten transcript updates a second while an answer streams


def _turn_html(role: str, text: str, note: str = "") -> str:
    who = {"user": "You", "assistant": "Model", "system": "System"}.get(role, role)
    body = answer_html(text, "markdown") if role == "assistant" else f"<p>{html.escape(text)}</p>"
    extra = f"<div class='aner-chat-note'><small>{html.escape(note)}</small></div>" if note else ""
    return (f"<div class='aner-chat-turn' data-role='{role}'><div><b>{who}</b></div>"
            f"<div class='aner-chat-text'>{body}</div>{extra}</div>")


class ChatBox(StaticView):
    """A live conversation on one session; ``send(text)`` and ``stop()`` do what the buttons do."""

    def __init__(self, session: Any, *, owns_session: bool, **options: Any) -> None:
        self.session = session
        self.options = dict(options)
        self._owns = owns_session
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._stream: Any = None
        self._partial: str | None = None  # the answer streaming now
        self._notes: dict[int, str] = {}  # history index of an answer -> its timings line
        self._stopped: list[tuple[str, str]] = []  # (user text, partial answer) of stopped turns, in order
        self._error: str | None = None
        self._pending = ""  # the user text of the turn streaming now
        self._handle: Any = None

    # -- the conversation ----------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def send(self, text: str) -> None:
        """Start answering ``text`` (one user turn) on a worker thread; refused while a turn runs."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a chat turn needs some text")
        with self._lock:
            if self.busy:
                raise RuntimeError("the model is still answering; press Stop or wait")
            self._error = None
            self._pending = text
            self._partial = ""
            self._worker = threading.Thread(target=self._answer, args=(text,), name="aner-chat", daemon=True)
            self._worker.start()
        self._refresh()

    def stop(self) -> None:
        """Cancel the answer streaming now (nothing happens when none is)."""
        stream = self._stream
        if stream is not None:
            stream.cancel()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the current turn to end; True when none is running any more."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)
        return not self.busy

    def close(self) -> None:
        """Stop the current turn and close the session if this box opened it."""
        self.stop()
        self.wait(30)
        if self._owns:
            self.session.close()

    def _answer(self, text: str) -> None:
        last = 0.0
        try:
            self._stream = self.session.stream(text, **self.options)
            for piece in self._stream:
                self._partial = (self._partial or "") + piece
                if time.monotonic() - last >= _REFRESH_S:
                    last = time.monotonic()
                    self._refresh()
            response = self._stream.response
            if response is not None and response.finish_reason == "cancelled":
                self._stopped.append((text, self._partial or ""))
            elif response is not None:
                self._notes[len(self.session.messages) - 1] = timings_line(response)
        except Exception as exc:  # noqa: BLE001 - shown in the box; the kernel goes on
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            self._stream, self._partial = None, None
            self._refresh(final=True)

    # -- views ---------------------------------------------------------------------------
    def transcript_html(self) -> str:
        """The conversation so far: the session's history, stopped turns, and the answer streaming now."""
        parts = [
            _turn_html(m["role"], m["content"], self._notes.get(i, ""))
            for i, m in enumerate(self.session.messages)
        ]
        for user, partial in self._stopped:
            parts += [_turn_html("user", user), _turn_html("assistant", partial, "stopped (not kept in the history)")]
        if self._partial is not None:
            parts += [_turn_html("user", self._pending), _turn_html("assistant", self._partial or "…", "answering")]
        if self._error:
            parts.append(f"<div class='aner-chat-error'><pre>{html.escape(self._error)}</pre></div>")
        return "".join(parts) or "<div class='aner-chat-empty'><small>no turns yet</small></div>"

    def _repr_html_(self) -> str:
        return f"<div class='aner-chat'>{self.transcript_html()}</div>"

    def _build_widget(self) -> Any:
        import ipywidgets as w

        self._transcript = w.HTML(self._repr_html_())
        self._input = w.Textarea(placeholder="Ask something, then Send (Shift+Enter runs the cell)",
                                 layout=w.Layout(width="100%"))
        send, stop = w.Button(description="Send", button_style="primary"), w.Button(description="Stop")
        send.on_click(lambda _: self._send_input())
        stop.on_click(lambda _: self.stop())
        self._buttons = (send, stop)
        return w.VBox([self._transcript, self._input, w.HBox([send, stop])], layout=w.Layout(width="100%"))

    def _send_input(self) -> None:
        text = self._input.value
        if text.strip() and not self.busy:
            self._input.value = ""
            self.send(text)

    def _refresh(self, final: bool = False) -> None:
        if self._widget is not None:
            self._transcript.value = self._repr_html_()
            self._buttons[0].disabled = self._partial is not None
        if final and self._handle is not None:  # the saved output's static view follows the conversation
            self._handle.update(self._repr_mimebundle_(), raw=True)

    def show(self) -> "ChatBox":
        """Display the box with a display id, so each finished turn updates the saved view too."""
        from IPython.display import display

        self._handle = display(self._repr_mimebundle_(), raw=True, display_id=True)
        return self

    def _ipython_display_(self) -> None:
        self.show()

    def __repr__(self) -> str:
        turns = sum(1 for m in self.session.messages if m["role"] == "user")
        return f"<ChatBox turns={turns}{' answering' if self._partial is not None else ''}>"


def chat_box(lease: Any, *, system: str | None = None, **options: Any) -> ChatBox:
    """A chat box on ``lease`` (a new session with ``system``), or on a session given as ``lease``.

    ``options`` are the request options of every turn (``max_tokens``,
    ``temperature``...). Display it (last expression of a cell) or call
    :meth:`ChatBox.show`; a box on a session it opened closes it on :meth:`ChatBox.close`.
    """
    if isinstance(lease, Session):
        if system is not None:
            raise ValueError("system= applies to a new session; this one already has its history")
        return ChatBox(lease, owns_session=False, **options)
    return ChatBox(lease.session(system=system), owns_session=True, **options)
