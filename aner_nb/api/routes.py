"""The service's routes, declared once.

:data:`ROUTES` lists the fixed routes and :func:`seed_route` the one route
per served model; everything that needs the route list derives it from
them: the FastAPI registration (``service.build_app`` gives each route its
endpoint by ``name``), the paths a seed route may not take
(:data:`RESERVED`), the routes reachable without the bearer token
(:data:`OPEN_PATHS`, enforced by the ``Guard`` and published in
``/openapi.json``), the route labels of the request metrics
(:func:`metric_labels`), the routes a running ``Server`` and ``aner-nb
serve --help`` show.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

from starlette.responses import PlainTextResponse

from .embeddings import DetokenizeAnswer, EmbeddingList, TokenizeAnswer
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .schemas import ChatAnswer, ChatCompletion, ErrorBody, Health, ModelCard, ModelList, TextCompletion

if TYPE_CHECKING:
    from ..llm import Lease

__all__ = ["MountSpec", "Route", "ROUTES", "RESERVED", "OPEN_PATHS", "seed_route", "service_routes", "metric_labels"]


@dataclass(frozen=True)
class MountSpec:
    """One served lease: the seed route's path and the id clients use for it."""

    path: str
    model: "Lease"
    name: str


@dataclass(frozen=True)
class Route:
    """One route: how it is called, what it answers, and whether it needs the bearer token."""

    method: str
    path: str
    name: str  # the endpoint's key in service.build_app, and the OpenAPI operation's name
    summary: str
    response_model: Any = None  # what a 200 answer is; None for plain text
    responses: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)  # other answers, for the schema
    response_class: Optional[type] = None
    open: bool = False  # reachable without the bearer token (gateway health checks, the schema)
    builtin: bool = False  # served by FastAPI itself, not by an endpoint of ours

    @property
    def listing(self) -> str:
        return f"{self.method} {self.path}"


def _errors(status: int, description: str) -> dict[int, dict[str, Any]]:
    return {status: {"model": ErrorBody, "description": description}}


_REQUEST_ERRORS: dict[int, dict[str, Any]] = {
    **_errors(400, "invalid value, context_length_exceeded, malformed JSON; on the OpenAI routes also a field "
                   "this service cannot honour (unsupported_parameter) or does not know (unknown_parameter)"),
    **_errors(401, "missing or invalid bearer token (when the service has one)"),
    **_errors(413, "request body above the service's limit"),
    **_errors(422, "wrong type, missing field or out-of-range value; error.param names the field"),
    503: {
        "model": ErrorBody,
        "description": "busy (workers and queue full; retry after Retry-After seconds) or the model is closed",
        "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds (busy only)"}},
    },
    **_errors(504, "the request ran past the timeout; its generation was cancelled"),
}


def _streamed(answer: str, chunk: str) -> dict[int, dict[str, Any]]:
    """A 200 that is ``answer`` JSON, or with stream=true ``chunk`` events (published by service._openapi)."""
    return {200: {"description": f"a {answer}, or with stream=true server-sent {chunk} events (and ': keep-alive' "
                                 "comments while no text comes) ending with 'data: [DONE]'",
                  "content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk}"}}}},
            **_errors(404, "unknown model (several served)"), **_REQUEST_ERRORS}


ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/chat/completions", "chat_completions", "OpenAI chat.completions.create",
          ChatCompletion, _streamed("chat.completion", "ChatCompletionChunk")),
    Route("POST", "/v1/completions", "completions", "OpenAI completions.create: raw text, no chat template",
          TextCompletion, _streamed("text_completion", "TextCompletionChunk")),
    Route("POST", "/v1/embeddings", "embeddings", "OpenAI embeddings.create: one vector per input",
          EmbeddingList, {**_errors(404, "unknown model (several served)"), **_REQUEST_ERRORS}),
    Route("POST", "/tokenize", "tokenize", "llama.cpp server's /tokenize: text to token ids", TokenizeAnswer,
          {**_errors(404, "unknown model (several served)"), **_REQUEST_ERRORS}),
    Route("POST", "/detokenize", "detokenize", "llama.cpp server's /detokenize: token ids to text",
          DetokenizeAnswer, {**_errors(404, "unknown model (several served)"), **_REQUEST_ERRORS}),
    Route("GET", "/v1/models", "list_models", "The served models", ModelList),
    Route("GET", "/v1/models/{model_id}", "get_model", "One served model", ModelCard, _errors(404, "not served")),
    Route("GET", "/health", "health", "Liveness for gateways (no token needed)", Health,
          {503: {"model": Health, "description": "a served model is closed"}}, open=True),
    Route("GET", "/metrics", "metrics", "Prometheus text format", None,
          {200: {"content": {METRICS_CONTENT_TYPE: {}}}}, response_class=PlainTextResponse),
    Route("GET", "/openapi.json", "openapi", "This schema", open=True, builtin=True),
)

# Top-level paths of the fixed routes, and FastAPI's documentation pages (off here, kept free).
RESERVED: tuple[str, ...] = (*dict.fromkeys("/" + r.path.split("/")[1] for r in ROUTES), "/docs", "/redoc")
OPEN_PATHS = frozenset(r.path for r in ROUTES if r.open)


def seed_route(path: str, model: str) -> Route:
    """The seed route of one served model: one prompt in, text, usage and timings out."""
    return Route("POST", path, f"chat:{model}", f"Answer one prompt with {model}", ChatAnswer, _REQUEST_ERRORS)


def service_routes(seeds: Iterable[tuple[str, str]]) -> tuple[Route, ...]:
    """Every route of a service whose seed routes are ``(path, model id)`` pairs: theirs, then the fixed ones."""
    return (*(seed_route(path, model) for path, model in seeds), *ROUTES)


def metric_labels(routes: Iterable[Route]) -> frozenset[str]:
    """The paths counted under their own ``route`` label; any other path (a model id, a 404) counts as ``other``."""
    return frozenset(r.path for r in routes if "{" not in r.path)
