"""The paired harness and the divergence diagnostic on the fixtures."""

from __future__ import annotations

import warnings

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
    with warnings.catch_warnings():  # a metric the baseline never has (its median is 0): no ratio, no warning
        warnings.simplefilter("error")
        counts = result.summary(("cached_input_tokens",))
    assert counts[counts.side == "cached"].ratio_to_baseline.isna().all()
    m = result.manifest
    assert m["model"]["fingerprint"] == model.fingerprint and m["purpose"] == "test"
    assert m["model"]["profile"]["optimizer"]["prefix_cache_entries"] == 1
    assert m["packages"]["llama-cpp-python"] == "0.3.36"
    # the seed's measured-evidence rules: resolved engine settings, machine, build, order, load
    from aner_nb.llm._engine import default_threads

    assert (m["model"]["n_threads"], m["model"]["n_threads_batch"]) == default_threads()
    assert m["model"]["n_batch"] == 512 and m["model"]["context"] == 256
    assert m["model"]["flash_attention"] in ("auto", "on", "off") and m["model"]["kv_cache_type"] == "f16"
    assert "CPU :" in m["system_info"] and m["cpu_count_logical"] >= 1 and m["cpu"]
    assert m["rounds"] == 2 and m["warmup"] == 1 and m["order"] == "ABBA"
    assert len(m["load_average_start"]) == 3 and len(m["load_average_end"]) == 3
    assert "git_revision" in m


def test_lease_settings_are_typed_and_json_only_in_the_manifest(model):
    with model.with_optimizer(threads=1, prefill_threads=1) as tuned:
        settings = bench.lease_settings(tuned)
        manifest = bench.manifest(tuned)
    assert isinstance(settings, bench.LeaseSettings) and settings.profile is tuned.profile
    assert (settings.n_threads, settings.n_threads_batch, settings.kind, settings.context) == (1, 1, "ordinary", 256)
    assert {k: manifest["model"][k] for k in settings.as_dict()} == settings.as_dict()
    assert manifest["model"]["profile"]["optimizer"]["threads"] == 1  # the profile as nested dicts
    assert bench.lease_settings(object()) is None


def test_one_benchmark_at_a_time(model, tmp_path, monkeypatch):
    """A second benchmark refuses to start while another process holds the lock; re-entrant here."""
    import subprocess
    import sys
    import time

    monkeypatch.setenv("ANER_NB_CACHE", str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom aner_nb.bench import exclusive\n"
         "with exclusive('other benchmark'):\n    print('held', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        side = bench.lease_side("plain", model)
        with pytest.raises(bench.BenchmarkBusyError, match=f"other benchmark, pid {holder.pid}"):
            bench.run_sides([side], [bench.Case("q", "hi", 2)], rounds=1, warmup=0)
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    with bench.exclusive("outer"):  # free again; run_sides inside a held lock re-enters it
        result = bench.run_sides([bench.lease_side("plain", model)], [bench.Case("q", "hi", 2)], rounds=1, warmup=0)
    assert len(result.frame) == 1


def test_divergence_of_identical_outputs_is_none(model):
    r = model.generate("same", max_tokens=8)
    assert bench.divergence(model, "same", r.tokens, r.tokens, shape=bench.BatchShape.prefill()).position is None


def test_near_tie_rule_judges_the_emitted_tokens():
    assert bench.is_near_tie(1.0, 0.99, 0.01)  # 0.01 <= 0.02
    assert not bench.is_near_tie(1.0, 0.9, 0.01)
    assert bench.is_near_tie(2.0, 2.0, 0.0)  # an exact tie
    with pytest.raises(ValueError, match="kind"):
        bench.BatchShape("arbitrary")
    with pytest.raises(ValueError, match="size"):
        bench.BatchShape.sequences(0)


@pytest.mark.parametrize("shape", [bench.BatchShape.prefill(), bench.BatchShape.verification(6),
                                   bench.BatchShape.sequences(4)], ids=lambda s: s.kind)
def test_a_wrong_low_ranked_token_is_never_a_near_tie(model, shape):
    """A token plain decoding ranks far down is not excused, whatever the top-2 gap is."""
    prompt = "diverge here"
    r = model.generate(prompt, max_tokens=8)
    plain = bench.divergence(model, prompt, r.tokens, r.tokens[:3] + (r.tokens[3],), shape=shape)
    assert plain.position == 4  # b stopped after 4 tokens: judged against end of generation
    wrong = list(r.tokens)
    # A byte token that plain decoding ranks low at position 3: the fixture's output layer gives
    # non-printable bytes a zero row, far below every printable token.
    wrong[3] = 1
    d = bench.divergence(model, prompt, r.tokens, wrong, shape=shape)
    assert d.position == 3 and d.token_a == r.tokens[3] and d.token_b == 1
    assert d.top1 == r.tokens[3]  # the replay is plain greedy decoding
    assert d.rank_b > 10 and d.gap == pytest.approx(d.logit_a - d.logit_b) and d.gap > 0
    assert d.perturbation >= 0 and d.shape.startswith(shape.kind)
    assert d.near_tie is False


def tie_model(tmp_path):
    """The llama fixture with ``e`` and ``t`` sharing one output row: an exact tie at every position."""
    from fixtures.models import write_tiny_model

    return write_tiny_model(tmp_path / "tie.gguf", "llama", tie_tokens=(ord("e"), ord("t")))


def greedy_after(path, tokens, n):
    """Up to ``n`` greedy tokens after ``tokens``, from llama-cpp-python's own ``Llama`` (an oracle)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=512, n_ubatch=128, n_gpu_layers=0, verbose=False)
    try:
        out = []
        for token in ref.generate(list(tokens), temp=0.0, repeat_penalty=1.0, reset=True):
            if llama_cpp.llama_vocab_is_eog(ref._model.vocab, token) or len(out) == n:
                break
            out.append(token)
        return out
    finally:
        ref.close()


def test_an_exact_tie_between_identical_output_rows_is_a_near_tie(tmp_path):
    """A real tie: two tokens with identical output rows get identical logits at every position.

    Greedy picks the lower id (first maximum); emitting the other one instead is
    a difference no batch shape needs to explain (gap 0), and the rule says so.
    """
    with llm.load(tie_model(tmp_path), context=256) as m:
        r = m.generate("tie", max_tokens=6)
        position = next(i for i, t in enumerate(r.tokens) if t == ord("e"))
        twin = list(r.tokens[:position]) + [ord("t")]  # ends at the flip: nothing after it to judge
        d = bench.divergence(m, "tie", r.tokens, twin, shape=bench.BatchShape.verification(4))
        assert d.position == position and d.gap == 0.0 and d.rank_b == 1
        assert d.later_position is None and d.near_tie is True


def test_a_second_divergence_in_the_same_output_is_never_excused(tmp_path):
    """At most one excused divergence per output: an output that takes the tied twin twice fails,
    though each flip alone is an exact tie (gap 0)."""
    path = tie_model(tmp_path)
    with llm.load(path, context=256) as m:
        prompt = m.prompt_tokens("tie")
        a = list(m.generate("tie", max_tokens=24).tokens)
        p1 = a.index(ord("e"))
        one = a[:p1] + [ord("t")]
        one += greedy_after(path, prompt + one, 24 - len(one))  # then plain greedy of its own history
        assert ord("e") in one[p1 + 1:], one  # greedy takes e again later: a second place to flip
        d = bench.divergence(m, "tie", a, one, shape=bench.BatchShape.prefill())
        assert d.position == p1 and d.gap == 0.0 and d.later_position is None
        assert d.near_tie is True  # one flip, and plain greedy decoding after it: excused
        p2 = one.index(ord("e"), p1 + 1)
        two = one[:p2] + [ord("t")]  # the same output flipping the tie a second time
        d = bench.divergence(m, "tie", a, two, shape=bench.BatchShape.prefill())
        assert d.position == p1 and d.gap == 0.0  # the first flip alone passes the rule ...
        assert d.later_position == p2  # ... but a second one follows
        assert d.near_tie is False


def test_a_second_ranked_token_ten_times_the_perturbation_away_is_not_a_near_tie(fixture_models):
    """Negative control: the other side's token is plain decoding's second choice, but its logit gap is
    at least 10x the movement the batch shape causes: not excused, however "close" rank 2 sounds."""
    with llm.load(fixture_models["llama_q8_0"], context=512) as m:  # quantized: the shape really moves logits
        prompt = "one two three four five six seven eight nine ten one two three"
        a = list(m.generate(prompt, max_tokens=12).tokens)
        shape = bench.BatchShape.prefill()  # re-evaluating ~80 tokens as one prefill moves these logits
        checked = 0
        for k in range(1, len(a)):
            probe = bench.divergence(m, prompt, a, a[:k], shape=shape)  # top1/top2 and movement at k
            assert probe.top1 == a[k]
            second = probe.top2
            d = bench.divergence(m, prompt, a, a[:k] + [second], shape=shape)
            assert d.position == k and d.rank_b == 2 and d.perturbation == pytest.approx(probe.perturbation)
            if d.perturbation > 0 and d.gap >= 10 * d.perturbation:
                assert d.near_tie is False, d
                checked += 1
        assert checked >= 1  # the control really ran: some position had such a gap
        assert bench.is_near_tie(1.0, 1.0 - 10 * 0.01, 0.01) is False  # the rule itself: 10x > 2x


def test_divergence_when_one_output_stops_early(model):
    r = model.generate("stop early", max_tokens=8)
    d = bench.divergence(model, "stop early", r.tokens, r.tokens[:5], shape=bench.BatchShape.prefill())
    assert d.position == 5 and d.token_a == r.tokens[5]
    assert d.token_b == model._weights.native.eos  # stopping is choosing end of generation


def test_a_prefix_cached_shape_also_measures_the_split_prefill(fixture_models):
    """A prefix-cached request prefilled only its prompt's tail, in chunks from the cached length: that
    path moves the logits too, and the shape with ``cached=`` takes the larger of the two movements."""
    with llm.load(fixture_models["llama_q8_0"], context=512) as m:
        prompt = "one two three four five six seven eight nine ten one two three four five six"
        a = list(m.generate(prompt, max_tokens=6).tokens)
        n = len(m.prompt_tokens(prompt))
        whole = bench.divergence(m, prompt, a, a[:3], shape=bench.BatchShape.prefill())
        split = bench.divergence(m, prompt, a, a[:3], shape=bench.BatchShape.prefill(cached=n // 2))
        assert split.perturbation >= whole.perturbation and split.perturbation > 0
        assert (split.position, split.token_a, split.gap) == (whole.position, whole.token_a, whole.gap)
    with pytest.raises(ValueError, match="cached"):
        bench.BatchShape("sequences", 4, cached=3)
