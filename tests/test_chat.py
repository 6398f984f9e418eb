"""Tests of chat templates: built-in formats, resolution, sandboxing, validation."""

from __future__ import annotations

import dataclasses
import pickle
from datetime import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aner_nb.llm.artifact import SUPPORTED_ARCHITECTURES
from aner_nb.llm.chat import (
    BUILTIN_TEMPLATES,
    FAMILY_TEMPLATES,
    ChatTemplate,
    format_prompt,
    resolve_template,
    validate_messages,
)
from aner_nb.llm.errors import ChatTemplateError, InvalidRequestError, LLMError
from fixtures.models import MISTRAL_INSTRUCT, PHI3_INSTRUCT

USER = [{"role": "user", "content": "Hello"}]


# --- Published formats, written out by hand ----------------------------------

def chatml(messages, add_generation_prompt=True):
    """ChatML: <|im_start|>{role}\\n{content}<|im_end|>\\n per message."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def gemma_turn(role, content):
    """Gemma: <start_of_turn>{user|model}\\n{content}<end_of_turn>\\n."""
    return f"<start_of_turn>{role}\n{content}<end_of_turn>\n"


# Google's official Gemma 3 chat template (tokenizer_config.json of the -it
# models), used as a parity reference for the built-in.
OFFICIAL_GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Meta's official Llama 3 Instruct chat template.
OFFICIAL_LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


# --- Built-ins ----------------------------------------------------------------

def test_builtin_names():
    assert {"chatml", "gemma", "llama3", "mistral", "phi3"} <= set(BUILTIN_TEMPLATES)
    with pytest.raises(TypeError):
        BUILTIN_TEMPLATES["x"] = "{{ 1 }}"  # read-only mapping


def test_every_admitted_architecture_names_a_builtin():
    assert set(FAMILY_TEMPLATES) == set(SUPPORTED_ARCHITECTURES)
    assert set(FAMILY_TEMPLATES.values()) <= set(BUILTIN_TEMPLATES)
    with pytest.raises(TypeError):
        FAMILY_TEMPLATES["x"] = "chatml"  # read-only mapping


def test_chatml_exact():
    t = resolve_template("chatml", None)
    assert t.origin == "builtin:chatml"
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  spaced  "},
    ]
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n  spaced  <|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert t.render(msgs) == expected
    assert t.render(msgs, add_generation_prompt=False) == expected[: -len("<|im_start|>assistant\n")]
    assert format_prompt(t, "Hello") == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("bos", ["<bos>", ""])
def test_gemma_single_user_exact(bos):
    t = resolve_template("gemma", None, bos_token=bos)
    expected = "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
    assert t.render(USER) == expected
    assert format_prompt(t, "Hello") == expected


def test_gemma_conversation_with_system_exact():
    t = resolve_template("gemma", None, bos_token="<bos>")
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ]
    expected = (
        "<bos>"
        + gemma_turn("user", "Be brief.\n\nName a colour.")
        + gemma_turn("model", "Blue.")
        + gemma_turn("user", "Another?")
        + "<start_of_turn>model\n"
    )
    assert t.render(msgs) == expected
    assert t.render(msgs, add_generation_prompt=False) == expected[: -len("<start_of_turn>model\n")]
    assert format_prompt(t, "Hi", system="Sys") == (
        "<bos><start_of_turn>user\nSys\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


def test_gemma_trims_turn_content_like_official_template():
    t = resolve_template("gemma", None, bos_token="<bos>")
    assert t.render([{"role": "user", "content": "\n  Hello \n"}]) == (
        "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.parametrize("name", ["gemma", "mistral"])  # formats without a system turn
@pytest.mark.parametrize(
    "msgs, fragment",
    [
        ([{"role": "assistant", "content": "a"}], "alternate"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternate"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}], "system"),
        ([{"role": "system", "content": "s"}], "user message after the system"),
    ],
)
def test_gemma_and_mistral_reject_invalid_conversations(name, msgs, fragment):
    t = resolve_template(name, None)
    with pytest.raises(ChatTemplateError, match=fragment):
        t.render(msgs)


def test_llama3_exact():
    t = resolve_template("llama3", None, bos_token="<|begin_of_text|>")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert t.render(msgs) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nQ<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


TWO_TURNS = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
]


def test_mistral_two_turns_exact():
    t = resolve_template("mistral", None, bos_token="<s>", eos_token="</s>")
    expected = "<s>[INST] Name a colour. [/INST]Blue.</s>[INST] Another? [/INST]"
    assert t.render(TWO_TURNS) == expected
    assert t.render(TWO_TURNS, add_generation_prompt=False) == expected  # the prompt ends with [/INST] anyway
    # a leading system message opens the first user turn, as in Mistral's v1 format
    assert t.render([{"role": "system", "content": "Be brief."}, *TWO_TURNS]) == (
        "<s>[INST] Be brief.\n\nName a colour. [/INST]Blue.</s>[INST] Another? [/INST]"
    )
    assert format_prompt(resolve_template("mistral", None), "Hi") == "<s>[INST] Hi [/INST]"  # BOS fallback


def test_phi3_two_turns_exact():
    t = resolve_template("phi3", None, bos_token="<s>", eos_token="<|endoftext|>")
    msgs = [{"role": "system", "content": "Be brief."}, *TWO_TURNS]
    expected = (
        "<|system|>\nBe brief.<|end|>\n"
        "<|user|>\nName a colour.<|end|>\n"
        "<|assistant|>\nBlue.<|end|>\n"
        "<|user|>\nAnother?<|end|>\n"
    )
    assert t.render(msgs) == expected + "<|assistant|>\n"
    assert t.render(msgs, add_generation_prompt=False) == expected + "<|endoftext|>"
    assert format_prompt(t, "Hi") == "<|user|>\nHi<|end|>\n<|assistant|>\n"


# Compiled once: hypothesis examples below reuse them.
CHATML = resolve_template("chatml", None)
PARITY = {
    "gemma": (
        resolve_template("gemma", None, bos_token="<bos>"),
        resolve_template(OFFICIAL_GEMMA3, None, bos_token="<bos>"),
    ),
    "llama3": (
        resolve_template("llama3", None, bos_token="<|begin_of_text|>"),
        resolve_template(OFFICIAL_LLAMA3, None, bos_token="<|begin_of_text|>"),
    ),
    # the published templates the mistral and phi3 fixtures embed (tests/fixtures/models.py)
    "mistral": (
        resolve_template("mistral", None, bos_token="<s>", eos_token="</s>"),
        resolve_template(MISTRAL_INSTRUCT, None, bos_token="<s>", eos_token="</s>"),
    ),
    "phi3": (
        resolve_template("phi3", None, bos_token="<s>", eos_token="<|endoftext|>"),
        resolve_template(PHI3_INSTRUCT, None, bos_token="<s>", eos_token="<|endoftext|>"),
    ),
}
_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


@st.composite
def gemma_conversations(draw):
    n = draw(st.integers(1, 6))
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": draw(_text)} for i in range(n)]
    if draw(st.booleans()):
        turns.insert(0, {"role": "system", "content": draw(_text)})
    return turns


@settings(max_examples=200, deadline=None)
@given(gemma_conversations(), st.booleans())
def test_gemma_builtin_matches_official_template(msgs, gen):
    ours, official = PARITY["gemma"]
    assert ours.render(msgs, add_generation_prompt=gen) == official.render(msgs, add_generation_prompt=gen)


@pytest.mark.parametrize("name", ["llama3", "phi3", "mistral"])
@settings(max_examples=100, deadline=None)
@given(gemma_conversations(), st.booleans())
def test_builtin_matches_official_template(name, msgs, gen):
    if name == "mistral":
        msgs = [m for m in msgs if m["role"] != "system"]  # the official template refuses one
    ours, official = PARITY[name]
    assert ours.render(msgs, add_generation_prompt=gen) == official.render(msgs, add_generation_prompt=gen)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=60)}
        ),
        min_size=1,
        max_size=6,
    ),
    st.booleans(),
)
def test_chatml_contains_each_content_verbatim_in_order(msgs, gen):
    out = CHATML.render(msgs, add_generation_prompt=gen)
    pos = 0
    for m in msgs:
        header = f"<|im_start|>{m['role']}\n"
        assert out.startswith(header, pos)
        pos += len(header)
        assert out.startswith(m["content"], pos)
        pos += len(m["content"])
        assert out.startswith("<|im_end|>\n", pos)
        pos += len("<|im_end|>\n")
    assert out[pos:] == ("<|im_start|>assistant\n" if gen else "")


# --- Resolution ---------------------------------------------------------------

EMBEDDED = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[A]{% endif %}"


def test_embedded_template_used_when_present():
    t = resolve_template(None, EMBEDDED)
    assert t.origin == "embedded"
    assert t.render(USER) == "[user]Hello[A]"


def test_explicit_overrides_embedded():
    assert resolve_template("chatml", EMBEDDED).origin == "builtin:chatml"
    assert resolve_template(" Gemma ", EMBEDDED).origin == "builtin:gemma"
    t = resolve_template("{{ messages[0].content | upper }}", EMBEDDED)
    assert t.origin == "explicit"
    assert t.render(USER) == "HELLO"


def test_missing_template_error_names_model_and_builtins():
    with pytest.raises(ChatTemplateError) as info:
        resolve_template(None, None, model_name="tiny-llama")
    msg = str(info.value)
    assert msg.startswith("tiny-llama has no embedded chat template; pass chat_template=")
    assert "chatml" in msg and "gemma" in msg and "Jinja" in msg
    with pytest.raises(ChatTemplateError, match="no embedded chat template"):
        resolve_template(None, "   ")


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_missing_template_error_names_the_architectures_builtin(architecture):
    with pytest.raises(ChatTemplateError) as info:
        resolve_template(None, None, model_name="m", architecture=architecture)
    assert f"({architecture} models use {FAMILY_TEMPLATES[architecture]!r})" in str(info.value)
    with pytest.raises(ChatTemplateError) as info:
        resolve_template(None, None, model_name="m", architecture="mamba")
    assert "models use" not in str(info.value)


@pytest.mark.parametrize("name", ["chatmlx", "", "vicuna"])
def test_unknown_name_lists_builtins(name):
    with pytest.raises(ChatTemplateError) as info:
        resolve_template(name, EMBEDDED)
    msg = str(info.value)
    assert "unknown chat template" in msg
    for builtin in BUILTIN_TEMPLATES:
        assert builtin in msg


def test_non_string_template_rejected():
    with pytest.raises(ChatTemplateError):
        resolve_template(42, None)
    with pytest.raises(ChatTemplateError):
        resolve_template(None, b"{{ x }}")


@pytest.mark.parametrize("explicit, embedded", [("{% for m in messages %}{{ m }}", None), (None, "{{ 1 + }}")])
def test_syntax_error_at_resolve_time(explicit, embedded):
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        resolve_template(explicit, embedded)


def test_unknown_filter_and_random_rejected_at_resolve_time():
    with pytest.raises(ChatTemplateError):
        resolve_template("{{ messages | no_such_filter }}", None)
    with pytest.raises(ChatTemplateError):
        resolve_template("{{ [1, 2] | random }}", None)


def test_template_value_semantics():
    t = resolve_template("chatml", None, bos_token="<s>", eos_token="</s>")
    assert t == resolve_template("chatml", None, bos_token="<s>", eos_token="</s>")
    assert "source=<" in repr(t) and "im_start" not in repr(t)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.source = "{{ 1 }}"  # type: ignore[misc]
    clone = pickle.loads(pickle.dumps(t))
    assert clone == t and clone.render(USER) == t.render(USER)
    assert isinstance(hash(t), int)


# --- Sandbox and render errors -----------------------------------------------

FORBIDS = "sandbox forbids"


@pytest.mark.parametrize(
    "source, reason",
    [
        ("{{ ''.__class__.__mro__ }}", FORBIDS),
        ("{{ ''.__class__ }}", FORBIDS),
        ("{{ messages.append(1) }}", FORBIDS),
        ("{{ messages[0].update({'role': 'x'}) }}", FORBIDS),
        ("{{ messages[0].__class__ }}", FORBIDS),
        ("{{ cycler.__init__.__globals__ }}", FORBIDS),
        ("{{ raise_exception.__globals__ }}", FORBIDS),
        ("{{ 'a' * 100000000 }}", FORBIDS),
        ("{{ 10 ** 100000000 }}", FORBIDS),
        ("{% for i in range(10000000) %}{% endfor %}", "Range too big"),
        ("{% include 'secrets.txt' %}", "no loader"),
        ("{% import 'macros.j2' as m %}", "no loader"),
    ],
)
def test_sandbox_blocks_escapes_and_abuse(source, reason):
    t = resolve_template(source, None)
    with pytest.raises(ChatTemplateError, match=reason):
        t.render(USER)


def test_messages_not_mutated_by_template():
    msgs = [{"role": "user", "content": "Hello", "extra": 1}]
    before = [dict(m) for m in msgs]
    t = resolve_template("{{ messages[0].pop('content', '') }}", None)
    with pytest.raises(ChatTemplateError):
        t.render(msgs)
    assert msgs == before


def test_raise_exception_becomes_chat_template_error():
    t = resolve_template("{{ raise_exception('only user turns, please') }}", None)
    with pytest.raises(ChatTemplateError, match="only user turns, please") as info:
        t.render(USER)
    assert isinstance(info.value, LLMError)


@pytest.mark.parametrize("source", ["{{ nothing.attribute }}", "{{ nothing() }}", "{{ 1 / 0 }}", "{{ lipsum() }}"])
def test_runtime_errors_become_chat_template_error(source):
    with pytest.raises(ChatTemplateError, match="failed to render"):
        resolve_template(source, None).render(USER)


def test_hf_globals_and_tojson():
    src = (
        "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ strftime_now('%Y-%m-%d') }}|"
        "{{ messages | tojson }}|{{ tools is none }}"
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}"
    )
    t = ChatTemplate(src, "explicit", bos_token="<s>", eos_token="</s>", now=datetime(2024, 7, 26))
    msgs = [{"role": "user", "content": "<b>é & 'x'</b>"}]
    out = t.render(msgs, add_generation_prompt=False)
    assert out == (
        "<s>|</s>|False|2024-07-26|"
        '[{"role": "user", "content": "<b>é & \'x\'</b>"}]|True'
        "<b>é & 'x'</b>"
    )


def test_rendering_is_deterministic():
    t = resolve_template("{{ strftime_now('%H:%M:%S.%f') }}{{ messages | tojson }}", None)
    assert t.render(USER) == t.render(USER)


def test_add_generation_prompt_must_be_bool():
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):
        resolve_template("chatml", None).render(USER, add_generation_prompt=1)


# --- Message validation -------------------------------------------------------

def test_validate_messages_normalizes():
    msgs = [{"role": "system", "content": "s", "name": "x"}, {"role": "user", "content": "u"}]
    out = validate_messages(msgs)
    assert out == ({"role": "system", "content": "s"}, {"role": "user", "content": "u"})
    assert isinstance(out, tuple)
    assert msgs[0]["name"] == "x"  # input untouched
    assert validate_messages(tuple(msgs), max_messages=2) == out


@pytest.mark.parametrize(
    "messages, kwargs, match",
    [
        ("hello", {}, "messages must be a list"),
        ({"role": "user", "content": "x"}, {}, "messages must be a list"),
        ([], {}, "must not be empty"),
        ([{"role": "user", "content": "x"}] * 3, {"max_messages": 2}, "3 entries; at most 2"),
        ([{"role": "user", "content": "x"}, "hi"], {}, r"messages\[1\] must be a mapping"),
        ([{"content": "x"}], {}, r"messages\[0\]\.role is missing"),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "function", "content": "c"}],
            {},
            r"^messages\[2\]\.role must be one of system, user, assistant, tool, got 'function'$",
        ),
        ([{"role": None, "content": "x"}], {}, r"messages\[0\]\.role must be one of .* got None"),
        ([{"role": "user"}], {}, r"messages\[0\]\.content is missing"),
        ([{"role": "user", "content": None}], {}, r"messages\[0\]\.content must be a str, got NoneType"),
        ([{"role": "user", "content": ["x"]}], {}, r"messages\[0\]\.content must be a str, got list"),
    ],
)
def test_validate_messages_errors_name_index_and_field(messages, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        validate_messages(messages, **kwargs)


def test_render_and_format_prompt_validate_input():
    t = resolve_template("chatml", None)
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.role"):
        t.render([{"role": "function", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="prompt must be a str"):
        format_prompt(t, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="system must be a str"):
        format_prompt(t, "x", system=3)  # type: ignore[arg-type]
    assert format_prompt(t, "Q", system="S") == chatml(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    )
