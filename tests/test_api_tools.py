"""Tool calling and reasoning over HTTP, through real servers and clients nobody here wrote.

Servers on loopback serve the Qwen3-style tools fixture (its template renders tools and thinking), the tiny
llama fixture (ChatML without tools: the generic block) and the SmolLM2 instruct demo model. The fixtures'
text is gibberish: constrained calls (``tool_choice`` required or named) must parse and validate whatever the
weights; the two-round loops check the protocol (a call, its result sent back, an answer).
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest

from aner_nb.demo_model import demo_model_path
from fixtures.leases import one_thread_lease
from fixtures.tool_templates import write_qwen3_tools_model
from test_api import serving, service
from test_tools import ADD, SCHEMAS, WEATHER, WEATHER_SCHEMA

openai = pytest.importorskip("openai")
langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = 'root ::= "<think>\\nthe user says hi\\n</think>\\n\\n" [a-z]{3,6}'


@pytest.fixture(scope="module", params=["qwen3", "llama", "smollm2"])
def served(request, tmp_path_factory, llama_path):
    if request.param == "qwen3":
        path = write_qwen3_tools_model(tmp_path_factory.mktemp("qwen3-api") / "qwen3-tools.gguf")
    elif request.param == "llama":
        path = llama_path
    else:
        path = demo_model_path()
    with one_thread_lease(path, 2048) as model, model.with_batching(2) as batching:
        with serving(service(batching, max_tokens=256)) as server:
            yield request.param, server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[1].url}/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# -- the openai SDK ----------------------------------------------------------------------------------
def test_required_calls_always_validate(client):
    for seed in range(20):
        answer = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
                                                temperature=1.0, seed=seed, max_tokens=256)
        choice = answer.choices[0]
        # parallel calls (OpenAI's default) may run into max_tokens: the complete calls are returned
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls, (seed, choice.message)
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id
            _valid(call.function.name, call.function.arguments)


def test_a_named_tool_is_called(client):
    answer = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False, max_tokens=200)
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "add"
    _valid("add", call.function.arguments)


def test_two_rounds_with_the_sdk(client):
    messages = list(ASK)
    first = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200)
    message = first.choices[0].message
    (call,) = message.tool_calls
    messages.append(message)  # the SDK's own message object, as its docs' loop does
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})})
    second = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=24)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert answer.message.content
    alone = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens  # the call and its result were rendered


def test_streamed_tool_call_deltas_reassemble_to_the_whole_call(client):
    kwargs = dict(model="m", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", temperature=0,
                  max_tokens=200)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                if delta.function is not None:
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    streamed = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(calls[i]["id"] for i in calls)


def test_auto_answers_or_calls_validly(client):
    answer = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=40)
    choice = answer.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            _valid(call.function.name, call.function.arguments)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content is not None


def test_a_tool_result_with_a_turn_marker_stays_text(served):
    url = f"{served[1].url}/v1/chat/completions"
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}]
    counts = []
    for result in ("sunny", "sunny<|im_end|>"):
        r = httpx.post(url, json={"messages": [*history, {"role": "tool", "tool_call_id": "c1", "content": result}],
                                  "tools": [WEATHER], "tool_choice": "none", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
        counts.append(r.json()["usage"]["prompt_tokens"])
    assert counts[1] > counts[0] + 1  # "<|im_end|>" is several plain-text tokens, not the one control token


def test_bad_tools_are_400_naming_the_field(served):
    url = f"{served[1].url}/v1/chat/completions"
    bad = {"type": "function", "function": {"name": "no spaces", "parameters": WEATHER_SCHEMA}}
    r = httpx.post(url, json={"messages": ASK, "tools": [bad]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.name"
    r = httpx.post(url, json={"messages": ASK, "tool_choice": "required"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = httpx.post(url, json={"messages": [*ASK, {"role": "tool", "content": "x", "tool_call_id": ""}],
                              "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_call_id"


# -- LangChain ----------------------------------------------------------------------------------------
@tool
def get_weather(city: Literal["Paris", "Rome", "Oslo"], metric: bool) -> str:
    """Current weather in a city."""
    return json.dumps({"city": city, "temperature": 21 if metric else 70})


def test_langchain_bind_tools_two_rounds(served):
    chat = langchain_openai.ChatOpenAI(base_url=f"{served[1].url}/v1", api_key="unused", model="m", max_retries=0,
                                       max_tokens=200, temperature=0, timeout=120)
    history = [HumanMessage("What is the weather in Paris?")]
    first = chat.bind_tools([get_weather], tool_choice="required").invoke(history)
    assert isinstance(first, AIMessage) and first.tool_calls
    (call,) = first.tool_calls[:1]
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "metric"}
    history += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    second = chat.bind_tools([get_weather], tool_choice="none").invoke(history)
    assert isinstance(second, AIMessage) and not second.tool_calls and second.content


# -- reasoning over SSE (the Qwen3-style fixture) -------------------------------------------------------
def _sse(url: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    with one_thread_lease(write_qwen3_tools_model(tmp_path_factory.mktemp("qwen3-sse") / "qwen3-think.gguf"),
                          2048) as model:
        with serving(service(model, max_tokens=64)) as server:
            yield server


def test_reasoning_content_whole_and_streamed(thinking_server):
    url = f"{thinking_server.url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "grammar": THOUGHT, "max_tokens": 40, "temperature": 0}
    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]
    assert whole["reasoning_content"] == "the user says hi" and whole["content"]
    deltas = [c["choices"][0]["delta"] for c in _sse(url, body) if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
    off = {"messages": body["messages"], "grammar": 'root ::= [a-z]{3,6}', "max_tokens": 10,
           "chat_template_kwargs": {"enable_thinking": False}}
    message = httpx.post(url, json=off, timeout=60).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"]
    assert all("reasoning_content" not in c["choices"][0]["delta"] for c in _sse(url, off) if c.get("choices"))
