"""Speculative-decoding statistics: how many proposals were made, accepted, and what they bought.

Reads the ``speculative_*`` fields of :class:`~aner_nb.llm.Timings` (filled by
``with_optimizer(speculative_tokens=N)`` leases; ``-1`` elsewhere, shown as
missing). Derived numbers:

* acceptance rate = accepted / proposed (missing when nothing was proposed);
* accepted per verification step = accepted / verification steps;
* tokens per forward call = (generated tokens - 1) / decode calls: the first
  token comes from the prompt's logits, every later one from a decode call,
  so plain greedy decoding is exactly 1.0 and speculation raises it.

Given a pair (speculation off, on) the panel also compares speed and shows
whether the two outputs are identical (``output_hash``), which the
prompt-lookup contract requires for greedy decoding.

The numbers of one response are a :class:`SpeculativeStats` (typed fields,
``None`` where not measured); each field's metadata holds its display label
and column type, applied only at the edge: :meth:`SpeculativeStats.labelled`
and :func:`speculative_stats` (a dict keyed by the labels, for DataFrames)
and the panel's tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from ..llm.response import Response
from ._static import MISSING, fmt_count, fmt_float, frame_html, html_table, measured
from .timings import ResponsesView, as_responses

__all__ = ["SpeculativeStats", "speculative_stats", "SpeculativePanel", "speculative_panel"]


def _ratio(num: Any, den: Any) -> float | None:
    return num / den if measured(num) and measured(den) and den > 0 else None


def _shown(label: str, dtype: str | None) -> Any:
    """A :class:`SpeculativeStats` field: its display label and its frame column type (None: as is)."""
    return dataclasses.field(metadata={"label": label, "dtype": dtype})


@dataclass(frozen=True)
class SpeculativeStats:
    """The speculation counters and derived rates of one response; ``None`` where not measured."""

    speculative_tokens: int | None = _shown("speculative tokens", "Int64")
    proposed: int | None = _shown("proposed", "Int64")
    accepted: int | None = _shown("accepted", "Int64")
    verification_steps: int | None = _shown("verification steps", "Int64")
    acceptance_rate: float | None = _shown("acceptance rate", "Float64")
    accepted_per_step: float | None = _shown("accepted per step", "Float64")
    generated_tokens: int | None = _shown("generated tokens", "Int64")
    decode_calls: int | None = _shown("decode calls", "Int64")
    tokens_per_forward_call: float | None = _shown("tokens per forward call", "Float64")
    tokens_per_second: float | None = _shown("tokens/s", "Float64")
    output_hash: str = _shown("output_hash", None)

    @classmethod
    def of(cls, response: Response) -> "SpeculativeStats":
        t = response.timings

        def get(v: int) -> int | None:
            return v if measured(v) else None

        proposed, accepted = get(t.speculative_proposed_tokens), get(t.speculative_accepted_tokens)
        steps, calls, generated = get(t.speculative_verification_steps), get(t.decode_calls), get(t.generated_tokens)
        tps = response.tokens_per_second()
        return cls(
            speculative_tokens=get(t.speculative_tokens),
            proposed=proposed,
            accepted=accepted,
            verification_steps=steps,
            acceptance_rate=_ratio(accepted, proposed),
            accepted_per_step=_ratio(accepted, steps),
            generated_tokens=generated,
            decode_calls=calls,
            tokens_per_forward_call=_ratio(None if generated is None else max(generated - 1, 0), calls),
            tokens_per_second=tps if tps >= 0 else None,
            output_hash=response.output_hash,
        )

    def labelled(self) -> dict[str, Any]:
        """The display edge: every field keyed by its label, in declaration order."""
        return {f.metadata["label"]: getattr(self, f.name) for f in dataclasses.fields(self)}


def speculative_stats(response: Response) -> dict[str, Any]:
    """The counters and derived rates of one response keyed by their display labels (``None`` where not
    measured): ``SpeculativeStats.of(response).labelled()``, for DataFrames and tables."""
    return SpeculativeStats.of(response).labelled()


_DTYPES = {f.metadata["label"]: f.metadata["dtype"] for f in dataclasses.fields(SpeculativeStats)}
_INTS = tuple(label for label, dtype in _DTYPES.items() if dtype == "Int64")


def _default_label(i: int, r: Response) -> str:
    n = r.timings.speculative_tokens
    return f"#{i} speculative_tokens={n}" if measured(n) else f"#{i}"


class SpeculativePanel(ResponsesView):
    """Speculation counters for one or many responses; a comparison for a pair."""

    def __init__(self, responses: Any, labels: Sequence[str] | None = None, *, compare: bool | None = None) -> None:
        pairs = as_responses(responses, labels)
        if labels is None and not hasattr(responses, "keys"):
            pairs = [(_default_label(i, r), r) for i, (_, r) in enumerate(pairs)]
        self._pairs = pairs
        self.compare = len(pairs) == 2 if compare is None else bool(compare)
        if self.compare and len(pairs) != 2:
            raise ValueError(f"a comparison needs exactly two responses (off, on), got {len(pairs)}")

    @property
    def outputs_identical(self) -> bool | None:
        """For a pair: whether both outputs have the same ``output_hash``; None otherwise."""
        if not self.compare:
            return None
        a, b = self.responses
        return a.output_hash == b.output_hash

    def to_frame(self) -> Any:
        """One row per response: counters (Int64) and rates (Float64), NA where not measured."""
        import pandas as pd

        stats = [SpeculativeStats.of(r) for _, r in self._pairs]
        frame = pd.DataFrame([s.labelled() for s in stats], index=pd.Index(self.labels, name="response"))
        for f in dataclasses.fields(SpeculativeStats):
            if f.metadata["dtype"] is not None:
                frame[f.metadata["label"]] = pd.array([getattr(s, f.name) for s in stats], dtype=f.metadata["dtype"])
        return frame

    def comparison_frame(self) -> Any:
        """For a pair: metrics as rows, the two sides as columns, plus speedups and hash equality."""
        import pandas as pd

        if not self.compare:
            raise ValueError("comparison_frame() needs a pair of responses (off, on)")
        frame = self.to_frame().drop(columns=["output_hash"]).T.astype(object)
        a, b = self.responses
        off, on = self.labels
        frame["on / off"] = pd.Series(
            [
                _ratio(frame.loc[m, on], frame.loc[m, off]) if m in ("tokens/s", "tokens per forward call") else None
                for m in frame.index
            ],
            index=frame.index,
            dtype=object,
        )
        frame.loc["total ms"] = [
            a.timings.total_duration / 1e6 if measured(a.timings.total_duration) else None,
            b.timings.total_duration / 1e6 if measured(b.timings.total_duration) else None,
            _ratio(b.timings.total_duration, a.timings.total_duration),
        ]
        frame.loc["output_hash"] = [a.output_hash[:16], b.output_hash[:16], "identical" if self.outputs_identical else "DIFFERENT"]
        return frame.where(pd.notna(frame), None)

    # -- rendering ---------------------------------------------------------------
    def _verdict_html(self) -> str:
        if not self.compare:
            return ""
        a, b = self.responses
        if self.outputs_identical:
            return (
                f"<p class='aner-verdict' data-identical='true' style='color:#1b5e20'>&#10004; outputs identical "
                f"(sha256 {a.output_hash[:16]}…)</p>"
            )
        return (
            f"<p class='aner-verdict' data-identical='false' style='color:#b71c1c'>&#10008; outputs differ "
            f"({a.output_hash[:16]}… vs {b.output_hash[:16]}…)</p>"
        )

    def _table_html(self) -> str:
        if self.compare:
            frame = self.comparison_frame()
            rows = []
            for metric, values in frame.iterrows():
                cells = [_fmt(metric, v) for v in values]
                rows.append([metric, *cells])
            return html_table(rows, header=["", *[str(c) for c in frame.columns]])
        frame = self.to_frame().drop(columns=["output_hash"])
        return frame_html(frame)

    def _repr_html_(self) -> str:
        return f"<div class='aner-speculative'>{self._verdict_html()}{self._table_html()}</div>"

    def _build_widget(self) -> Any:
        import ipywidgets as w

        bars = []
        for label, r in self._pairs:
            rate = SpeculativeStats.of(r).acceptance_rate
            bars.append(
                w.FloatProgress(
                    value=rate or 0.0,
                    min=0.0,
                    max=1.0,
                    description="accepted",
                    bar_style="success" if rate is not None else "",
                    tooltip=f"{label}: acceptance rate {fmt_float(rate, 3)}",
                    layout=w.Layout(visibility="visible" if rate is not None else "hidden"),
                )
            )
        rows = [w.HBox([w.Label(label, layout=w.Layout(width="16em")), bar]) for (label, _), bar in zip(self._pairs, bars)]
        return w.VBox([w.HTML(self._verdict_html()), *rows, w.HTML(self._table_html())])

    def __repr__(self) -> str:
        kind = "comparison" if self.compare else f"{len(self._pairs)} response(s)"
        return f"<SpeculativePanel {kind}>"


def _fmt(metric: str, value: Any) -> str:
    if value is None:
        return MISSING
    if isinstance(value, str):
        return value
    if metric in _INTS:
        return fmt_count(value)
    return fmt_float(value, 3)


def speculative_panel(
    responses: Any, *, labels: Sequence[str] | None = None, compare: bool | None = None
) -> SpeculativePanel:
    """Proposed/accepted/verification counters, acceptance rate and tokens per forward call.

    ``responses``: a Response, a list, or a ``{label: response}`` mapping. A
    pair (speculation off first, on second) is shown as a comparison with the
    output-hash check; pass ``compare=False`` to list two responses instead.
    """
    return SpeculativePanel(responses, labels, compare=compare)
