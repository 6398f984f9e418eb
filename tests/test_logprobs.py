"""Logprobs, prompt logprobs and logit_bias in the library, against llama-cpp-python's own logits.

The oracle is llama-cpp-python's high-level ``Llama(logits_all=True)``: it
evaluates the same token ids in the same batches (each ``llama_decode`` of
the run is recorded and replayed, so the CPU kernels see the same batch
shapes), and the log-softmax of the same position's logits row must equal
each chosen token's logprob and its top-5 alternatives: within 1e-4 on the
tiny llama fixture, within 1e-3 on the SmolLM2 demo model. Flash attention
is set explicitly on both sides (``off``), since the two kernels round
differently.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from aner_nb import llm
from aner_nb.llm import _engine
from aner_nb.llm.errors import InvalidRequestError, UnsupportedFeatureError
from aner_nb.llm.logprobs import Piece, TokenLogprob, log_normalizer, pieces_logprobs, token_logprob, top_tokens

llama_cpp = pytest.importorskip("llama_cpp")

CONTEXT = 1024
TOP = 5
FIXTURE_TOLERANCE = 1e-4
DEMO_TOLERANCE = 1e-3
REPEATING = "one two three four one two three four one two three four one two three"


# -- the oracle --------------------------------------------------------------------------------------
class DecodeRecorder:
    """Records every llama_decode of the contexts created while it is installed: (first position, tokens)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int]]] = []
        self.lock = threading.Lock()

    def __call__(self, original):
        recorder = self

        def decode(ctx, batch):
            n = batch.n_tokens
            with recorder.lock:
                recorder.calls.append((int(batch._pos[0]), [int(t) for t in batch._token[:n]]))
            return original(ctx, batch)

        return decode


@pytest.fixture
def recorded(monkeypatch):
    recorder = DecodeRecorder()
    monkeypatch.setattr(_engine.NativeContext, "decode", recorder(_engine.NativeContext.decode))
    return recorder


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float64)
    peak = rows.max(axis=1, keepdims=True)
    return rows - (peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True)))


def oracle_rows(ref, calls: list[tuple[int, list[int]]], n_positions: int) -> np.ndarray:
    """Replay the recorded decodes on the oracle (a batch at position P drops the KV from P on, as
    llama-cpp-python's eval does) and return the log-softmax of its rows for positions 0..n-1."""
    ref.reset()
    for first, tokens in calls:
        ref.n_tokens = first
        ref.eval(tokens)
    return _log_softmax(ref.scores[:n_positions])


def max_difference(entries, rows: np.ndarray, first_row: int, tolerance: float = FIXTURE_TOLERANCE) -> float:
    """Largest |ours - oracle| over each entry's token and its alternatives (entry j from row first_row + j)."""
    worst = 0.0
    for j, entry in enumerate(entries):
        row = rows[first_row + j]
        worst = max(worst, abs(entry.logprob - row[entry.token]))
        assert len(entry.top) == TOP
        for alt in entry.top:
            worst = max(worst, abs(alt.logprob - row[alt.token]))
        # the alternatives are the oracle's most likely tokens, most likely first
        expected = np.sort(row)[::-1][:TOP]
        assert np.allclose([a.logprob for a in entry.top], expected, atol=tolerance)
    return worst


@pytest.fixture(scope="module")
def loaded(llama_path):
    model = llm.load(llama_path, context=CONTEXT, flash_attention="off")
    yield model
    model.close()


@pytest.fixture(scope="module")
def base(loaded):
    model = loaded.with_optimizer(threads=1, prefill_threads=1)
    yield model
    model.close()


@pytest.fixture(scope="module")
def oracle(llama_path):
    ref = llama_cpp.Llama(model_path=str(llama_path), logits_all=True, n_ctx=CONTEXT, n_threads=1,
                          n_threads_batch=1, flash_attn=False, verbose=False)
    yield ref
    ref.close()


# -- the pure math -----------------------------------------------------------------------------------
def test_log_normalizer_is_stable_for_huge_logits():
    row = np.array([1000.0, 1000.0, -1000.0], dtype=np.float32)
    assert log_normalizer(row) == pytest.approx(1000.0 + math.log(2.0))


def test_top_tokens_are_the_largest_first_and_ties_in_id_order():
    row = np.array([0.5, 3.0, 1.0, 3.0, -2.0], dtype=np.float32)
    assert top_tokens(row, 3).tolist() == [1, 3, 2]
    assert top_tokens(row, 0).tolist() == []
    assert top_tokens(row, 99).tolist() == [1, 3, 2, 0, 4]


def test_token_logprob_is_the_log_softmax_of_the_raw_row():
    rng = np.random.default_rng(7)
    row = rng.normal(size=300).astype(np.float32) * 5
    entry = token_logprob(row, 17, 4, lambda t: f"<{t}>".encode())
    expected = _log_softmax(row[None, :])[0]
    assert entry.logprob == pytest.approx(expected[17], abs=1e-12)
    assert [a.token for a in entry.top] == list(np.argsort(-expected)[:4])
    assert entry.piece == b"<17>" and entry.text == "<17>"
    assert sum(math.exp(v) for v in expected) == pytest.approx(1.0)
    assert 0.0 < entry.probability <= 1.0


def test_a_piece_is_a_string_that_carries_logprobs():
    entry = TokenLogprob(3, b"a", -0.5)
    piece = Piece("ab", [entry])
    assert piece == "ab" and isinstance(piece, str) and piece.logprobs == (entry,)
    assert pieces_logprobs([piece, "plain", Piece("c", [entry])]) == (entry, entry)


# -- validation ----------------------------------------------------------------------------------------
def test_option_bounds_name_the_option(base):
    with pytest.raises(InvalidRequestError) as top:
        base.generate("hi", max_tokens=2, top_logprobs=3)
    assert top.value.param == "top_logprobs"
    with pytest.raises(InvalidRequestError) as high:
        base.generate("hi", max_tokens=2, logprobs=True, top_logprobs=21)
    assert high.value.param == "top_logprobs"
    for bias in ({10**6: 1.0}, {-1: 1.0}, {1: 101.0}, {1: float("nan")}, {"x": 1.0}, [1, 2],
                 {i: 1.0 for i in range(1025)}):
        with pytest.raises(InvalidRequestError) as bad:
            base.generate("hi", max_tokens=2, logit_bias=bias)
        assert bad.value.param.startswith("logit_bias"), bias


def test_logit_bias_keys_may_be_digit_strings_as_openai_sends_them():
    settings = llm.RequestSettings(logit_bias={"7": -5, 3: 2.5})
    assert settings.logit_bias == ((3, 2.5), (7, -5.0))
    assert not settings.plain_argmax


def test_without_logprobs_nothing_is_recorded(base):
    response = base.generate("hello there", max_tokens=4)
    assert response.logprobs is None and response.prompt_logprobs is None
    assert all(type(p) is str for p in base.stream("hello there", max_tokens=4))


# -- against the oracle: the fixture ---------------------------------------------------------------------
def test_generated_logprobs_equal_the_oracle_on_the_fixture(base, oracle, recorded):
    response = base.generate("hello there", max_tokens=24, logprobs=True, top_logprobs=TOP)
    prompt = base.prompt_tokens("hello there")
    assert len(response.logprobs) == len(response.tokens) > 0
    assert [e.token for e in response.logprobs] == list(response.tokens)
    rows = oracle_rows(oracle, recorded.calls, len(prompt) + len(response.tokens))
    worst = max_difference(response.logprobs, rows, len(prompt) - 1)
    assert worst < FIXTURE_TOLERANCE, worst
    greedy = response.logprobs[0]
    assert greedy.top[0].token == greedy.token  # greedy: the chosen token is the most likely one


def test_sampled_logprobs_are_the_raw_distribution_not_the_filtered_one(base, oracle, recorded):
    response = base.generate("hello there", max_tokens=16, temperature=0.9, top_k=3, seed=11, logprobs=True,
                             top_logprobs=TOP)
    prompt = base.prompt_tokens("hello there")
    rows = oracle_rows(oracle, recorded.calls, len(prompt) + len(response.tokens))
    assert max_difference(response.logprobs, rows, len(prompt) - 1) < FIXTURE_TOLERANCE


def test_speculative_lease_logprobs_come_from_each_verified_row(free_rows, loaded, oracle, recorded):
    spec = loaded.with_optimizer(threads=1, prefill_threads=1, speculative_tokens=4)
    try:
        response = spec.complete(REPEATING, max_tokens=40, logprobs=True, top_logprobs=TOP)
    finally:
        spec.close()
    assert response.timings.speculative_accepted_tokens > 0  # several tokens were verified per step
    prompt = spec.prompt_tokens(REPEATING, raw=True)
    rows = oracle_rows(oracle, recorded.calls, len(prompt) + len(response.tokens))
    assert max_difference(response.logprobs, rows, len(prompt) - 1) < FIXTURE_TOLERANCE
    plain = loaded.with_optimizer(threads=1, prefill_threads=1)
    try:
        assert plain.complete(REPEATING, max_tokens=40).tokens == response.tokens
    finally:
        plain.close()


def test_batching_lease_logprobs_equal_the_oracle(base, oracle, recorded):
    batching = base.with_batching(2)
    try:
        response = batching.generate("tell me about the harbour", max_tokens=20, logprobs=True, top_logprobs=TOP)
        prompt = batching.prompt_tokens("tell me about the harbour")
        rows = oracle_rows(oracle, recorded.calls, len(prompt) + len(response.tokens))
        assert max_difference(response.logprobs, rows, len(prompt) - 1) < FIXTURE_TOLERANCE
        # Concurrent sequences: each reads its own row of the shared step (same tokens as alone). Rows of a
        # two-sequence step go through other matrix kernels than a one-row step, so the oracle (one sequence)
        # agrees to rounding (measured below 1e-2), far below what another position's row would differ by.
        recorded.calls.clear()
        both = batching.generate_many(["tell me about the harbour", "hello there"], max_tokens=20, logprobs=True,
                                      top_logprobs=TOP)
        assert both[0].tokens == response.tokens
        assert max_difference(both[0].logprobs, rows, len(prompt) - 1, 2e-2) < 2e-2
        with pytest.raises(UnsupportedFeatureError) as refused:
            batching.complete("x y", max_tokens=0, prompt_logprobs=True)
        assert refused.value.param == "prompt_logprobs"
    finally:
        batching.close()


def test_streamed_logprobs_equal_the_whole_answers(base):
    whole = base.generate("hello there", max_tokens=20, logprobs=True, top_logprobs=TOP)
    stream = base.stream("hello there", max_tokens=20, logprobs=True, top_logprobs=TOP)
    pieces = list(stream)
    carried = pieces_logprobs(pieces)
    assert carried == stream.response.logprobs == whole.logprobs
    assert all(isinstance(p, Piece) and p.logprobs for p in pieces)
    assert "".join(pieces) == whole.text


def test_a_stop_string_keeps_tokens_and_logprobs_aligned(base):
    whole = base.generate("hello there", max_tokens=20)
    stop = whole.text[6:9]
    stopped = base.generate("hello there", max_tokens=20, stop=stop, logprobs=True)
    assert stopped.finish_reason == "stop"
    assert [e.token for e in stopped.logprobs] == list(stopped.tokens)


def test_prompt_logprobs_equal_the_oracle_and_score_without_generating(base, oracle, recorded):
    text = "the harbour was quiet that morning"
    scored = base.complete(text, max_tokens=0, prompt_logprobs=True, top_logprobs=TOP)
    prompt = base.prompt_tokens(text, raw=True)
    assert scored.tokens == () and scored.finish_reason == "length" and scored.logprobs is None
    assert len(scored.prompt_logprobs) == len(prompt) and scored.prompt_logprobs[0] is None
    assert [e.token for e in scored.prompt_logprobs[1:]] == prompt[1:]
    rows = oracle_rows(oracle, recorded.calls, len(prompt))
    assert max_difference(scored.prompt_logprobs[1:], rows, 0) < FIXTURE_TOLERANCE
    both = base.complete(text, max_tokens=5, prompt_logprobs=True, logprobs=True)
    assert [e.logprob for e in both.prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in scored.prompt_logprobs[1:]], abs=FIXTURE_TOLERANCE)
    assert len(both.logprobs) == len(both.tokens) == 5


def test_a_long_scored_prompt_is_evaluated_in_bounded_chunks(base, oracle, recorded, monkeypatch):
    from aner_nb.llm import runner

    monkeypatch.setattr(runner, "PROMPT_LOGITS_BYTES", 3 * 4 * base.facts.vocab_size)  # 3 rows of logits per chunk
    text = "the harbour was quiet that morning, and the boats lay still"
    scored = base.complete(text, max_tokens=3, prompt_logprobs=True, logprobs=True, top_logprobs=TOP)
    prompt = base.prompt_tokens(text, raw=True)
    prefill = [tokens for _, tokens in recorded.calls[: -(len(scored.tokens) - 1) or None]]
    assert max(len(t) for t in prefill) == 3 and sum(len(t) for t in prefill) == len(prompt)
    rows = oracle_rows(oracle, recorded.calls, len(prompt) + len(scored.tokens))
    assert max_difference(scored.prompt_logprobs[1:], rows, 0) < FIXTURE_TOLERANCE
    assert max_difference(scored.logprobs, rows, len(prompt) - 1) < FIXTURE_TOLERANCE


def test_prompt_logprobs_on_a_prefix_cache_lease_evaluate_the_whole_prompt(loaded):
    cached = loaded.with_optimizer(threads=1, prefill_threads=1, prefix_cache_entries=1)
    try:
        text = "the harbour was quiet that morning"
        cached.complete(text, max_tokens=2)  # retains the prompt
        scored = cached.complete(text, max_tokens=0, prompt_logprobs=True)
        assert scored.usage.cached_input_tokens == 0
        assert scored.prompt_logprobs[0] is None and all(e is not None for e in scored.prompt_logprobs[1:])
    finally:
        cached.close()


def test_a_session_refuses_prompt_logprobs(base):
    session = base.session()
    try:
        with pytest.raises(UnsupportedFeatureError) as refused:
            session.generate("hi", max_tokens=2, prompt_logprobs=True)
        assert refused.value.param == "prompt_logprobs"
    finally:
        session.close()


# -- logit_bias ---------------------------------------------------------------------------------------
def test_a_bias_of_minus_100_on_the_greedy_token_bans_it(base):
    plain = base.generate("hello there", max_tokens=12)
    banned = plain.tokens[0]
    biased = base.generate("hello there", max_tokens=12, logit_bias={banned: -100})
    assert biased.tokens != plain.tokens
    assert banned not in biased.tokens
    again = base.generate("hello there", max_tokens=12, logit_bias={banned: -100})
    assert again.tokens == biased.tokens  # greedy with a bias is still deterministic


def test_a_positive_bias_forces_a_token_and_logprobs_stay_raw(base, oracle, recorded):
    plain = base.generate("hello there", max_tokens=6, logprobs=True)
    forced = 42 if 42 not in plain.tokens[:1] else 43
    biased = base.generate("hello there", max_tokens=6, logit_bias={forced: 100}, logprobs=True, top_logprobs=TOP)
    assert set(biased.tokens) == {forced}
    prompt = base.prompt_tokens("hello there")
    rows = oracle_rows(oracle, recorded.calls[-(1 + len(biased.tokens)):], len(prompt) + len(biased.tokens))
    assert biased.logprobs[0].logprob == pytest.approx(rows[len(prompt) - 1][forced], abs=FIXTURE_TOLERANCE)
    assert biased.logprobs[0].logprob < biased.logprobs[0].top[0].logprob  # the raw row, before the bias


def test_a_speculative_lease_refuses_logit_bias(loaded):
    spec = loaded.with_optimizer(threads=1, prefill_threads=1, speculative_tokens=2)
    try:
        with pytest.raises(InvalidRequestError) as refused:
            spec.generate("hi", max_tokens=2, logit_bias={1: -100})
        assert refused.value.param == "logit_bias"
    finally:
        spec.close()


def test_batched_logit_bias_equals_the_solo_answer(base):
    plain = base.generate("hello there", max_tokens=10)
    solo = base.generate("hello there", max_tokens=10, logit_bias={plain.tokens[0]: -100})
    batching = base.with_batching(2)
    try:
        batched = batching.generate_many(["hello there", "tell me about the harbour"], max_tokens=10,
                                         logit_bias={plain.tokens[0]: -100})
    finally:
        batching.close()
    assert batched[0].tokens == solo.tokens


# -- the demo model --------------------------------------------------------------------------------------
@pytest.mark.demo
def test_logprobs_equal_the_oracle_on_the_demo_model(recorded):
    from aner_nb.demo_model import demo_model_path

    path = demo_model_path()
    model = llm.load(path, context=512, flash_attention="off")
    lease = model.with_optimizer(threads=1, prefill_threads=1)
    ref = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=512, n_threads=1, n_threads_batch=1,
                          flash_attn=False, verbose=False)
    try:
        question = "What is the capital of France?"
        response = lease.generate(question, max_tokens=16, logprobs=True, top_logprobs=TOP)
        prompt = lease.prompt_tokens(question)
        rows = oracle_rows(ref, recorded.calls, len(prompt) + len(response.tokens))
        assert max_difference(response.logprobs, rows, len(prompt) - 1, DEMO_TOLERANCE) < DEMO_TOLERANCE
        recorded.calls.clear()
        scored = lease.complete("The capital of France is Paris.", max_tokens=0, prompt_logprobs=True,
                                top_logprobs=TOP)
        tokens = lease.prompt_tokens("The capital of France is Paris.", raw=True)
        rows = oracle_rows(ref, recorded.calls, len(tokens))
        assert max_difference(scored.prompt_logprobs[1:], rows, 0, DEMO_TOLERANCE) < DEMO_TOLERANCE
    finally:
        ref.close()
        lease.close()
        model.close()


# -- the notebook view -----------------------------------------------------------------------------------
def test_the_logprobs_view_colours_each_token_with_its_alternatives_on_hover(base):
    from aner_nb.widgets import LogprobsView, logprobs_view
    from aner_nb.widgets.logprobs import probability_colour

    response = base.generate("hello there", max_tokens=8, logprobs=True, top_logprobs=3)
    view = logprobs_view(response)
    assert isinstance(view, LogprobsView)
    page = view._repr_html_()
    assert page.count("class='aner-token'") == len(response.tokens)
    first = response.logprobs[0]
    assert probability_colour(first.probability) in page
    assert f"p={first.top[1].probability:.4f}" in page  # an alternative, in the hover text
    frame = view.to_frame()
    assert list(frame["token"]) == list(response.tokens) and list(frame["part"]) == ["output"] * len(response.tokens)
    assert frame["probability"].between(0, 1).all()
    bundle = view._repr_mimebundle_()
    assert bundle["text/html"] == page and "application/vnd.jupyter.widget-view+json" in bundle
    assert view.perplexity() >= 1.0
    assert probability_colour(0.0) == "hsl(0, 75%, 82%)" and probability_colour(1.0) == "hsl(120, 75%, 82%)"
    with pytest.raises(ValueError, match="logprobs=True"):
        logprobs_view(base.generate("hello there", max_tokens=2))


def test_the_logprobs_view_shows_a_scored_prompt(base):
    from aner_nb.widgets import logprobs_view

    scored = base.complete("the harbour <was> quiet", max_tokens=0, prompt_logprobs=True)
    view = logprobs_view(scored, prompt=True)
    page = view._repr_html_()
    assert "&lt;" in page and "<was" not in page  # token text is escaped
    assert page.count("class='aner-token'") == len(scored.prompt_logprobs) - 1
    assert list(view.to_frame()["part"]) == ["prompt"] * (len(scored.prompt_logprobs) - 1)
