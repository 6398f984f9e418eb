"""Fuzzing llama.cpp's grammar parser behind aner_nb's bounds (issue 24), in a child process.

Hypothesis builds GBNF texts, valid-ish (rules, groups, literals, classes,
repetitions, tokens, comments) and hostile (deep nesting, long chains,
inverted or huge repetitions, NUL, stray syntax). Each goes through
``check_grammar_text``; what it refuses must be refused with
``InvalidRequestError`` (param ``grammar``), and what it admits is parsed by
llama.cpp's real parser in a child (``tests/fixtures/grammar_child.py``),
which must answer (parsed or refused) and never die by a signal or hang.
Runs derandomized; ``ANER_FUZZ_GRAMMAR_EXAMPLES=20000`` runs longer on demand
(``fuzz/fuzz_grammar.py`` is the coverage-guided target).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from aner_nb.llm.constraints import MAX_GROUP_DEPTH, check_grammar_text
from aner_nb.llm.errors import InvalidRequestError
from fixtures.grammar_child import GrammarChild

EXAMPLES = int(os.environ.get("ANER_FUZZ_GRAMMAR_EXAMPLES", "250"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def child(llama_path):
    worker = GrammarChild(str(llama_path))
    yield worker
    worker.close()


name = st.sampled_from(["root", "a", "b", "x-1", "ws"])
literal = st.text(alphabet='abc"\\(){}[]#\n', max_size=6).map(lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"')
klass = st.sampled_from(["[a-z]", "[^\\]]", "[0-9-]", "[]", "[\\x41-\\u0042]", "[^"])
repetition = st.one_of(st.sampled_from(["*", "+", "?", "{2}", "{0,3}", "{1,}", "{3,1}", "{2000}", "{2001}", "{0,2000}", "{ 2 , 4 }"]),
                       st.tuples(st.integers(0, 2100), st.integers(0, 2100)).map(lambda t: "{%d,%d}" % t))


@st.composite
def item(draw, depth=0):
    kind = draw(st.integers(0, 6 if depth < 3 else 4))
    if kind == 0:
        out = draw(literal)
    elif kind == 1:
        out = draw(klass)
    elif kind == 2:
        out = draw(name)
    elif kind == 3:
        out = draw(st.sampled_from([".", "<[1]>", "!<[2]>", "<a>"]))
    elif kind == 4:
        out = draw(st.sampled_from(["# comment (((\n ", " | ", "\n"]))
    else:
        inner = " ".join(draw(st.lists(item(depth + 1), min_size=1, max_size=4)))
        out = "(" + inner + draw(st.sampled_from([")", ")", " | " + inner + ")", ""]))
    if draw(st.booleans()):
        out += draw(repetition)
    return out


@st.composite
def grammar(draw):
    rules = []
    for rule in ["root"] + draw(st.lists(name, max_size=3)):
        rules.append(f"{rule} ::= " + " ".join(draw(st.lists(item(), min_size=1, max_size=6))))
    text = "\n".join(rules)
    hostile = draw(st.integers(0, 5))
    if hostile == 1:  # deep nesting around the whole first rule body
        depth = draw(st.sampled_from([10, MAX_GROUP_DEPTH, MAX_GROUP_DEPTH + 1, 20_000]))
        text = "root ::= " + "(" * depth + text.split("::=", 1)[1].split("\n", 1)[0] + ")" * depth
    elif hostile == 2:  # a long chain of leftmost references
        n = draw(st.sampled_from([100, 5000]))
        text = "\n".join(f"c{i} ::= c{i + 1} \"x\"" for i in range(n)) + f'\nc{n} ::= "y"\nroot ::= c0'
    elif hostile == 3:
        text += draw(st.sampled_from(["\0", " \ud800", ")" * 5, "(" * 3000]))
    return text


@FUZZ
@given(grammar())
def test_admitted_grammars_never_crash_llama_cpp(child, text):
    try:
        check_grammar_text(text)
    except InvalidRequestError as exc:
        assert exc.param == "grammar" and str(exc).startswith("grammar: ")
        return
    outcome = child.parse(text)
    assert outcome in ("parsed", "refused"), f"llama.cpp {outcome} on an admitted grammar: {text[:300]!r}"


@FUZZ
@given(st.text(alphabet='root ::="ab[]()|*+?{},0129#\n\\<>!.^-', max_size=120))
def test_random_gbnf_text_never_crashes_llama_cpp(child, text):
    text = "root ::= " + text
    assume(not text.endswith("\\"))  # a dangling escape says nothing more than the ones before it
    try:
        check_grammar_text(text)
    except InvalidRequestError as exc:
        assert exc.param == "grammar"
        return
    assert child.parse(text) in ("parsed", "refused")


def test_the_child_reports_what_it_refuses_and_a_hang(child):
    assert child.parse('root ::= "a"') == "parsed"
    assert child.parse("root ::= (") == "refused"
    starts = child.starts
    quick = GrammarChild(child.model_path, timeout_s=2.0)
    try:  # what the bounds refuse: llama.cpp's n - m wraps around and never returns
        assert quick.parse('root ::= "a"{5,3}') in ("timeout", "refused") or quick.parse('root ::= "a"{5,3}').startswith("signal")
    finally:
        quick.close()
    assert child.parse('root ::= "b"') == "parsed" and child.starts == starts
