"""Prompt lookup inside continuous batching: verified proposals in shared steps, output of the solo greedy run.

With ``free_rows`` every offered draft is verified (the tiny fixtures' second
row costs about a whole step, so the measured policy rightly drafts almost
nothing there); the gating itself is pure arithmetic (``test_draft_policy.py``).
"""

from __future__ import annotations

import pytest
from test_batching import concurrently

from aner_nb import llm

CTX = 2048
REPETITIVE = "Repeat exactly: alpha beta gamma delta, alpha beta gamma delta, alpha beta gamma delta,"
PROMPTS = [REPETITIVE, "the cat sat on the mat and", "a b c d e f g " * 3, "Write one new sentence about weather."]
MAX_TOKENS = [40, 30, 36, 24]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_speculative_batched_tokens_equal_the_request_run_alone(free_rows, fixture_models, arch):
    """Four concurrent requests, one of them sampled: greedy ones verify proposals; every output equals its solo run."""
    with llm.load(fixture_models[arch], context=CTX) as base:
        kwargs = [dict(max_tokens=m) for m in MAX_TOKENS]
        kwargs[3].update(temperature=0.9, seed=5)  # sampled: decodes one token per step beside the others
        alone = [base.generate(p, **kw) for p, kw in zip(PROMPTS, kwargs)]
        with base.with_batching(4, speculative_tokens=8) as serving:
            assert serving.supports("speculative")
            streams = {i: serving.stream(PROMPTS[i], **kwargs[i]) for i in reversed(range(4))}

            def read(i):
                for _ in streams[i]:
                    pass
                return streams[i].response

            batched = concurrently(read, 4)
            stats = serving.stats()
        for a, b in zip(alone, batched):
            assert isinstance(b, llm.Response), b
            assert b.tokens == a.tokens and b.text == a.text and b.finish_reason == a.finish_reason
        t = batched[0].timings
        assert t.speculative_accepted_tokens > 0  # the repetitive request verified runs of proposals
        assert t.speculative_accepted_tokens <= t.speculative_proposed_tokens
        assert t.decode_calls == t.generated_tokens - 1 - t.speculative_accepted_tokens
        assert batched[3].timings.speculative_proposed_tokens == -1  # the sampled request never speculated
        assert stats.failed == 0 and stats.completed == 4
        # the scheduler's decoded-token count includes every accepted proposal (and any verified past an end)
        assert stats.decoded_tokens >= sum(r.timings.generated_tokens for r in batched)


def test_a_lone_speculative_request_on_a_batching_lease_equals_the_latency_lease(free_rows, llama_path):
    with llm.load(llama_path, context=CTX) as base, base.with_optimizer(speculative_tokens=8) as latency, \
            base.with_batching(4, speculative_tokens=8) as serving:
        solo = latency.generate(REPETITIVE, max_tokens=48)
        batched = serving.generate(REPETITIVE, max_tokens=48)
        assert batched.tokens == solo.tokens
        s, b = solo.timings, batched.timings
        assert (b.speculative_proposed_tokens, b.speculative_accepted_tokens, b.decode_calls) == (
            s.speculative_proposed_tokens, s.speculative_accepted_tokens, s.decode_calls)


def test_a_batching_lease_drafts_an_earlier_answer_and_keeps_it_to_itself(free_rows, llama_path):
    prompt = "Write one new sentence about weather."
    with llm.load(llama_path, context=CTX) as base, base.with_batching(2, speculative_tokens=8) as serving, \
            base.with_batching(2, speculative_tokens=8) as other:
        expected = base.generate(prompt, max_tokens=40)
        first = serving.generate(prompt, max_tokens=40)
        second = serving.generate(prompt, max_tokens=40)
        independent = other.generate(prompt, max_tokens=40)
        assert first.tokens == second.tokens == independent.tokens == expected.tokens
        assert second.timings.speculative_accepted_tokens > first.timings.speculative_accepted_tokens
        assert independent.timings.speculative_accepted_tokens == first.timings.speculative_accepted_tokens


def test_drafts_respect_the_sequence_share_and_the_output_limit(free_rows, llama_path):
    """A request filling its sequence's share exactly: proposals never run past its cells or max_tokens."""
    with llm.load(llama_path, context=256) as base, base.with_batching(2, speculative_tokens=16) as serving:
        share = serving.sequence_context
        prompt_tokens = len(serving.prompt_tokens(REPETITIVE))
        n = share - prompt_tokens
        alone = base.generate(REPETITIVE, max_tokens=n)
        batched = serving.generate(REPETITIVE, max_tokens=n)
        assert batched.tokens == alone.tokens and len(batched.tokens) <= n


def test_speculative_tokens_on_batching_are_validated(llama_path):
    with llm.load(llama_path, context=CTX) as base:
        with pytest.raises(llm.errors.ConfigurationError, match="speculative_tokens must be in 0..64"):
            base.with_batching(2, speculative_tokens=65)
        with base.with_batching(2) as plain:
            assert not plain.supports("speculative")


def test_requests_a_speculative_batching_lease_cannot_verify_decode_plainly_beside_it(free_rows, llama_path):
    """Biased, penalised and constrained requests are served as on a plain batching lease, without proposals."""
    with llm.load(llama_path, context=CTX) as base, base.with_batching(2, speculative_tokens=8) as serving:
        for options in (dict(logit_bias={5: 2.0}), dict(repeat_penalty=1.3), dict(grammar='root ::= "a" [a-z]*')):
            alone = base.generate(REPETITIVE, max_tokens=12, **options)
            batched = serving.generate(REPETITIVE, max_tokens=12, **options)
            assert batched.tokens == alone.tokens, options
            assert batched.timings.speculative_proposed_tokens == -1
