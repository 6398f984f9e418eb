"""Notebook dashboards: timings, speculative statistics, KV budget, batching monitor, benchmark plots.

Each function returns a view object that displays as an ipywidgets panel in
Jupyter and carries a static fallback (``_repr_html_``, ``to_frame()``, and a
PNG where there is a chart) for saved notebooks, GitHub and nbval. This
package uses :mod:`aner_nb.llm`; the library never imports it.

* :func:`timings_panel` where the time of one or many responses went;
  :func:`response_panel` one response's text with its timings panel below
  (what ``%%generate`` ends with), the text as Markdown, plain text, code or
  JSON (:func:`answer_html`, the one rendering the stream and the panel share);
* :func:`speculative_panel` prompt-lookup proposals, acceptance, off/on comparison;
* :func:`kv_budget` KV bytes by formula vs context and KV type, against a memory budget;
* :func:`batching_monitor` live counters of a batching lease (protocol in
  :mod:`aner_nb.widgets.batching`) and per-request latencies;
* :func:`bench_plot` paired benchmark medians with min/max whiskers;
* :func:`chat_box` a conversation on a session: transcript, input, Send and Stop;
* :func:`logprobs_view` a response's tokens coloured by probability, the alternatives on hover.
"""

from __future__ import annotations

from .answer import FORMATS as ANSWER_FORMATS, answer_html
from .batching import STATS_FIELDS, BatchingMonitor, MonitorSnapshot, batching_monitor, latency_frame, read_stats
from .bench_plot import BenchPlot, bench_frame, bench_plot
from .chat import ChatBox, chat_box
from .kv_budget import DEFAULT_BUDGET_BYTES, KVBudget, KVFacts, kv_budget, kv_facts
from .logprobs import LogprobsView, logprobs_view
from .speculative import SpeculativePanel, SpeculativeStats, speculative_panel, speculative_stats
from .timings import ResponsePanel, TimingsPanel, response_panel, segments_ns, timings_frame, timings_panel

__all__ = [
    "chat_box",
    "ChatBox",
    "timings_panel",
    "timings_frame",
    "segments_ns",
    "TimingsPanel",
    "response_panel",
    "ResponsePanel",
    "answer_html",
    "ANSWER_FORMATS",
    "speculative_panel",
    "speculative_stats",
    "SpeculativeStats",
    "SpeculativePanel",
    "kv_budget",
    "kv_facts",
    "KVBudget",
    "KVFacts",
    "DEFAULT_BUDGET_BYTES",
    "batching_monitor",
    "BatchingMonitor",
    "latency_frame",
    "read_stats",
    "MonitorSnapshot",
    "STATS_FIELDS",
    "bench_plot",
    "bench_frame",
    "BenchPlot",
    "logprobs_view",
    "LogprobsView",
]
