"""Results of one request: the generated text, its token ids, usage and timings.

Timings (see :mod:`aner_nb.llm.timings`) are integer nanoseconds and counts.
A value that was not measured is ``-1`` (never a made-up ``0``), so tables
and plots can show it as missing.
"""

from __future__ import annotations

import hashlib
import html
from array import array
from dataclasses import dataclass, field
from typing import Any

from .logprobs import TokenLogprob
from .tools import ToolCall
from .timings import NOT_MEASURED, Timings, timing_fields

__all__ = ["Timings", "Usage", "Response", "NOT_MEASURED", "output_hash", "FINISH_REASONS"]

FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass(frozen=True)
class Usage:
    """Token counts in the OpenAI sense: what the request consumed and produced."""

    prompt_tokens: int
    cached_input_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def output_hash(tokens: "tuple[int, ...] | list[int]") -> str:
    """SHA-256 over the token ids as little-endian signed 32-bit integers (llama_token)."""
    data = array("i", tokens)
    if data.itemsize != 4:  # pragma: no cover - every supported platform has 32-bit int
        raise RuntimeError("array('i') is not 32-bit on this platform")
    raw = data.tobytes() if _LITTLE else _swapped(data)
    return hashlib.sha256(raw).hexdigest()


_LITTLE = array("i", [1]).tobytes()[0] == 1


def _swapped(data: array) -> bytes:  # pragma: no cover - big-endian hosts only
    copy = array("i", data)
    copy.byteswap()
    return copy.tobytes()


@dataclass(frozen=True)
class Response:
    """One finished request. ``tokens`` exclude a terminating end-of-generation token."""

    text: str
    tokens: tuple[int, ...]
    finish_reason: str
    usage: Usage
    timings: Timings
    model: str = ""
    # With logprobs=True: one entry per token of ``tokens`` (a stop string's tokens included), else None.
    logprobs: "tuple[TokenLogprob, ...] | None" = None
    # With prompt_logprobs=True: one entry per prompt token, the first None (nothing predicts it), else None.
    prompt_logprobs: "tuple[TokenLogprob | None, ...] | None" = None
    # Chat answers: the text between the model's thinking markers (None: the answer had none; ``text`` is
    # the content after them), and the tool calls it made (``text`` then holds no call markup).
    reasoning: "str | None" = None
    tool_calls: "tuple[ToolCall, ...]" = ()
    # A schema-constrained answer whose output limit neared: its end was written as the shortest text that
    # closes the JSON validly (llm/json_closing.py); finish_reason is still "length".
    closed_early: bool = False
    output_hash: str = field(init=False)

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))
        object.__setattr__(self, "output_hash", output_hash(self.tokens))

    def tokens_per_second(self) -> float:
        """Tokens sampled after the first one over the timed decode; -1.0 without a timed decode.

        The first token comes from the prompt's logits and is accounted in
        ``first_token_duration``, like llama.cpp's own prompt/eval split.
        """
        t = self.timings
        if t.decode_duration <= 0 or t.generated_tokens < 2:
            return -1.0
        return (t.generated_tokens - 1) * 1e9 / t.decode_duration

    def to_frame(self) -> Any:
        """A one-row pandas DataFrame of usage and timings; -1 becomes missing (NA)."""
        import pandas as pd

        row: dict[str, Any] = {
            "model": self.model,
            "finish_reason": self.finish_reason,
            "completion_tokens": self.usage.completion_tokens,
            "tokens_per_second": self.tokens_per_second(),
            "output_hash": self.output_hash,
        }
        row.update(self.timings.as_dict())
        frame = pd.DataFrame([row])
        counts = [c for c in frame.columns if c not in ("model", "finish_reason", "output_hash", "tokens_per_second")]
        frame[counts] = frame[counts].astype("Int64").mask(frame[counts] < 0)
        frame["tokens_per_second"] = frame["tokens_per_second"].astype("Float64").mask(frame["tokens_per_second"] < 0)
        return frame

    def _repr_html_(self) -> str:
        """The text and the request's run timings (labels and units from the Timings fields' metadata)."""
        t = self.timings

        def shown(value: int, unit: str) -> str:
            if value < 0:
                return "–"
            return f"{value / 1e6:.1f} ms" if unit == "ns" else str(value)

        tps = self.tokens_per_second()
        rows = [("finish", html.escape(self.finish_reason))]
        rows += [
            (f.metadata["label"], shown(getattr(t, f.name), f.metadata["unit"]))
            for f in timing_fields()
            if f.metadata["part"] == "run" or f.name == "cached_input_tokens"
        ]
        rows.append(("tokens/s", "–" if tps < 0 else f"{tps:.1f}"))
        body = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>" for k, v in rows)
        text = html.escape(self.text)
        if self.tool_calls:
            text += "".join(f"\n→ {html.escape(c.name)}({html.escape(c.arguments)})" for c in self.tool_calls)
        thought = "" if self.reasoning is None else (
            "<details class='aner-reasoning'><summary>reasoning</summary>"
            f"<pre style='white-space:pre-wrap'>{html.escape(self.reasoning)}</pre></details>")
        return (
            f"<div class='aner-response'>{thought}<pre style='white-space:pre-wrap'>{text}</pre>"
            f"<table>{body}</table></div>"
        )

    def __repr__(self) -> str:
        preview = self.text if len(self.text) <= 40 else self.text[:37] + "..."
        return (
            f"Response(finish_reason={self.finish_reason!r}, completion_tokens="
            f"{self.usage.completion_tokens}, text={preview!r})"
        )
