"""Token probabilities in a notebook: each token coloured by how likely the model found it.

:func:`logprobs_view` takes a :class:`~aner_nb.llm.Response` asked with
``logprobs=True`` (``top_logprobs=k`` for alternatives) and shows its text
token by token, each on a background from red (unlikely) to green (certain),
with its probability and the top alternatives in the hover text (the HTML
``title``). The same HTML is the widget (an ``ipywidgets.HTML`` with a
legend) and the static fallback (``_repr_html_``), so saved notebooks and
nbval show it too; :meth:`LogprobsView.to_frame` gives one row per token.
``prompt=True`` also shows the prompt's scored tokens (``prompt_logprobs``).
"""

from __future__ import annotations

import html
import math
from typing import Any, Sequence

from ..llm.logprobs import TokenLogprob
from ..llm.response import Response
from ._static import StaticView

__all__ = ["LogprobsView", "logprobs_view", "probability_colour", "token_title"]


def probability_colour(probability: float) -> str:
    """A light background for ``probability``: hue 0 (red) at 0 to 120 (green) at 1."""
    p = min(max(probability, 0.0), 1.0)
    return f"hsl({round(120 * p)}, 75%, 82%)"


def token_title(entry: TokenLogprob) -> str:
    """The hover text of one token: its probability and logprob, then its alternatives, most likely first."""
    lines = [f"{entry.text!r}: p={entry.probability:.4f} (logprob {entry.logprob:.4f})"]
    lines += [f"  {alt.text!r}: p={alt.probability:.4f}" for alt in entry.top]
    return "\n".join(lines)


def _span(entry: TokenLogprob | None, text: str) -> str:
    shown = html.escape(text).replace("\n", "↵<br>")
    if entry is None:  # the first prompt token: nothing predicts it
        return f"<span style='opacity:0.6' title='(first token: no logprob)'>{shown}</span>"
    return (
        f"<span class='aner-token' style='background:{probability_colour(entry.probability)};"
        f"border-radius:2px' title='{html.escape(token_title(entry), quote=True)}'>{shown}</span>"
    )


class LogprobsView(StaticView):
    """One response's tokens coloured by probability, the alternatives on hover."""

    def __init__(self, response: Response, *, prompt: bool = False) -> None:
        if not isinstance(response, Response):
            raise TypeError(f"logprobs_view takes a Response, got {type(response).__name__}")
        if response.logprobs is None and not (prompt and response.prompt_logprobs is not None):
            raise ValueError("this response has no logprobs: ask for them with logprobs=True (and top_logprobs=k)")
        self.response = response
        self.prompt = prompt and response.prompt_logprobs is not None

    @property
    def entries(self) -> tuple[TokenLogprob, ...]:
        return self.response.logprobs or ()

    def perplexity(self) -> float:
        """exp of the mean negative logprob of the generated tokens (NaN without any)."""
        values = [e.logprob for e in self.entries]
        return math.exp(-sum(values) / len(values)) if values else float("nan")

    def to_frame(self) -> Any:
        """One row per token (prompt tokens first when ``prompt``): where, text, id, logprob, probability, top."""
        import pandas as pd

        rows = []
        if self.prompt:
            for i, e in enumerate(self.response.prompt_logprobs or ()):
                if e is not None:
                    rows.append(("prompt", i, e))
        rows += [("output", i, e) for i, e in enumerate(self.entries)]
        return pd.DataFrame({
            "part": [part for part, _, _ in rows],
            "position": [i for _, i, _ in rows],
            "token": [e.token for _, _, e in rows],
            "text": [e.text for _, _, e in rows],
            "logprob": [e.logprob for _, _, e in rows],
            "probability": [e.probability for _, _, e in rows],
            "top": [", ".join(f"{a.text!r} {a.probability:.3f}" for a in e.top) for _, _, e in rows],
        })

    def _tokens_html(self, entries: Sequence[TokenLogprob | None]) -> str:
        return "".join(_span(e, e.text if e is not None else "") for e in entries)

    def _legend_html(self) -> str:
        stops = "".join(
            f"<span style='background:{probability_colour(p)};padding:0 0.5em'>{p:g}</span>" for p in (0, 0.25, 0.5, 0.75, 1)
        )
        ppl = self.perplexity()
        shown = "–" if ppl != ppl else f"{ppl:.3f}"
        return (f"<div style='font-size:smaller;margin-top:0.4em'>probability {stops} · {len(self.entries)} tokens · "
                f"perplexity {shown} · hover a token for its alternatives</div>")

    def _repr_html_(self) -> str:
        parts = ["<div class='aner-logprobs'>"]
        if self.prompt:
            parts.append("<div style='white-space:pre-wrap;font-family:monospace;border-bottom:1px dashed #999;"
                         f"padding-bottom:0.3em'>{self._tokens_html(self.response.prompt_logprobs or ())}</div>")
        parts.append(f"<div style='white-space:pre-wrap;font-family:monospace'>{self._tokens_html(self.entries)}</div>")
        parts.append(self._legend_html())
        parts.append("</div>")
        return "".join(parts)

    def _build_widget(self) -> Any:
        import ipywidgets as w

        return w.HTML(self._repr_html_())

    def __repr__(self) -> str:
        return f"<LogprobsView {len(self.entries)} tokens, perplexity {self.perplexity():.3f}>"


def logprobs_view(response: Response, *, prompt: bool = False) -> LogprobsView:
    """The coloured-token view of ``response`` (asked with ``logprobs=True``); ``prompt`` adds its scored prompt."""
    return LogprobsView(response, prompt=prompt)
