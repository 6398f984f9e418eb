"""Response bodies of the HTTP routes (pydantic models, published in ``/openapi.json``).

Each route returns one of these as its ``response_model`` (built here from
the library's :class:`~aner_nb.llm.Response` by the ``of`` constructors), so
the published schema is what is sent. A streamed answer is a sequence of
chunk events: :class:`ChatCompletionChunk` on ``/v1/chat/completions``,
:class:`TextCompletionChunk` on ``/v1/completions``; both chunk classes
offer the same four constructors (``opening``, ``text``, ``finish``,
``usage_of``) so one SSE writer serves both routes. The request bodies are
in ``request_bodies``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, get_args

from pydantic import BaseModel, Field, create_model, model_serializer

from ..llm.response import Response, Usage
from .logprob_bodies import ChatLogprobs, CompletionLogprobs, chat_logprobs, completion_logprobs
from ..llm.timings import timing_fields

__all__ = [
    "ErrorBody", "TimingsBody", "ChatAnswer", "Envelope", "ChatCompletion", "ChatCompletionChunk", "ChunkDelta",
    "TextCompletion", "TextCompletionChunk", "ModelList", "ModelCard", "ModelHealth", "Health",
]

FinishReason = Literal["stop", "length", "tool_calls"]  # a cancelled generation is answered with an error, never a body


# -- responses: what the routes return (their ``response_model``) -------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorBody(BaseModel):
    """Every error answer: what was wrong, its kind, and the offending field when there is one."""

    error: ErrorDetail


def _timings_model() -> type[BaseModel]:
    """The library's :class:`~aner_nb.llm.Timings` as a response model, one field per timings field."""
    fields: dict[str, Any] = {
        f.name: (int, Field(description=f"{f.metadata['label']} ({f.metadata['unit']}); -1 = not measured"))
        for f in timing_fields()
    }
    return create_model("Timings", __doc__="The library's timings of the request (durations in ns).", **fields)


TimingsBody = _timings_model()


class UsageBody(BaseModel):
    prompt_tokens: int
    cached_input_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage) -> "UsageBody":
        return cls(prompt_tokens=usage.prompt_tokens, cached_input_tokens=usage.cached_input_tokens,
                   completion_tokens=usage.completion_tokens, total_tokens=usage.total_tokens)


class ChatAnswer(BaseModel):
    """The seed route's answer: text, why it ended, usage and the library's timings (ns, -1 = not measured)."""

    model: str
    text: str
    finish_reason: FinishReason
    output_hash: str
    tokens_per_second: float
    usage: UsageBody
    timings: TimingsBody  # type: ignore[valid-type]

    @classmethod
    def of(cls, model: str, response: Response) -> "ChatAnswer":
        return cls(model=model, text=response.text, finish_reason=response.finish_reason,
                   output_hash=response.output_hash, tokens_per_second=response.tokens_per_second(),
                   usage=UsageBody.of(response.usage), timings=response.timings.as_dict())


class PromptDetails(BaseModel):
    cached_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptDetails

    @classmethod
    def of(cls, usage: Usage) -> "CompletionUsage":
        return cls(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                   total_tokens=usage.total_tokens,
                   prompt_tokens_details=PromptDetails(cached_tokens=usage.cached_input_tokens))


@dataclass(frozen=True)
class Envelope:
    """What the completion object and every chunk of one OpenAI answer share.

    ``seed`` is the seed the request ran with (the client's, or the fresh
    one drawn when it gave none): sending it back reproduces the answer.
    """

    id: str
    created: int
    model: str
    system_fingerprint: str
    seed: int

    @classmethod
    def new(cls, prefix: str, model: str, fingerprint: str, seed: int) -> "Envelope":
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, f"fp_{fingerprint[:12]}", seed)


class _OpenAIObject(BaseModel):
    """What every OpenAI answer object and chunk carries (an :class:`Envelope`), and its ``object`` name."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    seed: int = Field(description="The sampling seed this answer used; send it back to reproduce the answer.")

    @classmethod
    def _object(cls) -> str:
        """The ``object`` value of this class (its ``object`` field is a one-value Literal)."""
        return get_args(cls.model_fields["object"].annotation)[0]

    @classmethod
    def _build(cls, envelope: Envelope, choices: list[Any], response: Optional[Response] = None) -> Any:
        extra = {} if response is None else {"usage": CompletionUsage.of(response.usage),
                                             "timings": response.timings.as_dict()}
        return cls(**dataclasses.asdict(envelope), object=cls._object(), choices=choices, **extra)


class _Answer(_OpenAIObject):
    """A whole (non-streamed) answer: one choice, the usage and the library's timings (ns)."""

    usage: CompletionUsage
    timings: TimingsBody  # type: ignore[valid-type]

    @classmethod
    def of(cls, envelope: Envelope, response: Response) -> Any:
        return cls._build(envelope, [cls._choice(response)], response)

    @classmethod
    def of_choices(cls, envelope: Envelope, responses: "list[Response]", *, echo: Optional[str] = None) -> Any:
        """The answer of ``n`` choices (``index`` i, logprobs when asked); usage counts the prompt once and
        every choice's completion tokens; the timings are the first choice's. ``echo``: the prompt text
        that goes before each choice's text (``/v1/completions``)."""
        choices = []
        for index, response in enumerate(responses):
            choice = cls._choice(response)
            choice.index = index
            cls._score(choice, response, echo)
            if response.closed_early:
                choice.closed_early = True
            choices.append(choice)
        first = responses[0]
        usage = dataclasses.replace(first.usage, completion_tokens=sum(r.usage.completion_tokens for r in responses))
        return cls._build(envelope, choices, dataclasses.replace(first, usage=usage))

    @classmethod
    def _choice(cls, response: Response) -> BaseModel:
        raise NotImplementedError

    @classmethod
    def _score(cls, choice: Any, response: Response, echo: Optional[str]) -> None:
        """Add the response's logprobs (and the echoed prompt) to its choice."""


class _Chunk(_OpenAIObject):
    """A streamed event; both chunk classes offer ``opening``, ``text``, ``finish`` and ``usage_of``."""

    usage: Optional[CompletionUsage] = None
    timings: Optional[TimingsBody] = None  # type: ignore[valid-type]

    @classmethod
    def usage_of(cls, envelope: Envelope, response: Response) -> Any:
        """The last chunk when ``stream_options.include_usage`` is true: no choices, the usage and timings."""
        return cls._build(envelope, [], response)

    def scored(self, index: int, entries: Any = None, offset: int = 0) -> Any:
        """This chunk as choice ``index``'s, carrying ``entries`` (its tokens' logprobs; None: not asked)."""
        for choice in self.choices:
            choice.index = index
            if entries is not None:
                choice.logprobs = self._logprobs(entries, offset)
        return self

    @classmethod
    def _logprobs(cls, entries: Any, offset: int) -> Any:
        return chat_logprobs(entries)


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The call's arguments: a JSON object, as a string.")


class ToolCallBody(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class CompletionMessage(BaseModel):
    """The answer; ``reasoning_content`` (a reasoning model's thinking) and ``tool_calls`` only when there are."""

    role: Literal["assistant"]
    content: Optional[str]
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCallBody]] = None

    @model_serializer(mode="wrap")
    def _present_only(self, handler: Any) -> Any:
        out = handler(self)
        for name in ("reasoning_content", "tool_calls"):
            if out.get(name) is None:
                out.pop(name, None)
        return out


def tool_calls_of(response: Response) -> Optional[list[ToolCallBody]]:
    if not response.tool_calls:
        return None
    return [ToolCallBody(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in response.tool_calls]


def chat_finish_reason(response: Response) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the answer called tools."""
    return "tool_calls" if response.tool_calls and response.finish_reason == "stop" else response.finish_reason


class _ClosedEarly(BaseModel):
    """A choice's ``closed_early`` (not OpenAI's): shown only when a schema-constrained answer neared its
    output limit and was ended by the shortest valid JSON (``finish_reason`` is then ``length``)."""

    closed_early: Optional[bool] = None

    @model_serializer(mode="wrap")
    def _present_only(self, handler: Any) -> Any:
        out = handler(self)
        if not out.get("closed_early"):
            out.pop("closed_early", None)
        return out


class Choice(_ClosedEarly):
    index: int
    message: CompletionMessage
    finish_reason: FinishReason
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletion(_Answer):
    """OpenAI ``chat.completion``, plus ``seed`` and ``timings`` (the library's, in ns)."""

    object: Literal["chat.completion"]
    choices: list[Choice]

    @classmethod
    def _choice(cls, response: Response) -> Choice:
        calls = tool_calls_of(response)
        content = None if calls and not response.text else response.text
        message = CompletionMessage(role="assistant", content=content, reasoning_content=response.reasoning,
                                    tool_calls=calls)
        return Choice(index=0, message=message, finish_reason=chat_finish_reason(response))

    @classmethod
    def _score(cls, choice: Any, response: Response, echo: Optional[str]) -> None:
        if response.logprobs is not None:
            choice.logprobs = chat_logprobs(response.logprobs)


class ChunkDelta(BaseModel):
    """The text a chunk adds; the first chunk also names the role, the finishing one is empty."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # OpenAI's ToolCallDelta: index, id, type, function


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: Optional[FinishReason] = None
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletionChunk(_Chunk):
    """One ``data:`` event of a streamed chat answer (OpenAI ``chat.completion.chunk``).

    The stream is: a chunk with the role, one chunk per text piece, a chunk
    with ``finish_reason``, then (only when ``stream_options.include_usage``
    is true) a chunk with no choices carrying ``usage`` and ``timings``, then
    ``data: [DONE]``. A failure mid-stream is one :class:`ErrorBody` event
    instead of the rest. Only the fields shown in each chunk are sent.
    """

    object: Literal["chat.completion.chunk"]
    choices: list[ChunkChoice]

    @classmethod
    def _delta(cls, envelope: Envelope, delta: ChunkDelta, finish_reason: Optional[str] = None) -> "ChatCompletionChunk":
        return cls._build(envelope, [ChunkChoice(index=0, delta=delta, finish_reason=finish_reason, logprobs=None)])

    @classmethod
    def opening(cls, envelope: Envelope) -> "ChatCompletionChunk":
        return cls._delta(envelope, ChunkDelta(role="assistant", content=""))

    @classmethod
    def text(cls, envelope: Envelope, piece: str) -> "ChatCompletionChunk":
        return cls._delta(envelope, ChunkDelta(content=piece))

    @classmethod
    def finish(cls, envelope: Envelope, finish_reason: str) -> "ChatCompletionChunk":
        return cls._delta(envelope, ChunkDelta(), finish_reason)

    @classmethod
    def reasoning(cls, envelope: Envelope, piece: str) -> "ChatCompletionChunk":
        """A piece of a reasoning model's thinking (``delta.reasoning_content``, as llama.cpp's server and vLLM)."""
        return cls._delta(envelope, ChunkDelta(reasoning_content=piece))

    @classmethod
    def tool_call_deltas(cls, envelope: Envelope, response: Response, piece_chars: int = 16) -> "list[ChatCompletionChunk]":
        """The answer's tool calls in OpenAI's streamed shape: per call a chunk with its index, id, type and
        name (arguments empty), then its arguments in pieces of ``piece_chars`` characters."""
        out = []
        for index, call in enumerate(response.tool_calls):
            head = {"index": index, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}
            out.append(cls._delta(envelope, ChunkDelta(tool_calls=[head])))
            for at in range(0, len(call.arguments), piece_chars):
                part = {"index": index, "function": {"arguments": call.arguments[at:at + piece_chars]}}
                out.append(cls._delta(envelope, ChunkDelta(tool_calls=[part])))
        return out


class TextChoice(_ClosedEarly):
    index: int
    text: str
    finish_reason: Optional[FinishReason] = None
    logprobs: Optional[CompletionLogprobs] = None


class TextCompletion(_Answer):
    """OpenAI ``text_completion`` (``/v1/completions``), plus ``seed`` and ``timings`` (the library's, in ns)."""

    object: Literal["text_completion"]
    choices: list[TextChoice]

    @classmethod
    def _choice(cls, response: Response) -> TextChoice:
        return TextChoice(index=0, text=response.text, finish_reason=response.finish_reason, logprobs=None)

    @classmethod
    def _score(cls, choice: Any, response: Response, echo: Optional[str]) -> None:
        prompt = response.prompt_logprobs or ()
        if response.logprobs is not None:
            first = ""
            if echo is not None and prompt:  # the first prompt token has no entry: its text is what the rest leaves
                rest = "".join(e.text for e in prompt[1:] if e is not None)
                first = echo[: len(echo) - len(rest)] if echo.endswith(rest) else ""
            choice.logprobs = completion_logprobs(response.logprobs, prompt=prompt if echo is not None else (),
                                                  prompt_tokens=[first])
        if echo is not None:
            choice.text = echo + choice.text


class TextCompletionChunk(_Chunk):
    """One ``data:`` event of a streamed ``/v1/completions`` answer (OpenAI's legacy stream).

    One chunk per text piece, a chunk with empty text and ``finish_reason``,
    then (only when ``stream_options.include_usage`` is true) a chunk with
    no choices carrying ``usage`` and ``timings``, then ``data: [DONE]``.
    """

    object: Literal["text_completion"]
    choices: list[TextChoice]

    @classmethod
    def opening(cls, envelope: Envelope) -> None:
        return None  # the legacy stream names no role

    @classmethod
    def _logprobs(cls, entries: Any, offset: int) -> Any:
        return completion_logprobs(entries, offset=offset)

    @classmethod
    def text(cls, envelope: Envelope, piece: str, finish_reason: Optional[str] = None) -> "TextCompletionChunk":
        return cls._build(envelope, [TextChoice(index=0, text=piece, finish_reason=finish_reason, logprobs=None)])

    @classmethod
    def finish(cls, envelope: Envelope, finish_reason: str) -> "TextCompletionChunk":
        return cls.text(envelope, "", finish_reason)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ModelHealth(BaseModel):
    id: str
    path: str
    closed: bool
    in_flight: int
    capacity: int


class Health(BaseModel):
    """``ok`` while every served model accepts requests; otherwise 503 and ``unavailable``."""

    status: Literal["ok", "unavailable"]
    models: list[ModelHealth]
