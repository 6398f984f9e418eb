"""Limits for output constraints (issue 24): each bound admits just below it and refuses just above, typed.

Pure policy over ``aner_nb.llm.constraints`` (no model): GBNF texts are
measured lexically and JSON schemas iteratively, so hostile inputs (a 100,000
deep nesting, a 1 MB text, a 10,000-deep schema) are refused with
``InvalidRequestError`` naming the field, never by a RecursionError or a
native crash. Native parses are in ``test_constraints_engine.py`` and
``test_fuzz_grammar.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from aner_nb.llm import constraints as c
from aner_nb.llm.constraints import check_grammar_text, check_json_schema, grammar_figures
from aner_nb.llm.errors import InvalidRequestError
from aner_nb.llm.profiles import RequestSettings


def refused(text: str, *, param: str = "grammar") -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        check_grammar_text(text, param=param)
    assert info.value.param == param
    return info.value


def schema_refused(schema, param="json_schema") -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        check_json_schema(schema, param=param)
    assert info.value.param == param
    return info.value


def nested(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


# -- GBNF -----------------------------------------------------------------------------------------
def test_size_limit_in_bytes():
    frame = len('root ::= ""')
    assert check_grammar_text('root ::= "' + "x" * (c.MAX_GRAMMAR_BYTES - frame) + '"').size_bytes == c.MAX_GRAMMAR_BYTES
    err = refused('root ::= "' + "x" * (c.MAX_GRAMMAR_BYTES - frame + 1) + '"')
    assert f"{c.MAX_GRAMMAR_BYTES + 1:,} bytes" in str(err) and f"{c.MAX_GRAMMAR_BYTES:,}" in str(err)
    multibyte = 'root ::= "' + "é" * ((c.MAX_GRAMMAR_BYTES - frame) // 2 + 1) + '"'  # bytes, not characters
    assert len(multibyte) < c.MAX_GRAMMAR_BYTES
    refused(multibyte)
    assert "1,000,000 bytes" in str(refused("x" * 1_000_000))


def test_group_depth_limit():
    assert check_grammar_text(nested(c.MAX_GROUP_DEPTH)).depth == c.MAX_GROUP_DEPTH
    err = refused(nested(c.MAX_GROUP_DEPTH + 1))
    assert f"groups is {c.MAX_GROUP_DEPTH + 1}" in str(err) and f"at most {c.MAX_GROUP_DEPTH}" in str(err)
    assert "30000" in str(refused(nested(30_000)))
    assert "100000" in str(refused("root ::= " + "(" * 100_000))  # unclosed counts just the same


def test_parentheses_in_literals_classes_tokens_and_comments_do_not_nest():
    hidden = '"((((" [(((] <((((> # ((((((\n'
    text = "root ::= (" + hidden * 2000 + ")"
    assert len(text.encode()) < c.MAX_GRAMMAR_BYTES
    assert grammar_figures(text).depth == 1
    assert grammar_figures('root ::= "\\"(((" (x)').depth == 1  # an escaped quote does not end the literal
    assert grammar_figures("root ::= [\\](((] (x)").depth == 1  # nor an escaped ] the class


def test_repetition_bounds():
    for ok in ('root ::= "a"{2000}', 'root ::= "a"{0,2000}', 'root ::= "a"{2000,}', 'root ::= "a"{3,3}'):
        assert check_grammar_text(ok).max_repetition <= c.MAX_REPETITION
    for bad in ('root ::= "a"{2001}', 'root ::= "a"{0,2001}', 'root ::= "a"{2001,}', 'root ::= "a"{ 99999999999999999999 }'):
        assert f"at most {c.MAX_REPETITION}" in str(refused(bad))
    assert "m <= n" in str(refused('root ::= "a"{5,3}'))  # llama.cpp's n - m wraps around: an endless loop
    assert "m <= n" in str(refused('root ::= ("a" # c\n {5, # c\n 3})'))  # spaces and comments inside the braces


def test_symbol_limit_counts_named_group_and_repetition_rules():
    base = 'root ::= ' + ' '.join(['"a"{0,1999}'] * 10)  # root + 10 x 1,999 generated rules
    assert grammar_figures(base).symbols == 1 + 19_990
    at_limit = base + ' "b"?' * (c.MAX_GRAMMAR_SYMBOLS - 19_991)
    assert check_grammar_text(at_limit).symbols == c.MAX_GRAMMAR_SYMBOLS
    assert "number of rules" in str(refused(at_limit + ' "b"?'))
    chain = "\n".join(f'r{i} ::= r{i + 1} "x"' for i in range(5000)) + '\nr5000 ::= "y"\nroot ::= r0'
    assert check_grammar_text(chain).symbols == 5002  # r0..r5000 and root


def test_expansion_limit():
    text = lambda n: 'root ::= "' + "x" * n + '"{2000}'  # noqa: E731
    below = max(n for n in range(990, 1001) if grammar_figures(text(n)).elements <= c.MAX_GRAMMAR_ELEMENTS)
    assert check_grammar_text(text(below)).elements <= c.MAX_GRAMMAR_ELEMENTS
    assert "after repetitions are expanded" in str(refused(text(below + 1)))
    assert "after repetitions" in str(refused('root ::= "' + "x" * 100_000 + '"{2000}'))
    refused('root ::= "' + "x" * 1999 + '"' + "+" * 5000)  # each + copies the item again


def test_runs_of_comment_marks_do_not_backtrack():
    # fuzz/fuzz_grammar.py found '{####...{{{(' taking over 30 s in the repetition regex; linear now
    text = "root ::= {" + "#" * 20_000 + "{" * 20_000 + "("
    assert grammar_figures(text).depth == 0  # the ( is inside the comment
    assert grammar_figures(text.replace("#{", "#\n{")).depth == 1
    assert grammar_figures('root ::= ("a" { # c\n 5 , # d\n 3 })').inverted_repetition is not None


def test_nul_and_lone_surrogates_are_refused():
    assert "NUL" in str(refused('root ::= "a"\0 junk'))
    assert "surrogate" in str(refused('root ::= "\ud800"'))


@pytest.mark.parametrize("text", [r'root ::= "\x00"', r'root ::= "a\u0000b"', r'root ::= "\U00000000"',
                                  r'root ::= [\x00]', r'root ::= [\x00-\x00]', r'root ::= "x" | "\x00"'])
def test_a_literal_asking_for_nul_is_refused(text):
    """No token's text can produce NUL in llama.cpp's matcher: such a grammar could never be completed."""
    assert "NUL" in str(refused(text))


@pytest.mark.parametrize("text", [r'root ::= [^"\\\x00-\x1f]*', r'root ::= [\x00-\x1f]', r'root ::= "\\x00"',
                                  r'root ::= [a\x00]', 'root ::= "x" # "\\x00"'])
def test_nul_that_a_token_need_not_spell_is_admitted(text):
    """A negated class excludes NUL, a range or class offers other characters, an escaped backslash is no escape."""
    check_grammar_text(text)


def test_request_settings_run_the_checks():
    with pytest.raises(InvalidRequestError) as info:
        RequestSettings(grammar=nested(50_000))
    assert info.value.param == "grammar"
    deep = {}
    node = deep
    for _ in range(10_000):
        node["items"] = {}
        node = node["items"]
    with pytest.raises(InvalidRequestError) as info:
        RequestSettings(json_schema=deep)
    assert info.value.param == "json_schema"
    assert RequestSettings(grammar=nested(100)).grammar


# -- JSON schemas ---------------------------------------------------------------------------------
def chain_of(levels: int) -> dict:
    root: dict = {}
    node = root
    for _ in range(levels - 1):
        node["items"] = {}
        node = node["items"]
    return root


def test_schema_depth_limit():
    check_json_schema(chain_of(c.MAX_SCHEMA_DEPTH))
    assert f"over {c.MAX_SCHEMA_DEPTH}" in str(schema_refused(chain_of(c.MAX_SCHEMA_DEPTH + 1)))
    assert schema_refused(chain_of(10_000), param="response_format").param == "response_format"
    lists: list = []
    for _ in range(5000):
        lists = [lists]
    schema_refused({"enum": lists})


def test_schema_node_property_enum_limits():
    check_json_schema({"examples": list(range(c.MAX_SCHEMA_NODES - 2))})  # root, the list, its items
    assert "values in the schema" in str(schema_refused({"examples": list(range(c.MAX_SCHEMA_NODES - 1))}))
    props = lambda n: {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}  # noqa: E731
    check_json_schema(props(c.MAX_SCHEMA_PROPERTIES))
    assert "properties" in str(schema_refused(props(c.MAX_SCHEMA_PROPERTIES + 1)))
    check_json_schema({"enum": list(range(c.MAX_ENUM_VALUES))})
    assert "enum" in str(schema_refused({"enum": list(range(c.MAX_ENUM_VALUES + 1))}))


def test_pattern_limits():
    check_json_schema({"type": "string", "pattern": "a" * c.MAX_PATTERN_LENGTH})
    assert "characters long" in str(schema_refused({"type": "string", "pattern": "a" * (c.MAX_PATTERN_LENGTH + 1)}))
    depth = lambda n: {"type": "string", "pattern": "(" * n + "a" + ")" * n}  # noqa: E731
    check_json_schema(depth(c.MAX_PATTERN_DEPTH))
    schema_refused(depth(c.MAX_PATTERN_DEPTH + 1))
    check_json_schema({"type": "string", "pattern": f"^a{{{c.MAX_SCHEMA_REPETITION}}}$"})
    schema_refused({"type": "string", "pattern": f"^a{{2,{c.MAX_SCHEMA_REPETITION + 1}}}$"})
    for stray in ("^a]$", "^[]a]$", "x}", "a{2}}"):  # the converter never returns on these
        assert "closes nothing" in str(schema_refused({"type": "string", "pattern": stray}))
    check_json_schema({"type": "string", "pattern": r"^[\]a]\}$"})


@pytest.mark.parametrize("key", ["minLength", "maxLength", "minItems", "maxItems"])
def test_repetition_keywords(key):
    check_json_schema({key: c.MAX_SCHEMA_REPETITION})
    assert key in str(schema_refused({key: c.MAX_SCHEMA_REPETITION + 1}))


def test_ref_chains_and_cycles():
    def chain(n):
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
        defs[f"d{n}"] = {"type": "string"}
        return {"$ref": "#/$defs/d0", "$defs": defs}

    check_json_schema(chain(c.MAX_REF_CHAIN - 1))
    assert "references long" in str(schema_refused(chain(c.MAX_REF_CHAIN + 1)))
    assert "lead back" in str(schema_refused({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                                                          "b": {"$ref": "#/$defs/a"}}}))
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}
    check_json_schema(tree)  # recursion through a schema is a rule reference, not a chain
    # nesting through $ref targets counts: 40 definitions each nesting the next two levels down
    defs = {f"d{i}": {"properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(40)}
    defs["d40"] = {"type": "string"}
    assert "$ref targets" in str(schema_refused({"$ref": "#/$defs/d0", "$defs": defs}))


# -- properties -----------------------------------------------------------------------------------
GBNF_PIECES = st.sampled_from(['"a"', '"\\""', "[a-z]", "[^\\]]", "x", "(", ")", "|", "*", "+", "?", ".", "{2}",
                               "{0,3}", "{3,1}", "{2001}", "<[3]>", "# c (\n", "\n", " ", "::=", "\0", "root ::= "])


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(GBNF_PIECES, max_size=60), st.text(max_size=40))
def test_the_checker_admits_or_refuses_typed_and_never_raises_otherwise(pieces, noise):
    text = "".join(pieces) + noise
    figures = grammar_figures(text)  # never raises
    assert figures.depth <= text.count("(")
    try:
        check_grammar_text(text)
    except InvalidRequestError as exc:
        assert exc.param == "grammar" and str(exc).startswith("grammar: ")


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.integers(1, 3000), st.text(alphabet='()"[]#<>\\ab\n', max_size=30))
def test_depth_is_measured_outside_literals_and_comments(depth, hidden):
    assume('"' not in hidden and "]" not in hidden and "\n" not in hidden and "\\" not in hidden)
    text = "root ::= " + "(" * depth + f'"{hidden}" # {hidden}\n' + ")" * depth
    assert grammar_figures(text).depth == depth
    if depth > c.MAX_GROUP_DEPTH:
        refused(text)
    else:
        assert check_grammar_text(text).depth == depth


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=4),
                    max_leaves=60))
def test_schema_check_is_total_over_json_values(value):
    try:
        check_json_schema({"type": "object", "properties": {"x": value} if isinstance(value, dict) else {}, "v": value})
    except InvalidRequestError as exc:
        assert exc.param == "json_schema"
