"""Text assembly: UTF-8 split across tokens and stop strings split across tokens."""

from hypothesis import given, strategies as st

from aner_nb.llm.text import TextAssembler


def feed_all(pieces, stop=()):
    asm = TextAssembler(stop)
    out = [asm.feed(p) for p in pieces]
    out.append(asm.finish())
    return "".join(out), asm


def test_multibyte_character_split_over_pieces_is_held_until_complete():
    data = "é✓".encode()
    asm = TextAssembler()
    assert asm.feed(data[:1]) == ""
    assert asm.feed(data[1:3]) == "é"
    assert asm.feed(data[3:]) == "✓"


def test_stop_string_across_pieces_cuts_text_before_it():
    text, asm = feed_all([b"Hello ", b"wo", b"rld END", b"ignored"], stop=("END",))
    assert text == "Hello world "
    assert asm.stopped


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    asm = TextAssembler(("STOP",))
    assert asm.feed(b"ab ST") == "ab "
    assert asm.feed(b"AR") == "STAR"
    assert asm.finish() == ""
    assert not asm.stopped


def test_earliest_of_several_stop_strings_wins():
    text, _ = feed_all([b"one two three"], stop=("three", "two"))
    assert text == "one "


def test_incomplete_utf8_at_end_becomes_replacement_character():
    text, _ = feed_all([b"ok\xe2\x9c"])
    assert text == "ok\ufffd"


@given(st.text(), st.lists(st.integers(0, 40), max_size=8))
def test_any_split_reassembles_the_same_text(text, cuts):
    data = text.encode()
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]
    assert feed_all(pieces)[0] == text


@given(st.text(alphabet="abcXY", max_size=30), st.text(alphabet="abcXY", min_size=1, max_size=4), st.integers(1, 5))
def test_output_equals_text_up_to_first_stop(text, stop, step):
    data = text.encode()
    pieces = [data[i : i + step] for i in range(0, len(data), step)]
    out, asm = feed_all(pieces, stop=(stop,))
    i = text.find(stop)
    assert out == (text if i < 0 else text[:i])
    assert asm.stopped == (i >= 0)
