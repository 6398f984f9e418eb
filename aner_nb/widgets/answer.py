"""How an answer's text is shown: Markdown, plain text, a code block or JSON.

One HTML rendering serves the in-place streaming view, the response panel's
widget and its static fallback, so an answer looks the same while it streams,
when it is done and in a saved notebook. Markdown is rendered here with
markdown-it-py (CommonMark plus tables and strikethrough) with raw HTML turned
off: a model's answer is untrusted text, and an output produced by the
kernel is trusted by Jupyter, so any ``<img onerror=...>`` or ``<script>``
in it is shown as text, and ``javascript:`` links are not made links. The
rendered block carries JupyterLab's Markdown classes so it is styled like a
Markdown cell.
"""

from __future__ import annotations

import html
import json
import re

__all__ = ["FORMATS", "check_format", "answer_html", "response_html", "reasoning_html", "json_answer", "code_answer"]

FORMATS = ("markdown", "text", "code", "json")

_MARKDOWN_CLASSES = "aner-markdown jp-RenderedHTMLCommon jp-RenderedMarkdown"
_FENCED = re.compile(r"\A\s*(`{3,}|~{3,})[ \t]*([\w+#.-]*)[^\n]*\n(.*?)\n?\1[ \t]*\s*\Z", re.S)
_renderer = None


def _markdown(text: str) -> str:
    global _renderer
    if _renderer is None:
        from markdown_it import MarkdownIt

        _renderer = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])
    return _renderer.render(text)


def code_answer(text: str) -> tuple[str, str]:
    """``(language, code)``: an answer that is one fenced block loses its fence; any other is all code."""
    match = _FENCED.match(text)
    if match is None:
        return "", text
    return match.group(2), match.group(3)


def json_answer(text: str) -> tuple[str, str | None]:
    """``(shown, error)``: the answer pretty-printed when it is JSON (one fenced block is unwrapped),
    else the text as it is and why it is not JSON."""
    _, body = code_answer(text)
    try:
        value = json.loads(body)
    except ValueError as exc:
        return text, str(exc)
    return json.dumps(value, indent=2, ensure_ascii=False), None


def check_format(format: str) -> str:
    """``format`` if it is one of :data:`FORMATS`, else a ValueError naming them."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    return format


def _pre(text: str, css: str = "") -> str:
    cls = f" class='{css}'" if css else ""
    return f"<pre{cls} style='white-space:pre-wrap'>{html.escape(text)}</pre>"


def answer_html(text: str, format: str = "text") -> str:
    """The answer as HTML in ``format`` (one of :data:`FORMATS`); ``text`` is a preformatted block.

    A ``json`` answer that does not parse (a stream still arriving, or a model that
    strayed) is shown as text with the parser's reason below it.
    """
    if format == "markdown":
        return f"<div class='{_MARKDOWN_CLASSES}'>{_markdown(text)}</div>"
    if format == "code":
        language, code = code_answer(text)
        lang = f" class='language-{html.escape(language, quote=True)}'" if language else ""
        return f"<pre class='aner-code'><code{lang}>{html.escape(code)}</code></pre>"
    if format == "json":
        shown, error = json_answer(text)
        if error is None:
            return _pre(shown, "aner-json")
        return _pre(text) + f"<small>not valid JSON: {html.escape(error)}</small>"
    check_format(format)
    return _pre(text)


def reasoning_html(reasoning: "str | None") -> str:
    """A reasoning model's thinking, collapsed (an HTML ``<details>``); empty when there was none."""
    if reasoning is None:
        return ""
    return ("<details class='aner-reasoning'><summary>reasoning</summary>"
            f"{_pre(reasoning)}</details>")


def response_html(response: object, format: str = "text") -> str:
    """A Response's answer as HTML: its reasoning collapsed above the text, its tool calls below it."""
    text = answer_html(getattr(response, "text", ""), format)
    calls = getattr(response, "tool_calls", ())
    if calls:
        text += _pre("\n".join(f"→ {c.name}({c.arguments})" for c in calls), "aner-tool-calls")
    return reasoning_html(getattr(response, "reasoning", None)) + text
