"""The FastAPI application: routes, limits and error answers over served leases.

Routes (see ``/openapi.json``):

- ``POST <path>`` (default ``/chat``): the seed route, ``{"prompt", "max_tokens",
  "temperature", "seed", "stop"}`` -> text, usage and the library's timings.
- ``POST /v1/chat/completions``: OpenAI-compatible, streaming as SSE chunks
  ending with a usage chunk and ``[DONE]``.
- ``GET /v1/models``, ``GET /v1/models/{id}``: the served models.
- ``GET /health``: 200 while every served model accepts requests, else 503.
- ``GET /metrics``: Prometheus text.

Each request is a stateless call on the served lease: with a batching lease
concurrent requests become sequences of its one scheduler; an ordinary
lease runs one request at a time and answers the next one busy. Blocking
library calls run on the model's bounded worker pool (see ``runtime``).

No ``from __future__ import annotations`` here: FastAPI reads the endpoint
annotations, which name request models built per service.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .. import __version__
from ..llm import errors as llm_errors
from . import MountSpec
from . import metrics as metrics_mod
from .errors import ApiError, busy, from_library
from .guard import Guard
from .runtime import ClientGone, Generation, Mount, RequestTimeout
from .schemas import ChatAnswer, ChatCompletion, ErrorBody, Health, ModelCard, ModelList, request_models

__all__ = ["ServiceConfig", "build_app"]

log = logging.getLogger("aner_nb.api")


@dataclass(frozen=True)
class ServiceConfig:
    """Everything the application needs; built and validated by :class:`aner_nb.api.App`."""

    title: str
    mounts: tuple[MountSpec, ...]
    max_rows: int = 64
    timeout_ms: int = 120_000
    max_body_bytes: int = 1 << 20
    max_concurrent: Optional[int] = None
    retry_after_s: int = 1
    max_tokens: int = 256
    bearer_token: Optional[str] = field(default=None, repr=False)


def _errors(status: int, *codes: str) -> dict[int, dict[str, Any]]:
    return {status: {"model": ErrorBody, "description": ", ".join(codes)}}


_COMMON_ERRORS: dict[int, dict[str, Any]] = {
    **_errors(400, "invalid value, context_length_exceeded, malformed JSON"),
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


def build_app(config: ServiceConfig) -> FastAPI:
    """A new ASGI application serving ``config``'s leases (each build has its own pools and counters)."""
    mounts = [Mount(path=s.path, model=s.model, name=s.name, max_concurrent=config.max_concurrent) for s in config.mounts]
    # Closures below keep only the scalar settings: FastAPI caches endpoint functions process-wide, so
    # nothing they capture may hold a lease past shutdown (Mount.shutdown lets go of its lease).
    config = dataclasses.replace(config, mounts=())
    by_name = {m.name: m for m in mounts}
    bodies = request_models(max_tokens=config.max_tokens, max_rows=config.max_rows)
    ChatRequest, CompletionRequest = bodies.chat, bodies.completion
    service_metrics = metrics_mod.MountMetrics()
    timeout_s = config.timeout_ms / 1000.0

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        for mount in mounts:  # cancel what still runs, then join the worker threads
            await asyncio.to_thread(mount.shutdown)

    app = FastAPI(
        title=config.title,
        version=__version__,
        description="Local GGUF models over HTTP (aner_nb): the seed /chat route and OpenAI-compatible routes.",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.mounts = mounts

    # -- error answers ---------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = list(exc.errors())
        if any(p.get("type") == "json_invalid" for p in problems):
            return ApiError(400, "the request body is not valid JSON", code="invalid_json").response()
        first = problems[0] if problems else {}
        params = [_loc(p.get("loc", ())) for p in problems]
        message = "; ".join(f"{param or 'body'}: {p.get('msg', 'invalid')}" for param, p in zip(params, problems))
        return ApiError(422, message, param=params[0] if params else None, code=first.get("type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return ApiError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while answering a request")
        return ApiError(500, "internal error; see the server log", type="server_error", code="internal").response()

    # -- running one request -----------------------------------------------------------------
    async def admit(mount: Mount, prompt: Any, *, max_tokens: int, temperature: float, seed: int, stop: Any,
                    prompt_field: str) -> Generation:
        if mount.model.closed:
            raise ApiError(503, f"model {mount.name!r} is closed; it accepts no requests",
                           type="unavailable_error", code="model_closed")
        if not mount.gate.try_enter():
            mount.metrics.count("busy_rejections")
            raise busy(
                f"model {mount.name!r} is busy: {mount.capacity} requests are running or queued; "
                f"retry after {config.retry_after_s} s", config.retry_after_s,
            )
        mount.metrics.count("requests")
        generation = Generation(mount, timeout_s)
        model = mount.model
        try:
            await generation.open(
                lambda: model.stream(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed, stop=stop)
            )
        except RequestTimeout:
            raise _timeout() from None
        except llm_errors.LLMError as exc:
            raise _library(mount, exc, prompt_field) from None
        return generation

    def _timeout() -> ApiError:
        return ApiError(504, f"the request ran past this service's timeout of {config.timeout_ms} ms; "
                        "its generation was cancelled", type="timeout_error", code="timeout")

    def _library(mount: Mount, exc: BaseException, prompt_field: str) -> ApiError:
        error = from_library(exc, prompt_field=prompt_field, retry_after_s=config.retry_after_s)
        if isinstance(exc, llm_errors.BusyError):
            mount.metrics.count("busy_rejections")
        if error.status >= 500 and error.status != 503:
            log.error("request failed: %s", exc, exc_info=exc)
        return error

    def finished(mount: Mount, generation: Generation) -> Any:
        response = generation.response
        if response.finish_reason == "cancelled":  # only shutdown cancels without a timeout or disconnect
            raise ApiError(503, "the server is shutting down; the generation was cancelled",
                           type="unavailable_error", code="shutting_down")
        mount.metrics.count("prompt_tokens", response.usage.prompt_tokens)
        mount.metrics.count("completion_tokens", response.usage.completion_tokens)
        return response

    async def complete(mount: Mount, generation: Generation, request: Request, prompt_field: str) -> Any:
        """Run a non-streaming request to its end; None when the client went away meanwhile."""
        try:
            await generation.collect(_disconnected(request))
        except RequestTimeout:
            raise _timeout() from None
        except ClientGone:
            return None
        except llm_errors.LLMError as exc:
            raise _library(mount, exc, prompt_field) from None
        return finished(mount, generation)

    def mount_for(model_id: Optional[str]) -> Mount:
        if len(mounts) == 1:
            return mounts[0]  # one model: any id is served by it (clients often send a placeholder)
        if model_id in by_name:
            return by_name[model_id]
        raise ApiError(404, f"model {model_id!r} is not served here; served: {', '.join(by_name)}",
                       type="not_found_error", param="model", code="model_not_found")

    # -- the seed route, one per served lease ------------------------------------------------
    def add_chat_route(mount: Mount) -> None:
        async def chat(body: ChatRequest, request: Request) -> Any:  # type: ignore[valid-type]
            generation = await admit(mount, body.prompt, max_tokens=body.max_tokens, temperature=body.temperature,
                                     seed=body.seed, stop=body.stop, prompt_field="prompt")
            response = await complete(mount, generation, request, "prompt")
            if response is None:
                return Response(status_code=499)
            return {
                "model": mount.name,
                "text": response.text,
                "finish_reason": response.finish_reason,
                "output_hash": response.output_hash,
                "tokens_per_second": response.tokens_per_second(),
                "usage": _usage(response),
                "timings": response.timings.as_dict(),
            }

        app.add_api_route(
            mount.path, chat, methods=["POST"], response_model=None, name=f"chat:{mount.name}",
            summary=f"Answer one prompt with {mount.name}",
            responses={200: {"model": ChatAnswer}, **_COMMON_ERRORS},
        )

    for mount in mounts:
        add_chat_route(mount)

    # -- OpenAI-compatible routes --------------------------------------------------------------
    @app.post("/v1/chat/completions", response_model=None, summary="OpenAI chat.completions.create",
              responses={200: {"model": ChatCompletion, "content": {"text/event-stream": {}}},
                         404: {"model": ErrorBody, "description": "unknown model (several served)"},
                         **_COMMON_ERRORS})
    async def chat_completions(body: CompletionRequest, request: Request) -> Any:  # type: ignore[valid-type]
        mount = mount_for(body.model)
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        generation = await admit(
            mount, [m.plain() for m in body.messages],
            max_tokens=config.max_tokens if max_tokens is None else max_tokens,
            temperature=0.0 if body.temperature is None else body.temperature,
            seed=0 if body.seed is None else body.seed, stop=body.stop, prompt_field="messages",
        )
        ident = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        fingerprint = f"fp_{mount.model.fingerprint[:12]}"
        if body.stream:
            usage_chunk = body.stream_options is None or body.stream_options.include_usage
            events = _sse(mount, generation, ident, created, fingerprint, usage_chunk, finished)
            return _EventStream(events, generation)
        response = await complete(mount, generation, request, "messages")
        if response is None:
            return Response(status_code=499)
        return {
            "id": ident,
            "object": "chat.completion",
            "created": created,
            "model": mount.name,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": response.text},
                         "finish_reason": response.finish_reason, "logprobs": None}],
            "usage": _openai_usage(response),
            "timings": response.timings.as_dict(),
        }

    @app.get("/v1/models", response_model=ModelList, summary="The served models")
    async def list_models() -> Any:
        return {"object": "list", "data": [_card(m) for m in mounts]}

    @app.get("/v1/models/{model_id}", response_model=ModelCard, summary="One served model",
             responses={404: {"model": ErrorBody}})
    async def get_model(model_id: str) -> Any:
        if model_id not in by_name:
            raise ApiError(404, f"model {model_id!r} is not served here", type="not_found_error",
                           param="model", code="model_not_found")
        return _card(by_name[model_id])

    # -- operations ------------------------------------------------------------------------------
    @app.get("/health", response_model=Health, summary="Liveness for gateways (no token needed)",
             responses={503: {"model": Health, "description": "a served model is closed"}})
    async def health() -> Any:
        models = [
            {"id": m.name, "path": m.path, "closed": _unavailable(m), "in_flight": m.gate.in_flight,
             "capacity": m.capacity}
            for m in mounts
        ]
        ok = not any(entry["closed"] for entry in models)
        return JSONResponse({"status": "ok" if ok else "unavailable", "models": models}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus text format",
             responses={200: {"content": {metrics_mod.CONTENT_TYPE: {}}}})
    async def metrics() -> Any:
        return PlainTextResponse(metrics_mod.render(service_metrics, mounts), media_type=metrics_mod.CONTENT_TYPE)

    _add_security_scheme(app, config.bearer_token is not None)
    routes = frozenset({m.path for m in mounts} | {"/v1/chat/completions", "/v1/models", "/health", "/metrics",
                                                   "/openapi.json"})
    app.add_middleware(Guard, max_body_bytes=config.max_body_bytes, bearer_token=config.bearer_token,
                       routes=routes, record=service_metrics.request)
    return app


class _EventStream(StreamingResponse):
    """SSE answer whose generation is cancelled however the response ends (even before it starts)."""

    def __init__(self, events: AsyncIterator[str], generation: Generation) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._generation = generation

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.abort()  # a no-op once the stream ended normally


async def _sse(mount: Mount, generation: Generation, ident: str, created: int, fingerprint: str,
               usage_chunk: bool, finished: Any) -> AsyncIterator[str]:
    import json

    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def chunk(delta: dict[str, Any], finish_reason: Optional[str] = None) -> str:
        return event({
            "id": ident, "object": "chat.completion.chunk", "created": created, "model": mount.name,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        })

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for piece in generation.pieces():
            yield chunk({"content": piece})
        response = finished(mount, generation)
    except RequestTimeout:
        yield event(ApiError(504, "the request ran past the service's timeout; its generation was cancelled",
                             type="timeout_error", code="timeout").body())
        return
    except ApiError as exc:
        yield event(exc.body())
        return
    except llm_errors.LLMError as exc:
        yield event(from_library(exc).body())
        return
    yield chunk({}, response.finish_reason)
    if usage_chunk:
        yield event({
            "id": ident, "object": "chat.completion.chunk", "created": created, "model": mount.name,
            "system_fingerprint": fingerprint, "choices": [], "usage": _openai_usage(response),
            "timings": response.timings.as_dict(),
        })
    yield "data: [DONE]\n\n"


async def _disconnected(request: Request) -> None:
    """Resolves when the client of a non-streaming request goes away (its body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _unavailable(mount: Mount) -> bool:
    """Closed, or a batching lease whose scheduler thread is gone."""
    if mount.model.closed:
        return True
    stats = mount.stats()
    return stats is not None and not stats.running


def _loc(loc: Any) -> Optional[str]:
    parts = [p for p in loc if p != "body"]
    if not parts:
        return None
    out = str(parts[0])
    for p in parts[1:]:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _usage(response: Any) -> dict[str, int]:
    u = response.usage
    return {"prompt_tokens": u.prompt_tokens, "cached_input_tokens": u.cached_input_tokens,
            "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens}


def _openai_usage(response: Any) -> dict[str, Any]:
    u = response.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_input_tokens}}


def _card(mount: Mount) -> dict[str, Any]:
    return {"id": mount.name, "object": "model", "created": mount.created, "owned_by": "aner_nb"}


def _add_security_scheme(app: FastAPI, enabled: bool) -> None:
    """Publish the bearer requirement in /openapi.json (the Guard enforces it)."""
    if not enabled:
        return
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original()
            schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, operations in schema.get("paths", {}).items():
                if path in ("/health", "/openapi.json"):
                    continue
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
