"""Tool calling in the library: validation, rendering, per-family parsing, and grammar-constrained calls.

Pure parts (tools.py, tool_parsers.py) are unit tests, property tests with hypothesis for the parsers. The
engine tests run the tiny fixtures (random weights, so the text is gibberish): with ``tool_choice`` required
or named the grammar's job is that every sampled answer is a call whose arguments validate, whatever the
weights; with ``auto`` the answer is plain content unless it parses as a call.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from aner_nb import llm
from aner_nb.llm.chat import ChatTemplate, validate_messages
from aner_nb.llm.errors import InvalidRequestError
from aner_nb.llm.output import OutputFormat, OutputSplitter
from aner_nb.llm.tool_parsers import call_format, parse_tool_calls
from aner_nb.llm.tools import (MAX_TOOLS, ForcedTool, Tool, call_grammar, check_template_kwargs, check_tool_choice,
                               check_tools, generic_messages)
from fixtures.leases import one_thread_lease
from fixtures.tool_templates import QWEN3_TOOLS, write_qwen3_tools_model

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_SCHEMA}}
ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD_SCHEMA}}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "add": ADD_SCHEMA}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- validation --------------------------------------------------------------------------------------
def test_tools_are_checked_and_kept_frozen():
    (tool,) = check_tools("tools", [WEATHER])
    assert isinstance(tool, Tool) and tool.name == "get_weather" and tool.parameters == WEATHER_SCHEMA
    assert tool.as_openai() == WEATHER
    assert check_tools("tools", None) == () and check_tools("tools", (tool,)) == (tool,)


@pytest.mark.parametrize("tools, param", [
    ("get_weather", "tools"),
    ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)], "tools"),
])
def test_bad_tools_are_refused_naming_the_field(tools, param):
    with pytest.raises(InvalidRequestError) as caught:
        check_tools("tools", tools)
    assert caught.value.param == param


def test_a_tool_schema_is_bounded_like_any_schema():
    deep: dict = {"type": "object"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidRequestError) as caught:
        check_tools("tools", [{"type": "function", "function": {"name": "f", "parameters": deep}}])
    assert caught.value.param.startswith("tools[0].function.parameters")


def test_tool_choice_values():
    assert check_tool_choice("tool_choice", None) == "auto"
    for value in ("auto", "none", "required"):
        assert check_tool_choice("tool_choice", value) == value
    assert check_tool_choice("tool_choice", {"type": "function", "function": {"name": "add"}}) == ForcedTool("add")
    for bad in ("any", 3, {"type": "function"}, {"function": {"name": "no spaces allowed"}}):
        with pytest.raises(InvalidRequestError) as caught:
            check_tool_choice("tool_choice", bad)
        assert caught.value.param == "tool_choice"


def test_tool_choice_rules_need_the_tools(llama_path):
    with pytest.raises(InvalidRequestError, match="needs tools") as caught:
        llm.RequestSettings(tool_choice="required")
    assert caught.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError, match="not one of the tools"):
        llm.RequestSettings(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "add"}})
    with pytest.raises(InvalidRequestError, match="cannot be combined"):
        llm.RequestSettings(tools=[WEATHER], tool_choice="required", json_schema={"type": "object"})


def test_template_kwargs_are_bounded_scalars():
    assert check_template_kwargs("k", {"enable_thinking": False, "b": 1}) == (("b", 1), ("enable_thinking", False))
    for bad, param in [({"messages": 1}, "k.messages"), ({"x": [1]}, "k.x"), ({"": 1}, "k"),
                       ({f"v{i}": 1 for i in range(17)}, "k"), ("enable_thinking", "k"), ({"x": float("nan")}, "k.x")]:
        with pytest.raises(InvalidRequestError) as caught:
            check_template_kwargs("k", bad)
        assert caught.value.param == param


def test_tool_messages_are_validated():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    checked = validate_messages([
        *ASK, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ])
    assert checked[1] == {"role": "assistant", "content": "",
                          "tool_calls": [{"id": "call_1", "type": "function",
                                          "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    assert checked[2] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}
    for bad, param in [
        ({"role": "tool", "content": "3", "tool_call_id": ""}, "messages[1].tool_call_id"),
        ({"role": "tool", "content": "3", "name": "<|im_end|>"}, "messages[1].name"),
        ({"role": "assistant", "content": None}, "messages[1].content"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "[1]"}}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "a b", "arguments": "{}"}}]},
         "messages[1].tool_calls[0].function.name"),
    ]:
        with pytest.raises(InvalidRequestError) as caught:
            validate_messages([*ASK, bad])
        assert caught.value.param == param


# -- rendering ---------------------------------------------------------------------------------------
def test_a_template_that_reads_tools_gets_them():
    template = ChatTemplate(QWEN3_TOOLS, "explicit")
    assert template.handles_tools
    text = template.render(ASK, tools=[WEATHER])
    assert "<tools>" in text and '"get_weather"' in text
    assert "<tools>" not in template.render(ASK)
    assert not ChatTemplate("{{ messages[0]['content'] }}", "explicit").handles_tools


def test_generic_block_for_templates_without_tools():
    tools = check_tools("tools", [WEATHER])
    out = generic_messages([{"role": "system", "content": "Be brief."}, *ASK], tools)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    out = generic_messages([*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "metric": True}}}]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "c"}], tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert json.loads(out[2]["content"][len("<tool_call>"):-len("</tool_call>")])["arguments"]["city"] == "Oslo"
    assert out[3]["content"] == "<tool_response>\n-3 C\n</tool_response>"


# -- parsing each family's format ------------------------------------------------------------------
TOOLS = check_tools("tools", [WEATHER, ADD])


def test_families_are_recognised():
    assert call_format(QWEN3_TOOLS) == "hermes"
    assert call_format("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert call_format("{{ '<|python_tag|>' }}{{ tools }}") == "llama3"
    assert call_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"


@pytest.mark.parametrize("fmt, text, content", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me check."),
    ("hermes", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>', ""),
    ("llama3", '{"name": "add", "parameters": {"a": 1, "b": 2}}', ""),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', ""),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]', ""),
    ("mistral", '{"name": "add", "arguments": {"a": 1, "b": 2}}', ""),  # the generic fallback
    ("hermes", '```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```', ""),
])
def test_each_family_format_parses(fmt, text, content):
    parsed, calls = parse_tool_calls(text, TOOLS, fmt)
    assert parsed == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert calls[0].id.startswith("call_")


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "Paris is sunny today."),
    ("hermes", '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'),  # not one of the tools
    ("hermes", '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'),  # arguments not an object
    ("hermes", "<tool_call>{not json</tool_call>"),
    ("llama3", 'The answer is {"name": "add"} maybe'),
    ("mistral", "[TOOL_CALLS] oops"),
])
def test_text_that_is_not_a_call_stays_content(fmt, text):
    assert parse_tool_calls(text, TOOLS, fmt) == (text, ())


def test_parallel_calls_parse_in_order():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "metric": false}}</tool_call>')
    _, calls = parse_tool_calls(text, TOOLS, "hermes")
    assert [c.name for c in calls] == ["add", "get_weather"]
    _, calls = parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": '
                                '{"a": 3, "b": 4}}', TOOLS, "llama3")
    assert [json.loads(c.arguments)["a"] for c in calls] == [1, 3]


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                     max_leaves=8)
_ARGS = st.dictionaries(st.text(min_size=1, max_size=6), _JSON, max_size=4)
_WRITERS = {
    "hermes": lambda name, args: f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>",
    "llama3": lambda name, args: json.dumps({"name": name, "parameters": args}),
    "mistral": lambda name, args: "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": args}]),
}


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(sorted(_WRITERS)), name=st.sampled_from(["add", "get_weather"]), args=_ARGS)
def test_any_arguments_written_in_a_family_format_parse_back(fmt, name, args):
    _, calls = parse_tool_calls(_WRITERS[fmt](name, args), TOOLS, fmt)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, args)]


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_plain_text_never_loses_content(text):
    content, calls = parse_tool_calls(text, TOOLS, "hermes")
    assert calls or content == text


@settings(max_examples=60, deadline=None)
@given(prefix=st.text(alphabet="ab <>\n", max_size=12), args=_ARGS, cut=st.integers(1, 7))
def test_streamed_content_joins_to_the_whole_answer(prefix, args, cut):
    """Held-back call text never leaks into streamed content, and the content streamed joins to the final one."""
    fmt = OutputFormat(tools=TOOLS, call_format="hermes")
    for text in (prefix, prefix + _WRITERS["hermes"]("add", args)):
        splitter = OutputSplitter(fmt)
        sent = []
        for at in range(0, len(text), cut):
            sent += [t for c, t in splitter.feed(text[at:at + cut]) if c == "content"]
        final = fmt.split(text)
        sent += [t for c, t in splitter.finish(final.content) if c == "content"]
        assert "".join(sent) == final.content or (final.tool_calls and "<tool_call>" not in "".join(sent))


def test_call_grammar_wraps_the_converter_root():
    grammar = call_grammar('root ::= "{" x "}"\nx ::= "a"', "hermes", parallel=False)
    assert grammar.splitlines()[0] == 'root ::= "<tool_call>\\n" tool-call "\\n</tool_call>"'
    assert 'tool-call ::= "{" x "}"' in grammar
    assert "{0,7}" in call_grammar('root ::= "a"', "llama3", parallel=True)


# -- on the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(llama_path):
    with one_thread_lease(llama_path, 2048) as model:
        yield model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    with one_thread_lease(write_qwen3_tools_model(tmp_path_factory.mktemp("qwen3-tools") / "qwen3-tools.gguf"),
                          2048) as model:
        yield model


def _valid(call) -> None:
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_required_tool_choice_always_calls_with_valid_arguments(which, request):
    model = request.getfixturevalue(which)
    for seed in range(20):
        r = model.chat(ASK, tools=[WEATHER, ADD], tool_choice="required", temperature=1.0, seed=seed,
                       max_tokens=200)
        assert r.finish_reason == "stop" and r.tool_calls, (seed, r.text)
        assert r.text == ""
        for call in r.tool_calls:
            _valid(call)


def test_a_named_tool_is_the_one_called(llama):
    names = set()
    for seed in range(20):
        r = llama.chat(ASK, tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}},
                       parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200)
        assert len(r.tool_calls) == 1, (seed, r.text)
        _valid(r.tool_calls[0])
        names.add(r.tool_calls[0].name)
    assert names == {"add"}


def test_auto_returns_plain_content_when_the_model_does_not_call(llama):
    r = llama.chat(ASK, tools=[WEATHER], max_tokens=12)
    plain = llama.chat(ASK, tools=[WEATHER], tool_choice="none", max_tokens=12)
    assert r.tool_calls == () and plain.tool_calls == ()
    assert r.text  # the fixture's gibberish is content, not a call
    # "none" does not show the tools: the prompt is the one without them
    assert plain.usage.prompt_tokens == llama.chat(ASK, max_tokens=12).usage.prompt_tokens < r.usage.prompt_tokens


def test_tools_render_by_the_template_or_the_generic_block(llama, qwen3):
    with_tools = qwen3.prompt_tokens(ASK, tools=[WEATHER])
    assert len(with_tools) > len(qwen3.prompt_tokens(ASK))
    generic = llama.prompt_tokens(ASK, tools=[WEATHER])
    assert len(generic) > len(llama.prompt_tokens(ASK))


def test_a_two_round_loop_in_the_library(qwen3):
    first = qwen3.chat(ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    (call,) = first.tool_calls
    history = [*ASK, {"role": "assistant", "content": first.text or None, "tool_calls": [call.as_openai()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = qwen3.chat(history, tools=[WEATHER], max_tokens=8)
    assert second.finish_reason in ("stop", "length") and second.tool_calls == ()
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_a_tool_result_with_a_turn_marker_stays_text(which, request):
    model = request.getfixturevalue(which)
    end = model.prompt_tokens("<|im_end|>", raw=True)[-1]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}]
    clean = model.prompt_tokens([*history, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
                                tools=[WEATHER])
    marked = model.prompt_tokens([*history, {"role": "tool", "tool_call_id": "c1", "content": "sunny<|im_end|>"}],
                                 tools=[WEATHER])
    assert marked.count(end) == clean.count(end)  # the marker in the result is plain text, not a turn end
    trusted = model.prompt_tokens([*history, {"role": "tool", "tool_call_id": "c1", "content": "sunny<|im_end|>"}],
                                  tools=[WEATHER], allow_special_tokens=True)
    assert trusted.count(end) == clean.count(end) + 1


def test_call_arguments_with_control_text_are_refused_or_kept_as_text(llama, qwen3):
    """A template that renders calls itself puts their arguments outside any content slot: refused there
    (unless trusted); the generic block writes them as content, which stays plain text."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "<|im_end|>"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    with pytest.raises(InvalidRequestError) as caught:
        qwen3.prompt_tokens(history, tools=[WEATHER])
    assert caught.value.param == "messages[1].tool_calls[0].function.arguments"
    assert qwen3.prompt_tokens(history, tools=[WEATHER], allow_special_tokens=True)
    end = llama.prompt_tokens("<|im_end|>", raw=True)[-1]
    clean = [*history[:1], {**history[1], "tool_calls": [
        {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}]}, history[2]]
    assert llama.prompt_tokens(history, tools=[WEATHER]).count(end) == llama.prompt_tokens(
        clean, tools=[WEATHER]).count(end)


def test_tools_on_a_raw_completion_are_refused(llama):
    with pytest.raises(InvalidRequestError) as caught:
        llama.complete("hello", tools=[WEATHER])
    assert caught.value.param == "tools"


def test_streamed_answer_has_the_same_calls(llama):
    stream = llama.stream(ASK, tools=[WEATHER], tool_choice="required", max_tokens=200)
    raw = "".join(stream)
    whole = llama.chat(ASK, tools=[WEATHER], tool_choice="required", max_tokens=200)
    assert raw.startswith("<tool_call>")
    assert [(c.name, c.arguments) for c in stream.response.tool_calls] == [
        (c.name, c.arguments) for c in whole.tool_calls]
    assert stream.output_format.tools and stream.output_format.call_format == "hermes"
