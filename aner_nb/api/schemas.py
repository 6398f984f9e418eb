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

from pydantic import BaseModel, Field, create_model

from ..llm.response import Response, Usage
from ..llm.timings import timing_fields

__all__ = [
    "ErrorBody", "TimingsBody", "ChatAnswer", "Envelope", "ChatCompletion", "ChatCompletionChunk", "ChunkDelta",
    "TextCompletion", "TextCompletionChunk", "ModelList", "ModelCard", "ModelHealth", "Health",
]

FinishReason = Literal["stop", "length"]  # a cancelled generation is answered with an error, never a body


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
    def _choice(cls, response: Response) -> BaseModel:
        raise NotImplementedError


class _Chunk(_OpenAIObject):
    """A streamed event; both chunk classes offer ``opening``, ``text``, ``finish`` and ``usage_of``."""

    usage: Optional[CompletionUsage] = None
    timings: Optional[TimingsBody] = None  # type: ignore[valid-type]

    @classmethod
    def usage_of(cls, envelope: Envelope, response: Response) -> Any:
        """The last chunk when ``stream_options.include_usage`` is true: no choices, the usage and timings."""
        return cls._build(envelope, [], response)


class CompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class Choice(BaseModel):
    index: int
    message: CompletionMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(_Answer):
    """OpenAI ``chat.completion``, plus ``seed`` and ``timings`` (the library's, in ns)."""

    object: Literal["chat.completion"]
    choices: list[Choice]

    @classmethod
    def _choice(cls, response: Response) -> Choice:
        message = CompletionMessage(role="assistant", content=response.text)
        return Choice(index=0, message=message, finish_reason=response.finish_reason)


class ChunkDelta(BaseModel):
    """The text a chunk adds; the first chunk also names the role, the finishing one is empty."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: Optional[FinishReason] = None
    logprobs: None = None


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


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[FinishReason] = None
    logprobs: None = None


class TextCompletion(_Answer):
    """OpenAI ``text_completion`` (``/v1/completions``), plus ``seed`` and ``timings`` (the library's, in ns)."""

    object: Literal["text_completion"]
    choices: list[TextChoice]

    @classmethod
    def _choice(cls, response: Response) -> TextChoice:
        return TextChoice(index=0, text=response.text, finish_reason=response.finish_reason, logprobs=None)


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
