"""Dashboards built from real Responses of the tiny llama fixture: numbers, missing values, fallbacks, PNGs, threads."""

from __future__ import annotations

import ast
import dataclasses
import gc
import html
import pathlib
import threading
import time

import matplotlib

matplotlib.use("Agg")  # headless

import matplotlib.image  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from aner_nb import llm  # noqa: E402
from aner_nb.bench.paired import abba, compare  # noqa: E402
from aner_nb.llm.summary import KV_EXCLUDES  # noqa: E402
from aner_nb.widgets import (  # noqa: E402
    DEFAULT_BUDGET_BYTES,
    MonitorSnapshot,
    SpeculativeStats,
    batching_monitor,
    bench_frame,
    bench_plot,
    kv_budget,
    latency_frame,
    segments_ns,
    read_stats,
    speculative_panel,
    speculative_stats,
    timings_frame,
    timings_panel,
)
from aner_nb.widgets._static import MISSING, png_size  # noqa: E402
from fixtures.models import write_tiny_model  # noqa: E402

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def model(llama_path):
    with llm.load(llama_path, context=256) as m:
        yield m


@pytest.fixture(scope="module")
def responses(model):
    """Two real responses; the first call on a fresh lease has no context clear (-1), the second one does."""
    return [model.generate("hello", max_tokens=8), model.generate("the cat and the dog", max_tokens=8)]


def with_timings(response, **changes):
    return dataclasses.replace(response, timings=dataclasses.replace(response.timings, **changes))


def bundle(view):
    data = view._repr_mimebundle_()
    assert WIDGET_MIME in data and data["text/html"] and data["text/plain"]
    return data


# -- timings ------------------------------------------------------------------------------------
def test_timings_panel_shows_the_response_numbers(responses):
    panel = timings_panel(responses)
    shown = panel.summary_frame()
    page = panel._repr_html_()
    for label, r in zip(panel.labels, responses):
        t, row = r.timings, shown.loc[label]
        assert row["prompt tokens"] == t.prompt_tokens
        assert row["cached input tokens"] == t.cached_input_tokens == r.usage.cached_input_tokens
        assert row["generated tokens"] == t.generated_tokens
        assert row["prefill ms"] == t.prompt_eval_duration / 1e6
        assert row["decode ms"] == t.decode_duration / 1e6
        assert row["total ms"] == t.total_duration / 1e6
        assert row["tokens/s"] == r.tokens_per_second() > 0
        assert f"{t.prompt_eval_duration / 1e6:,.2f}" in page
        assert f"{r.tokens_per_second():,.2f}" in page
        assert f"{t.total_duration / 1e6:.2f} ms total" in page
    data = bundle(panel)
    assert data["text/html"] == page
    bars_html, table_html = (child.value for child in panel.widget.children)
    assert bars_html in page and table_html in page


def test_timings_phases_stack_to_the_total(responses):
    r = with_timings(responses[1], queue_duration=1_000)
    seg = segments_ns(r)
    t = r.timings
    assert seg["prefill"] == t.prompt_eval_duration
    # the queue wait and the context clear happen inside first_token_duration, before the prefill
    assert seg["first token"] == t.first_token_duration - t.prompt_eval_duration - 1_000 - max(t.context_clear_duration, 0)
    assert seg["decode"] == t.decode_duration
    assert seg["queue"] == 1_000
    assert all(v is not None and v >= 0 for v in seg.values())
    assert sum(seg.values()) == t.total_duration


def test_timings_unmeasured_values_are_missing_not_zero(responses):
    r = responses[0]
    assert r.timings.queue_duration == -1  # an ordinary lease does not queue
    panel = timings_panel(with_timings(r, total_duration=-1))
    shown = panel.summary_frame().iloc[0]
    assert pd.isna(shown["queue ms"]) and pd.isna(shown["total ms"])
    seg = panel.segments_frame().iloc[0]
    assert pd.isna(seg["queue ms"]) and pd.isna(seg["other ms"])  # no total: no remainder either
    frame = panel.to_frame()
    assert pd.isna(frame.iloc[0]["queue_duration"]) and pd.isna(frame.iloc[0]["speculative_accepted_tokens"])
    page = panel._repr_html_()
    assert "not measured: queue" in page and "data-segment='queue'" not in page
    assert "<th>queue ms</th>" in page and f"<td>{MISSING}</td>" in page
    assert "&lt;NA&gt;" not in page and "NaN" not in page
    tps = timings_panel(with_timings(r, decode_duration=-1)).summary_frame().iloc[0]["tokens/s"]
    assert pd.isna(tps)


def test_timings_frame_one_row_per_response(responses):
    frame = timings_frame({"first": responses[0], "second": responses[1]})
    assert list(frame.index) == ["first", "second"]
    assert frame.loc["second", "generated_tokens"] == responses[1].timings.generated_tokens
    assert frame.loc["first", "output_hash"] == responses[0].output_hash
    with pytest.raises(TypeError, match="Response"):
        timings_panel(["not a response"])
    with pytest.raises(ValueError, match="labels"):
        timings_panel(responses, labels=["only one"])


# -- speculative --------------------------------------------------------------------------------
def test_speculative_panel_without_speculation_shows_missing(responses):
    r = responses[0]
    panel = speculative_panel(r)
    row = panel.to_frame().iloc[0]
    for name in ("proposed", "accepted", "verification steps", "acceptance rate", "accepted per step"):
        assert pd.isna(row[name]), name
    assert row["speculative tokens"] == 0
    t = r.timings
    # plain greedy decoding: every token after the first costs one decode call
    assert row["tokens per forward call"] == (t.generated_tokens - 1) / t.decode_calls == 1.0
    page = panel._repr_html_()
    assert "&lt;NA&gt;" not in page and f"<td>{MISSING}</td>" in page
    assert panel.outputs_identical is None
    bundle(panel)


def test_speculative_pair_compares_and_checks_output_hash(responses):
    off = responses[0]
    on = with_timings(
        off,
        speculative_tokens=6,
        speculative_proposed_tokens=12,
        speculative_accepted_tokens=9,
        speculative_verification_steps=3,
        decode_calls=3,
        decode_duration=off.timings.decode_duration // 2,
    )
    panel = speculative_panel([off, on])
    assert panel.compare and panel.outputs_identical is True
    frame = panel.to_frame()
    spec = frame.iloc[1]
    assert spec["proposed"] == 12 and spec["accepted"] == 9 and spec["verification steps"] == 3
    assert spec["acceptance rate"] == 9 / 12
    assert spec["accepted per step"] == 3.0
    assert spec["tokens per forward call"] == (on.timings.generated_tokens - 1) / 3
    cmp = panel.comparison_frame()
    assert cmp.loc["output_hash", "on / off"] == "identical"
    assert cmp.loc["tokens/s", "on / off"] == pytest.approx(on.tokens_per_second() / off.tokens_per_second())
    page = panel._repr_html_()
    assert "data-identical='true'" in page and "0.750" in page and "speculative_tokens=6" in page
    rate_bars = [c.children[1] for c in panel.widget.children[1:3]]
    assert rate_bars[1].value == 0.75 and rate_bars[0].layout.visibility == "hidden"

    different = speculative_panel([off, responses[1]])
    assert different.outputs_identical is False
    assert "data-identical='false'" in different._repr_html_()
    assert speculative_panel([off, on], compare=False).outputs_identical is None
    with pytest.raises(ValueError, match="two responses"):
        speculative_panel([off, on, off], compare=True)


# -- KV budget ----------------------------------------------------------------------------------
def manual_kv(context, layers, kv_heads, k, v, kind):
    per_block, block = {"f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}[kind]
    return context * layers * kv_heads * (k // per_block * block + v // per_block * block)


def test_kv_budget_of_a_lease_matches_the_formula(model):
    kb = kv_budget(model)
    summary = model.memory_summary()
    facts = llm.inspect_model(model.path)
    assert kb.context == model.context == 256 and kb.kv_cache_type == "f16"
    assert kb.facts.weights_bytes == summary.weights_bytes
    assert kb.kv_bytes() == summary.kv_bytes
    frame = kb.to_frame()
    for kind in ("f16", "q8_0", "q4_0"):
        expected = manual_kv(256, facts.layers, facts.kv_heads, facts.head_dim_k, facts.head_dim_v, kind)
        assert frame.loc[kind, "KV bytes"] == expected == llm.kv_estimate(
            256, facts.layers, facts.kv_heads, facts.head_dim_k, facts.head_dim_v, kind
        )
        assert frame.loc[kind, "weights + KV bytes"] == expected + summary.weights_bytes
    assert frame.loc["q8_0", "K row bytes"] == 34 and frame.loc["q4_0", "V row bytes"] == 18  # head_dim 32
    kb.update(slots=3)
    assert kb.total_kv_bytes() == 3 * summary.kv_bytes
    assert f"= 3 x 256 x {facts.layers} x {facts.kv_heads} x (64 + 64) = {3 * summary.kv_bytes:,} bytes" in kb.formula_text()
    assert kb.budget_bytes == DEFAULT_BUDGET_BYTES == 8 * 2**30


@pytest.mark.parametrize("slots", [1, 3])
def test_the_largest_context_in_budget_is_the_largest_that_fits(slots):
    """Weights + every slot's KV fit the budget at the reported context, and 256 cells more (llama.cpp's
    allocation block) would not, unless the model's declared context caps it."""
    facts = {"name": "m", "layers": 4, "kv_heads": 2, "head_dim": 64, "context_length": 1 << 20}
    for budget in (3 * 2**20, 20 * 2**20 + 12345):
        kb = kv_budget(facts, budget_bytes=budget, slots=slots)
        for kind in ("f16", "q8_0", "q4_0"):
            best = kb.max_context(kind)
            assert best > 0 and best % 256 == 0
            assert kb.total_kv_bytes(kind, best) <= budget
            assert best == kb.context_limit or budget < kb.total_kv_bytes(kind, best + 256)
        assert kb.max_context("f16") < kb.context_limit  # the small budget binds for f16 at least
    capped = kv_budget({**facts, "context_length": 1000}, budget_bytes=2**30)
    assert capped.max_context("f16") == 1000


def test_kv_budget_with_different_k_and_v_head_dims(tmp_path):
    path = write_tiny_model(
        tmp_path / "kv.gguf", "llama", metadata={"llama.attention.key_length": 32, "llama.attention.value_length": 64}
    )
    facts = llm.inspect_model(path)  # header only: a ModelFacts whose K and V head dims differ
    assert (facts.head_dim_k, facts.head_dim_v) == (32, 64)
    kb = kv_budget(facts, context=1000)
    assert kb.facts.weights_bytes == facts.tensor_bytes
    rows = {"f16": (64, 128), "q8_0": (34, 68), "q4_0": (18, 36)}
    frame = kb.to_frame()
    for kind, (k, v) in rows.items():
        assert (frame.loc[kind, "K row bytes"], frame.loc[kind, "V row bytes"]) == (k, v)
        # llama.cpp pads a context of 1000 to 1024 cells
        assert frame.loc[kind, "KV bytes"] == 1024 * facts.layers * facts.kv_heads * (k + v)
        assert frame.loc[kind, "KV bytes"] == manual_kv(1024, facts.layers, facts.kv_heads, 32, 64, kind)
    same = kv_budget({"layers": facts.layers, "kv_heads": facts.kv_heads, "head_dim_k": 32, "head_dim_v": 64},
                     context=1000, kv_cache_type="q4_0")
    assert same.total_kv_bytes() == frame.loc["q4_0", "KV bytes"]
    assert "(K 32 + V 64" not in same.formula_text() and "head dims: K 32, V 64" in same.formula_text()
    assert "1000 -> 1024" in same.formula_text()


def test_kv_budget_rejects_types_the_head_dims_cannot_store():
    kb = kv_budget({"name": "odd", "layers": 2, "kv_heads": 2, "head_dim": 48})
    frame = kb.to_frame()
    assert frame.loc["f16", "KV bytes"] == 4096 * 2 * 2 * (96 + 96)
    assert pd.isna(frame.loc["q8_0", "KV bytes"]) and pd.isna(frame.loc["q4_0", "K row bytes"])
    with pytest.raises(ValueError, match="multiples of 32"):
        kb.update(kv_cache_type="q8_0")
    assert kb.widget.children[0].children[1].options == ("f16",)
    with pytest.raises(ValueError, match="head_dim_k"):
        kv_budget({"layers": 2, "kv_heads": 2})
    with pytest.raises(TypeError, match="mapping of facts"):
        kv_budget(42)


def test_kv_budget_widget_controls_drive_the_numbers(model):
    kb = kv_budget(model)
    box = kb.widget
    c = kb._controls
    c["kv_cache_type"].value = "q8_0"
    c["context"].value = 200
    c["slots"].value = 2
    c["budget_gib"].value = 0.5
    assert (kb.kv_cache_type, kb.context, kb.slots, kb.budget_bytes) == ("q8_0", 200, 2, 2**29)
    expected = 2 * llm.kv_estimate(200, 2, 1, 32, 32, "q8_0")
    assert kb.total_kv_bytes() == expected
    readout, chart, formula = box.children[2:]
    assert f"{expected:,} B" in readout.value
    assert png_size(chart.value) == (800, 550)
    assert "Excludes" in formula.value and html.escape(KV_EXCLUDES) in formula.value
    kb.update(context=256)  # programmatic changes move the controls too
    assert c["context"].value == 256 and c["kv_cache_type"].value == "q8_0"
    page = kb._repr_html_()
    assert "data:image/png;base64," in page and "Excludes" in page
    data = bundle(kb)
    assert data["image/png"]


# -- headless PNGs ------------------------------------------------------------------------------
def read_png(path: pathlib.Path):
    assert path.stat().st_size > 1000
    image = matplotlib.image.imread(path)
    assert image.std() > 0.01  # not a blank canvas
    return image.shape[:2]  # (height, width)


def test_kv_chart_and_bench_plot_render_to_png(tmp_path, model):
    kb = kv_budget(model)
    kb.to_png(tmp_path / "kv.png", figsize=(8.0, 5.5), dpi=100)
    assert read_png(tmp_path / "kv.png") == (550, 800)
    kb.to_png(tmp_path / "kv_small.png", figsize=(6.0, 4.0), dpi=80)
    assert read_png(tmp_path / "kv_small.png") == (320, 480)

    values = iter([10.0, 7.0, 6.0, 11.0, 12.0, 9.0])
    a, b = abba(3, lambda: next(values), lambda: next(values), names=("speculative", "plain"))
    results = [compare("decode speed", a, b, "tok/s", higher_is_better=True),
               compare("first token", b, a, "ms", higher_is_better=False)]
    frame = bench_frame(results)
    assert list(frame["name"]) == ["speculative", "plain", "plain", "speculative"]
    assert frame.loc[0, "median"] == results[0]["a"]["median"] and frame.loc[1, "max"] == results[0]["b"]["max"]
    plot = bench_plot(frame, figsize=(7.0, 3.5), dpi=100)
    plot.to_png(tmp_path / "bench.png")
    assert read_png(tmp_path / "bench.png") == (350, 700) and plot.size_px == (700, 350)
    default = bench_plot(results)  # compare() dicts directly
    assert png_size(default.to_png()) == default.size_px
    assert "data:image/png;base64," in default._repr_html_() and default._repr_png_()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="median"):
        bench_plot(frame.drop(columns=["median"]))
    with pytest.raises(ValueError, match="min <= median <= max"):
        bench_plot(frame.assign(min=frame["max"] + 1))


def test_timings_chart_renders(tmp_path, responses):
    timings_panel(responses).to_png(tmp_path / "t.png")
    assert read_png(tmp_path / "t.png") == (220, 800)


# -- batching monitor -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Snapshot:
    active_sequences: int
    queue_length: int
    scheduler_steps: int
    decoded_tokens: int
    max_sequences: int = 4
    closed: bool = False


class FakeServing:
    """Implements the monitor protocol: a scheduler thread advancing counters under its own lock."""

    def __init__(self, responses, steps=40):
        self.lock = threading.Lock()
        self.snapshot = Snapshot(0, 0, 0, 0)
        self.responses = responses
        self.steps = steps
        self.shown_mid_run = threading.Event()  # set by the test when the monitor displayed a mid-run step
        self.scheduler = None

    def stats(self):
        with self.lock:
            return self.snapshot

    def generate_many(self, prompts, **kwargs):
        n = len(prompts)

        def run():
            for step in range(1, self.steps + 1):
                with self.lock:
                    self.snapshot = Snapshot(min(n, 4), max(n - 4, 0), step, step * min(n, 4))
                if step == self.steps // 2:
                    self.shown_mid_run.wait(10)  # keep running only once the monitor showed this step
            with self.lock:
                self.snapshot = Snapshot(0, 0, self.steps, self.steps * min(n, 4))

        self.scheduler = threading.Thread(target=run, name="fake-scheduler")
        self.scheduler.start()
        self.scheduler.join()  # the kernel thread is blocked here, as in a real generate_many
        return self.responses[:n]


def test_batching_monitor_updates_live_from_its_own_thread_only(responses):
    batched = [
        with_timings(responses[0], queue_duration=2_000_000, batch_max_sequences=4, batch_peak_sequences=2,
                     scheduler_steps=40, batch_decoded_tokens=160),
        responses[1],  # an ordinary response: batch fields not measured
    ]
    serving = FakeServing(batched)
    monitor = batching_monitor(serving, interval=0.01, start=False)
    box = monitor.widget
    writers = []

    def watch(change):
        writers.append(threading.current_thread())
        text = change["new"]
        if threading.current_thread() is monitor.thread and text not in ("–", "0", f"{serving.steps}"):
            serving.shown_mid_run.set()

    monitor._w["steps"].observe(watch, names="value")
    monitor._w["active"].observe(lambda ch: writers.append(threading.current_thread()), names="value")
    try:
        out = monitor.generate_many(["a", "b"], max_tokens=4)
    finally:
        monitor.stop()
    assert serving.shown_mid_run.is_set(), "no live update reached the widget while generate_many blocked"
    assert out == batched
    assert serving.scheduler not in writers
    assert set(writers) <= {threading.main_thread(), monitor.thread}
    assert monitor.thread in writers and not monitor.running
    final = serving.stats()
    assert monitor.stats.scheduler_steps == final.scheduler_steps == 40
    assert monitor._w["steps"].value == "40" and monitor._w["tokens"].value == f"{final.decoded_tokens:,}"
    assert monitor._w["active"].value == 0 and monitor._w["active"].max == 4
    table = monitor.to_frame()
    assert list(table.index) == ["#0", "#1"]
    assert table.loc["#0", "queue ms"] == 2.0 and table.loc["#0", "peak sequences"] == 2
    assert table.loc["#1", "first token ms"] == responses[1].timings.first_token_duration / 1e6
    assert pd.isna(table.loc["#1", "queue ms"]) and pd.isna(table.loc["#1", "scheduler steps"])
    assert table.loc["#1", "tokens/s"] == responses[1].tokens_per_second()
    page = monitor._repr_html_()
    assert "scheduler steps" in page and f"<td>{MISSING}</td>" in page and "&lt;NA&gt;" not in page
    assert box.children[-1].value in page
    history = monitor.history_frame()
    assert history["scheduler_steps"].is_monotonic_increasing and history["scheduler_steps"].iloc[-1] == 40
    bundle(monitor)


def test_batching_monitor_push_from_a_foreign_thread_never_touches_widgets():
    serving = FakeServing([])
    monitor = batching_monitor(serving, interval=0.01, start=False)
    monitor.widget
    writers = []
    monitor._w["queue"].observe(lambda ch: writers.append(threading.current_thread()), names="value")
    pusher = threading.Thread(target=monitor.push, args=({"active_sequences": 1, "queue_length": 3,
                                                          "scheduler_steps": 7, "decoded_tokens": 9},))
    pusher.start()
    pusher.join()
    assert writers == [] and monitor.stats is None  # stored only; shown at the next refresh
    monitor.refresh()
    assert monitor._w["queue"].value == 3 and writers == [threading.main_thread()]
    assert monitor.stats.max_sequences == -1  # optional field absent: unknown
    monitor.start()
    deadline = time.monotonic() + 10
    while monitor.stats.queue_length != 0 and time.monotonic() < deadline:  # polls serving.stats() again
        time.sleep(0.01)
    monitor.stop()
    assert monitor._w["queue"].value == 0 and pusher not in writers


def test_batching_monitor_does_not_keep_the_lease_alive():
    serving = FakeServing([])
    monitor = batching_monitor(serving, interval=0.01)
    thread = monitor.thread
    del serving
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_batching_monitor_stops_on_closed_or_broken_serving():
    class Closed:
        def stats(self):
            return Snapshot(0, 0, 5, 20, closed=True)

    closed = Closed()
    monitor = batching_monitor(closed, interval=0.01)
    monitor.thread.join(10)
    assert not monitor.running and monitor.stats.closed and "closed" in monitor._repr_html_()

    class Broken:
        def stats(self):
            return {"active_sequences": 1}

    broken = Broken()
    monitor = batching_monitor(broken, interval=0.01)
    monitor.thread.join(10)
    assert not monitor.running and "lacks" in monitor._repr_html_()
    with pytest.raises(TypeError, match="stats"):
        batching_monitor(object())


def test_latency_frame_of_plain_responses_marks_batch_fields_missing(responses):
    frame = latency_frame(responses)
    assert frame["peak sequences"].isna().all() and frame["queue ms"].isna().all()
    assert (frame["generated tokens"] == [r.timings.generated_tokens for r in responses]).all()


def test_llm_never_imports_widgets():
    root = pathlib.Path(llm.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            else:
                continue
            assert not any("widgets" in n or "matplotlib" in n for n in names), (path, names)


def test_monitor_reads_the_schedulers_own_field_names():
    @dataclasses.dataclass(frozen=True)
    class SchedulerStats:  # the spelling of aner_nb.llm.scheduler
        max_sequences: int = 4
        queue_limit: int = 8
        active: int = 2
        waiting: int = 5
        steps: int = 11
        decoded_tokens: int = 30
        completed: int = 3
        closed: bool = False

    class Serving:
        def stats(self):
            return SchedulerStats()

    serving = Serving()
    monitor = batching_monitor(serving, start=False)
    monitor.widget
    shown = monitor.refresh()
    assert dataclasses.asdict(shown) == {"active_sequences": 2, "queue_length": 5, "scheduler_steps": 11, "decoded_tokens": 30,
                     "max_sequences": 4, "queue_capacity": 8, "completed_requests": 3, "closed": False}
    assert monitor._w["queue"].value == 5 and monitor._w["queue"].max == 8 and monitor._w["active"].max == 4


def test_monitor_reads_a_batching_lease_typed_and_refuses_a_lease_without_a_scheduler(model):
    with pytest.raises(TypeError, match="no batching scheduler"):
        batching_monitor(model, start=False)  # an ordinary lease: its stats() refuses (a typed error)
    with model.with_batching(2) as serving:
        serving.generate_many(["a", "b"], max_tokens=2)
        monitor = batching_monitor(serving, start=False)
        shown = monitor.refresh()
        stats = serving.stats()
    assert isinstance(shown, MonitorSnapshot) and shown == read_stats(stats)
    assert (shown.scheduler_steps, shown.decoded_tokens, shown.max_sequences, shown.queue_capacity) == (
        stats.steps, stats.decoded_tokens, 2, stats.queue_limit)
    assert shown.completed_requests == stats.completed == 2 and not shown.closed


def test_speculative_stats_are_typed_and_labelled_only_at_the_edge(responses):
    r = responses[0]
    stats = SpeculativeStats.of(r)
    assert stats.output_hash == r.output_hash and stats.generated_tokens == r.timings.generated_tokens
    labelled = speculative_stats(r)
    assert labelled == stats.labelled() and list(labelled) == [
        f.metadata["label"] for f in dataclasses.fields(SpeculativeStats)]
    assert labelled["tokens per forward call"] == stats.tokens_per_forward_call
    assert labelled["speculative tokens"] == stats.speculative_tokens == r.timings.speculative_tokens
    assert labelled["acceptance rate"] is stats.acceptance_rate is None  # nothing proposed on a plain lease
