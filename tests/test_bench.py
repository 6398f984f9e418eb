"""The paired harness and the divergence diagnostic on the fixtures."""

from __future__ import annotations

import pytest

from aner_nb import bench, llm


@pytest.fixture(scope="module")
def model(llama_path):
    with llm.load(llama_path, context=256) as m:
        yield m


def test_abba_alternates_order_and_summarises():
    calls = []
    a, b = bench.abba(4, lambda: calls.append("A") or 1.0, lambda: calls.append("B") or 2.0, ("A", "B"))
    assert calls == ["A", "B", "B", "A", "A", "B", "B", "A"]
    result = bench.compare("t", a, b, "x", higher_is_better=True)
    assert result["ratio"] == 0.5 and result["a"]["median"] == 1.0 and result["b"]["n"] == 4
    assert "ratio A / B" in bench.format_comparison(result)


def test_run_sides_collects_rows_manifest_and_ratios(model):
    with model.with_optimizer(prefix_cache_entries=1) as cached:
        cases = [bench.Case("q1", "The quay ledger lists Mira as treasurer. Who?", 6),
                 bench.Case("q2", "The quay ledger lists Mira as treasurer. When?", 6)]
        result = bench.run_sides(
            [bench.lease_side("plain", model), bench.lease_side("cached", cached)],
            cases, rounds=2, warmup=1, manifest_=bench.manifest(cached, purpose="test"),
        )
    f = result.frame
    assert len(f) == 2 * 2 * 2 and set(f.side) == {"plain", "cached"}
    assert (f[f.side == "cached"].cached_input_tokens > 0).all()  # warm-up filled the pool
    assert (f[f.side == "plain"].cached_input_tokens == 0).all()
    assert result.same_outputs("cached").all()
    summary = result.summary(("first_token_ms", "total_ms"))
    base = summary[summary.side == "plain"]
    assert (base.ratio_to_baseline == 1.0).all()
    m = result.manifest
    assert m["model"]["fingerprint"] == model.fingerprint and m["purpose"] == "test"
    assert m["model"]["profile"]["optimizer"]["prefix_cache_entries"] == 1
    assert m["packages"]["llama-cpp-python"] == "0.3.36"


def test_divergence_of_identical_outputs_is_none(model):
    r = model.generate("same", max_tokens=8)
    assert bench.divergence(model, "same", r.tokens, r.tokens).position is None


def test_divergence_reports_position_and_top2_gap(model):
    r = model.generate("diverge here", max_tokens=8)
    changed = list(r.tokens)
    changed[3] = (changed[3] + 1) % model._weights.native.n_vocab
    d = bench.divergence(model, "diverge here", r.tokens, changed)
    assert d.position == 3 and d.token_a == r.tokens[3] and d.token_b == changed[3]
    assert d.top1 == r.tokens[3]  # the replay is plain greedy decoding
    assert d.logit_b <= d.logit_a - d.gap + 1e-6  # token_b scores at most the runner-up
    assert d.gap >= 0 and d.perturbation >= 0 and d.near_tie == (d.gap <= 2 * d.perturbation)


def test_divergence_when_one_output_stops_early(model):
    r = model.generate("stop early", max_tokens=8)
    d = bench.divergence(model, "stop early", r.tokens, r.tokens[:5])
    assert d.position == 5 and d.token_b is None and d.token_a == r.tokens[5]
