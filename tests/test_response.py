"""Response and Timings as plain data: integer fields, -1 for unmeasured, NA in frames."""

import dataclasses

import pandas as pd
import pytest

from aner_nb.llm import Response, Timings, Usage


def make(tokens=(1, 2, 3), **timings):
    return Response("abc", tokens, "length", Usage(5, 0, len(tokens)), Timings(**timings))


def test_unmeasured_fields_default_to_minus_one():
    t = Timings()
    assert all(getattr(t, f.name) == -1 for f in dataclasses.fields(t))


@pytest.mark.parametrize("bad", [1.5, True, "3", None])
def test_timings_must_be_integers(bad):
    with pytest.raises(TypeError, match="decode_duration"):
        Timings(decode_duration=bad)
    with pytest.raises(ValueError, match=">= -1"):
        Timings(decode_duration=-2)


def test_tokens_per_second_counts_tokens_after_the_first():
    r = make(decode_duration=2_000_000_000, generated_tokens=5)
    assert r.tokens_per_second() == 2.0
    assert make(decode_duration=-1, generated_tokens=5).tokens_per_second() == -1.0
    assert make(decode_duration=0, generated_tokens=1).tokens_per_second() == -1.0


def test_frame_shows_unmeasured_as_missing_not_zero():
    r = make(decode_duration=2_000_000_000, generated_tokens=5, prompt_eval_duration=0)
    frame = r.to_frame()
    assert frame.loc[0, "decode_duration"] == 2_000_000_000
    assert frame.loc[0, "prompt_eval_duration"] == 0  # measured zero stays zero
    assert pd.isna(frame.loc[0, "queue_duration"])
    assert frame.loc[0, "tokens_per_second"] == 2.0
    assert pd.isna(make().to_frame().loc[0, "tokens_per_second"])


def test_finish_reason_is_checked_and_html_escapes_text():
    with pytest.raises(ValueError, match="finish_reason"):
        Response("", (), "eos", Usage(0, 0, 0), Timings())
    r = Response("<script>", (), "stop", Usage(1, 0, 0), Timings())
    assert "<script>" not in r._repr_html_() and "&lt;script&gt;" in r._repr_html_()
    assert "–" in r._repr_html_()  # unmeasured shown as a dash
