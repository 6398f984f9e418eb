"""``POST /v1/embeddings`` (OpenAI's shape) and ``POST /tokenize`` / ``POST /detokenize`` (llama.cpp server's).

Each request is admitted through the served model's gate and runs on its
worker pool (``Service.run_work``), so the event loop never tokenizes or
decodes and the service's bounds (body size, Host/Origin, bearer token,
workers) hold as for the other routes. ``/v1/embeddings`` answers with the
library's :meth:`~aner_nb.llm.Lease.embed` (mean pooling unless the model
declares another, vectors normalized to unit length as OpenAI's are);
``openai_fields.EMBEDDING_FIELDS`` says what it does with each field, and
``docs/openai.md`` lists it. Token ids outside the model's vocabulary are a
400 naming the id before any native call.

No ``from __future__ import annotations`` here: FastAPI reads the endpoint
annotations.
"""

import base64
from typing import Any, Callable, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.responses import Response
from typing_extensions import Annotated

from ..llm import errors as llm_errors
from ..llm.embeddings import MAX_INPUTS
from .errors import ApiError
from .openai_fields import (
    EMBEDDING_FIELDS, EMBEDDINGS_ROUTE, IGNORED_FIELDS_HEADER, ignored_fields_header, refuse_unsupported,
)

__all__ = ["EmbeddingRequest", "EmbeddingList", "TokenizeRequest", "TokenizeAnswer", "DetokenizeRequest",
           "DetokenizeAnswer", "endpoints"]

_TextList = Annotated[list[str], Field(max_length=MAX_INPUTS)]
_IdLists = Annotated[list[list[StrictInt]], Field(max_length=MAX_INPUTS)]


class EmbeddingRequest(BaseModel):
    """OpenAI ``embeddings.create``; docs/openai.md lists what each field does here."""

    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"additionalProperties": False})

    input: Union[str, _TextList, list[StrictInt], _IdLists]
    model: Optional[str] = Field(None, description="The served model's id (see /v1/models).")
    encoding_format: Optional[Literal["float", "base64"]] = Field(None, description="float (default) or base64.")
    dimensions: Optional[StrictInt] = Field(None, description="Served only when it equals the model's width.")
    user: Optional[Any] = Field(None, description="Accepted and ignored.")


class EmbeddingItem(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: Union[list[float], str] = Field(description="The vector, or its float32 bytes in base64.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    """The answer of ``/v1/embeddings``: one item per input, in order."""

    object: Literal["list"]
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TokenizeRequest(_Closed):
    """llama.cpp server's ``/tokenize``: text to token ids."""

    content: str
    add_special: bool = Field(False, description="Add the model's BOS (as a prompt would have).")
    parse_special: bool = Field(True, description="Special-token text (<|im_start|>) becomes that token.")
    with_pieces: bool = Field(False, description="Answer {id, piece} objects instead of bare ids.")
    model: Optional[str] = Field(None, description="The served model's id (several served).")


class TokenPiece(BaseModel):
    id: int
    piece: Union[str, list[int]] = Field(description="The token's text, or its bytes when they are not UTF-8.")


class TokenizeAnswer(BaseModel):
    tokens: Union[list[int], list[TokenPiece]]


class DetokenizeRequest(_Closed):
    """llama.cpp server's ``/detokenize``: token ids to text (special tokens rendered)."""

    tokens: list[StrictInt]
    model: Optional[str] = Field(None, description="The served model's id (several served).")


class DetokenizeAnswer(BaseModel):
    content: str


def _encode(vector: np.ndarray, encoding: str) -> Union[list[float], str]:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _piece(raw: bytes) -> Union[str, list[int]]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _as_input_param(exc: BaseException) -> BaseException:
    """The library names the inputs ``texts``; this route calls them ``input``."""
    if isinstance(exc, llm_errors.LLMError) and exc.param and exc.param.startswith("texts"):
        exc.param = "input" + exc.param[len("texts"):]
    return exc


def endpoints(service: Any) -> dict[str, Callable[..., Any]]:
    """The three endpoints on ``service`` (a ``service.Service``), by route name."""

    async def embeddings(body: EmbeddingRequest, reply: Response) -> EmbeddingList:
        ignored = refuse_unsupported(dict(body.model_extra or {}), EMBEDDING_FIELDS, EMBEDDINGS_ROUTE,
                                     lenient=service.config.lenient_fields)
        if ignored:
            reply.headers[IGNORED_FIELDS_HEADER] = ignored_fields_header(ignored)
        mount = service.mount_for(body.model)
        model = mount.model
        if not model.closed:  # a closed model is answered 503 when the work is admitted
            if not model.supports("embed"):
                raise ApiError(400, f"model {mount.name!r} ({model.kind} lease) does not embed", param="model",
                               code="unsupported_model")
            width = model.facts.embedding_length
            if body.dimensions is not None and body.dimensions != width:
                raise ApiError(400, f"dimensions is not supported by this service: vectors are not shortened, and "
                               f"{mount.name!r} embeds with {width} dimensions (send {width} or omit it)",
                               param="dimensions", code="unsupported_parameter")
        encoding = body.encoding_format or "float"

        def work() -> Any:
            try:
                return model.embed(body.input, return_count=True)
            except llm_errors.LLMError as exc:
                raise _as_input_param(exc) from None

        vectors, count = await service.run_work(mount, work, fields=frozenset(EmbeddingRequest.model_fields),
                                                prompt_field="input")
        rows = np.atleast_2d(vectors)
        data = [EmbeddingItem(object="embedding", index=i, embedding=_encode(row, encoding))
                for i, row in enumerate(rows)]
        return EmbeddingList(object="list", data=data, model=mount.name,
                             usage=EmbeddingUsage(prompt_tokens=count, total_tokens=count))

    async def tokenize(body: TokenizeRequest) -> TokenizeAnswer:
        mount = service.mount_for(body.model)
        model = mount.model

        def work() -> Any:
            tokens = model.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
            if not body.with_pieces:
                return tokens
            return [TokenPiece(id=t, piece=_piece(raw)) for t, raw in zip(tokens, model.token_pieces(tokens))]

        tokens = await service.run_work(mount, work, fields=frozenset(TokenizeRequest.model_fields),
                                        prompt_field="content")
        return TokenizeAnswer(tokens=tokens)

    async def detokenize(body: DetokenizeRequest) -> DetokenizeAnswer:
        mount = service.mount_for(body.model)
        model = mount.model
        content = await service.run_work(mount, lambda: model.detokenize(body.tokens, special=True),
                                         fields=frozenset(DetokenizeRequest.model_fields), prompt_field="tokens")
        return DetokenizeAnswer(content=content)

    return {"embeddings": embeddings, "tokenize": tokenize, "detokenize": detokenize}
