"""Logprobs in OpenAI's two response shapes, built from the library's :class:`~aner_nb.llm.logprobs.TokenLogprob`.

- chat completions: ``choices[i].logprobs.content``, one object per token
  (``token``, ``logprob``, ``bytes``, ``top_logprobs`` of the same three);
- ``/v1/completions`` (the legacy shape): ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (one ``{token text: logprob}`` dict per token) and
  ``text_offset`` (each token's character offset in the choice's text);
  echoed prompt tokens come first, the first one with ``null`` entries
  (nothing predicts it).

Streamed chunks carry the entries of their own tokens in the same shapes.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pydantic import BaseModel

from ..llm.logprobs import TokenLogprob

__all__ = ["TopLogprobBody", "TokenLogprobBody", "ChatLogprobs", "CompletionLogprobs", "chat_logprobs",
           "completion_logprobs"]


class TopLogprobBody(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprobBody(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprobBody]


class ChatLogprobs(BaseModel):
    """``choices[i].logprobs`` of a chat completion (OpenAI's ``ChoiceLogprobs``)."""

    content: Optional[list[TokenLogprobBody]] = None
    refusal: Optional[list[TokenLogprobBody]] = None


class CompletionLogprobs(BaseModel):
    """``choices[i].logprobs`` of a legacy completion."""

    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: Optional[list[Optional[dict[str, float]]]] = None
    text_offset: list[int]


def _top(entry: TokenLogprob) -> TopLogprobBody:
    return TopLogprobBody(token=entry.text, logprob=entry.logprob, bytes=list(entry.piece))


def chat_logprobs(entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    """The chat shape of ``entries`` (a whole answer's, or one chunk's)."""
    return ChatLogprobs(content=[
        TokenLogprobBody(token=e.text, logprob=e.logprob, bytes=list(e.piece), top_logprobs=[_top(a) for a in e.top])
        for e in entries
    ])


def completion_logprobs(
    entries: Sequence[Optional[TokenLogprob]], *, offset: int = 0, prompt: Sequence[Optional[TokenLogprob]] = (),
    prompt_tokens: Sequence[str] = (),
) -> CompletionLogprobs:
    """The legacy shape of ``prompt`` (echoed prompt entries, ``None`` for the first) then ``entries``.

    ``offset`` is the character offset of the first token in the choice's
    text; ``prompt_tokens`` names the prompt's tokens (the first has no entry).
    """
    tokens: list[str] = []
    values: list[Optional[float]] = []
    tops: list[Optional[dict[str, float]]] = []
    offsets: list[int] = []
    at = offset
    for i, entry in enumerate([*prompt, *entries]):
        text = entry.text if entry is not None else (prompt_tokens[i] if i < len(prompt_tokens) else "")
        tokens.append(text)
        values.append(None if entry is None else entry.logprob)
        if entry is None:
            tops.append(None)
        else:
            top: dict[str, float] = {}
            for alt in entry.top:
                top.setdefault(alt.text, alt.logprob)  # two tokens with one text: the likelier one
            tops.append(top)
        offsets.append(at)
        at += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)
