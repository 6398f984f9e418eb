"""Request and response bodies of the HTTP routes (pydantic models, published in ``/openapi.json``).

Request models are built per service because their bounds are the
service's limits (``output_limit(max_tokens=...)``, ``limits(max_rows=...)``),
so the published schema states exactly what is accepted. Fields are strict:
``"5"`` is not an integer and ``true`` is not a number, and the 422 answer
names the field. The seed route (``/chat``) rejects unknown fields, so a
misspelt option fails instead of being ignored; the OpenAI route ignores
fields it does not know (clients send many), but rejects known ones whose
values it cannot honour (``n`` other than 1, ``logprobs``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..llm.profiles import MAX_SEED, MAX_STOP_STRINGS

__all__ = ["RequestModels", "request_models", "ErrorBody", "ChatAnswer", "ChatCompletion", "ModelList", "ModelCard", "Health"]

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
        """The seed route: one user prompt, formatted with the model's chat template."""

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


# -- responses (documentation and schema checks; routes build plain dicts) ---------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorBody(BaseModel):
    """Every error answer: what was wrong, its kind, and the offending field when there is one."""

    error: ErrorDetail


class UsageBody(BaseModel):
    prompt_tokens: int
    cached_input_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatAnswer(BaseModel):
    """The seed route's answer: text, why it ended, usage and the library's timings (ns, -1 = not measured)."""

    model: str
    text: str
    finish_reason: Literal["stop", "length"]
    output_hash: str
    tokens_per_second: float
    usage: UsageBody
    timings: dict[str, int]


class CompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class Choice(BaseModel):
    index: int
    message: CompletionMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class PromptDetails(BaseModel):
    cached_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptDetails


class ChatCompletion(BaseModel):
    """OpenAI ``chat.completion``, plus ``timings`` (the library's, in ns)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[Choice]
    usage: CompletionUsage
    timings: dict[str, int]


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
