"""Request and response bodies of the HTTP routes (pydantic models, published in ``/openapi.json``).

Request models are built per service because their bounds are the
service's limits (``output_limit(max_tokens=...)``, ``limits(max_rows=...)``),
so the published schema states exactly what is accepted. Fields are strict:
``"5"`` is not an integer and ``true`` is not a number, and the 422 answer
names the field. The seed route (``/chat``) rejects unknown fields, so a
misspelt option fails instead of being ignored; the OpenAI route ignores
fields it does not know (clients send many), but rejects known ones whose
values it cannot honour (``n`` other than 1, ``logprobs``).

Response models are the routes' ``response_model``: each route returns one
of them (built here from the library's :class:`~aner_nb.llm.Response` by the
``of`` constructors), so the published schema is what is sent. A streamed
answer is a sequence of :class:`ChatCompletionChunk` events.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model

from ..llm.profiles import MAX_SEED, MAX_STOP_STRINGS
from ..llm.response import Response, Usage
from ..llm.timings import timing_fields

__all__ = [
    "RequestModels", "request_models", "ErrorBody", "TimingsBody", "ChatAnswer", "Envelope", "ChatCompletion",
    "ChatCompletionChunk", "ChunkDelta", "ModelList", "ModelCard", "ModelHealth", "Health",
]

FinishReason = Literal["stop", "length"]  # a cancelled generation is answered with an error, never a body
Stop = Optional[Union[str, list[str]]]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(BaseModel):
    """One text part of an OpenAI message whose content is a list of parts."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """An OpenAI chat message; ``developer`` is served as ``system``."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def plain(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = True


class RequestModels:
    """The two request bodies of one service, bounded by its limits."""

    def __init__(self, chat: type[BaseModel], completion: type[BaseModel]) -> None:
        self.chat = chat
        self.completion = completion


def request_models(*, max_tokens: int, max_rows: int) -> RequestModels:
    """Request models whose ``max_tokens`` is capped at ``max_tokens`` and ``messages`` at ``max_rows``."""
    cap, rows = max_tokens, max_rows  # class bodies below assign these names, so they read the copies
    stop_field: Any = Field(
        None,
        description=f"A stop string or up to {MAX_STOP_STRINGS} of them; generation ends before the first match.",
    )

    class ChatRequest(_Strict):
        """The seed route: one user prompt, formatted with the model's chat template.

        Every field but ``prompt`` is passed to the library under its own name (``service.seed_call``).
        """

        prompt: str = Field(description="The user message.")
        max_tokens: int = Field(cap, ge=0, le=cap, description="Most tokens to generate (default: the cap).")
        temperature: float = Field(0.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0 is greedy.")
        seed: int = Field(0, ge=0, le=MAX_SEED)
        stop: Stop = stop_field

    class ChatCompletionRequest(BaseModel):
        """OpenAI ``chat.completions.create`` arguments this service honours."""

        model_config = ConfigDict(strict=True, extra="ignore")
        model: Optional[str] = Field(None, description="The served model's id (see /v1/models).")
        messages: list[Message] = Field(min_length=1, max_length=rows)
        max_tokens: Optional[int] = Field(None, ge=0, le=cap, description="Default: the service's cap.")
        max_completion_tokens: Optional[int] = Field(None, ge=0, le=cap, description="Alias of max_tokens.")
        temperature: Optional[float] = Field(None, ge=0.0, le=2.0, allow_inf_nan=False,
                                             description="Default 0 (greedy), unlike OpenAI's 1.")
        seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
        stop: Stop = stop_field
        stream: Optional[bool] = False
        stream_options: Optional[StreamOptions] = None
        n: Optional[int] = Field(None, ge=1, le=1, description="Only one choice is generated.")
        logprobs: Optional[Literal[False]] = Field(None, description="Log probabilities are not returned.")

    return RequestModels(ChatRequest, ChatCompletionRequest)


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
    """What the completion object and every chunk of one OpenAI answer share."""

    id: str
    created: int
    model: str
    system_fingerprint: str

    @classmethod
    def new(cls, model: str, fingerprint: str) -> "Envelope":
        return cls(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, f"fp_{fingerprint[:12]}")


class CompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class Choice(BaseModel):
    index: int
    message: CompletionMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    """OpenAI ``chat.completion``, plus ``timings`` (the library's, in ns)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[Choice]
    usage: CompletionUsage
    timings: TimingsBody  # type: ignore[valid-type]

    @classmethod
    def of(cls, envelope: Envelope, response: Response) -> "ChatCompletion":
        choice = Choice(index=0, message=CompletionMessage(role="assistant", content=response.text),
                        finish_reason=response.finish_reason, logprobs=None)
        return cls(**dataclasses.asdict(envelope), object="chat.completion", choices=[choice],
                   usage=CompletionUsage.of(response.usage), timings=response.timings.as_dict())


class ChunkDelta(BaseModel):
    """The text a chunk adds; the first chunk also names the role, the finishing one is empty."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: Optional[FinishReason] = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a streamed answer (OpenAI ``chat.completion.chunk``).

    The stream is: a chunk with the role, one chunk per text piece, a chunk
    with ``finish_reason``, then (unless ``stream_options.include_usage`` is
    false) a chunk with no choices carrying ``usage`` and ``timings``, then
    ``data: [DONE]``. A failure mid-stream is one :class:`ErrorBody` event
    instead of the rest. Only the fields shown in each chunk are sent.
    """

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: Optional[CompletionUsage] = None
    timings: Optional[TimingsBody] = None  # type: ignore[valid-type]

    @classmethod
    def piece(cls, envelope: Envelope, delta: ChunkDelta, finish_reason: Optional[str] = None) -> "ChatCompletionChunk":
        choice = ChunkChoice(index=0, delta=delta, finish_reason=finish_reason, logprobs=None)
        return cls(**dataclasses.asdict(envelope), object="chat.completion.chunk", choices=[choice])

    @classmethod
    def usage_of(cls, envelope: Envelope, response: Response) -> "ChatCompletionChunk":
        return cls(**dataclasses.asdict(envelope), object="chat.completion.chunk", choices=[],
                   usage=CompletionUsage.of(response.usage), timings=response.timings.as_dict())


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
