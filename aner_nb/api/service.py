"""The FastAPI application: each route's endpoint, and one request's way through the service.

The routes are declared in ``routes``; here each gets its endpoint. A
request is parsed (``request_bodies``) into a ``Call`` (``calls``: the
library's arguments, and how the route names its fields), admitted (the
model is open and its gate has room, else 503), run as a stream whose
pieces the event loop reads as they arrive (see ``runtime``), and answered with the route's
response model (see ``schemas``): whole, or as SSE chunks (``sse``) with
keep-alive comments while no text comes. Each request is a stateless call on
the served lease: with a batching lease concurrent requests become sequences
of its one scheduler; an ordinary lease runs one request at a time and
answers the next one busy.

No ``from __future__ import annotations`` here: FastAPI reads the endpoint
annotations, which name request models built per service.
"""

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from .._version import __version__
from ..llm import errors as llm_errors
from .config import ServiceConfig
from . import embeddings as embedding_routes
from .calls import Call, chat_call, completion_call, seed_call
from .openai_fields import IGNORED_FIELDS_HEADER, ignored_fields_header
from . import choices
from ..llm.output import OutputSplitter
from .schemas import chat_finish_reason
from .errors import ApiError, busy, from_library, install_handlers
from .guard import Guard
from .origin import HostPolicy, OriginGuard, OriginPolicy
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import ServiceMetrics
from .request_bodies import request_models
from .routes import OPEN_PATHS, Route, metric_labels, service_routes
from .runtime import ClientGone, Generation, Mount, RequestTimeout
from .schemas import (ChatAnswer, ChatCompletion, ChatCompletionChunk, Envelope, Health, ModelCard, ModelHealth,
                      ModelList, TextCompletion, TextCompletionChunk)
from .sse import DONE, KEEPALIVE, EventStream, event, with_keepalive

__all__ = ["ServiceConfig", "Service", "build_app"]

log = logging.getLogger("aner_nb.api")


# -- admission, running, answers ---------------------------------------------------------------
class Service:
    """One application's served models, and how a request is admitted, run and answered on them.

    Endpoints are its methods or close over it, and FastAPI caches endpoints
    process-wide: it holds the mounts (which let go of their leases at
    shutdown) and its config without the specs (they hold the leases).
    """

    def __init__(self, config: ServiceConfig, mounts: list[Mount], metrics: ServiceMetrics) -> None:
        self.config = dataclasses.replace(config, mounts=())  # the settings as given, no lease
        self.mounts = mounts
        self.by_name = {m.name: m for m in mounts}
        self.metrics = metrics

    def mount_for(self, model_id: Optional[str]) -> Mount:
        if len(self.mounts) == 1:
            return self.mounts[0]  # one model: any id is served by it (clients often send a placeholder)
        if model_id in self.by_name:
            return self.by_name[model_id]
        raise ApiError(404, f"model {model_id!r} is not served here; served: {', '.join(self.by_name)}",
                       type="not_found_error", param="model", code="model_not_found")

    def _enter(self, mount: Mount) -> None:
        """Take a slot of ``mount``'s gate, or answer 503: the model is closed, or it is full."""
        if mount.model.closed:
            raise ApiError(503, f"model {mount.name!r} is closed; it accepts no requests",
                           type="unavailable_error", code="model_closed")
        if not mount.gate.try_enter():
            mount.metrics.count("busy_rejections")
            raise busy(f"model {mount.name!r} is busy: {mount.capacity} requests are running or queued; "
                       f"retry after {self.config.retry_after_s} s", self.config.retry_after_s)
        mount.metrics.count("requests")

    async def admit(self, mount: Mount, call: Call) -> Generation:
        """Admit ``call`` on ``mount`` and start its stream; its slot is held until the stream ends."""
        self._enter(mount)
        generation = Generation(mount, self.config.timeout_ms / 1000.0)
        model = mount.model
        try:
            await generation.open(lambda: call.start(model))
        except RequestTimeout:
            raise self.timeout_error() from None
        except llm_errors.LLMError as exc:
            raise self.library_error(mount, exc, call) from None
        return generation

    async def complete(self, mount: Mount, generation: Generation, request: Request, call: Call) -> Any:
        """Run a non-streaming request to its end; None when the client went away meanwhile."""
        try:
            await generation.collect(_disconnected(request))
        except RequestTimeout:
            raise self.timeout_error() from None
        except ClientGone:
            return None
        except llm_errors.LLMError as exc:
            raise self.library_error(mount, exc, call) from None
        return self.finished(mount, generation, call)

    def finished(self, mount: Mount, generation: Generation, call: Call) -> Any:
        """The ended generation's Response, measured; 503 when the server's shutdown cancelled it."""
        response = generation.response
        if response.finish_reason == "cancelled":  # only shutdown cancels without a timeout or disconnect
            raise ApiError(503, "the server is shutting down; the generation was cancelled",
                           type="unavailable_error", code="shutting_down")
        mount.metrics.finished(call.route, response, generation.first_piece_s)
        return response

    async def run_work(self, mount: Mount, work: Callable[[], Any], *, fields: frozenset, prompt_field: str) -> Any:
        """Run ``work`` (a blocking library call that is not a generation: embed, tokenize) on ``mount``'s
        worker pool under its gate; the slot is held until the work ends, even when the answer is a 504."""
        self._enter(mount)
        try:
            future = asyncio.get_running_loop().run_in_executor(mount.pool, work)
        except BaseException:
            mount.gate.leave()
            raise

        def ended(f: "asyncio.Future[Any]") -> None:
            mount.gate.leave()
            if not f.cancelled():
                f.exception()  # retrieved here, so one that outlived a 504 answer is not reported as lost

        future.add_done_callback(ended)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.config.timeout_ms / 1000.0)
        except asyncio.TimeoutError:
            raise self.timeout_error() from None
        except llm_errors.LLMError as exc:
            if isinstance(exc, llm_errors.BusyError):
                mount.metrics.count("busy_rejections")
            raise from_library(exc, fields=fields, prompt_field=prompt_field,
                               retry_after_s=self.config.retry_after_s) from None

    def timeout_error(self) -> ApiError:
        return ApiError(504, f"the request ran past this service's timeout of {self.config.timeout_ms} ms; "
                        "its generation was cancelled", type="timeout_error", code="timeout")

    def library_error(self, mount: Mount, exc: BaseException, call: Call) -> ApiError:
        """The answer for a library error raised by ``call``, counted and logged."""
        error = from_library(exc, fields=call.fields, prompt_field=call.prompt_field,
                             retry_after_s=self.config.retry_after_s, renames=call.renames)
        if isinstance(exc, llm_errors.BusyError):
            mount.metrics.count("busy_rejections")
        if error.status >= 500 and error.status != 503:
            log.error("request failed: %s", exc, exc_info=exc)
        return error

    async def events(self, mount: Mount, generation: Generation, call: Call, envelope: Envelope, chunks: Any,
                     include_usage: bool, *, index: int = 0, framed: bool = True,
                     ended: Optional[list] = None) -> AsyncIterator[str]:
        """The SSE events of a streamed answer in ``chunks``' shape (see ``schemas``); an error ends them early.

        ``index`` is the choice's; ``framed=False`` leaves out the usage chunk and ``[DONE]`` (the events of
        one of ``n`` choices, see :func:`choice_events`); ``ended`` receives the Response when it finishes.
        With logprobs each text chunk carries its tokens' logprobs, the finishing chunk those of tokens
        whose text was not sent (a stop string's, or all of them when the text is split for reasoning).
        """
        opening = chunks.opening(envelope)
        if opening is not None:
            yield event(opening.scored(index))
        if call.echo:
            yield event(chunks.text(envelope, call.prompt).scored(index))
        scoring = bool(call.options.get("logprobs"))
        sent, offset = 0, len(call.prompt) if call.echo else 0  # logprob entries sent; characters sent
        splitter = _splitter(generation, chunks)  # reasoning and tool calls apart (chat answers that have them)
        try:
            async for piece in with_keepalive(generation.pieces(), self.config.sse_keepalive_s):
                if piece is None:
                    yield KEEPALIVE
                elif splitter is None:
                    entries = getattr(piece, "logprobs", ()) if scoring else None
                    yield event(chunks.text(envelope, str(piece)).scored(index, entries, offset))
                    sent += len(entries or ())
                    offset += len(piece)
                else:
                    for split in _split_events(chunks, envelope, splitter.feed(piece), index):
                        yield split
            response = self.finished(mount, generation, call)
        except RequestTimeout:
            yield event(self.timeout_error().body())
            return
        except ApiError as exc:
            yield event(exc.body())
            return
        except llm_errors.LLMError as exc:
            yield event(self.library_error(mount, exc, call).body())
            return
        if splitter is not None:
            for split in _split_events(chunks, envelope, splitter.finish(response.text), index):
                yield split
            for chunk in chunks.tool_call_deltas(envelope, response):
                yield event(chunk.scored(index))
        rest = (response.logprobs or ())[sent:] if scoring else None
        yield event(chunks.finish(envelope, chat_finish_reason(response)).scored(index, rest, offset))
        if ended is not None:
            ended.append(response)
        if not framed:
            return
        if include_usage:
            yield event(chunks.usage_of(envelope, response))
        yield DONE

    # -- the GET endpoints ---------------------------------------------------------------------
    async def list_models(self) -> ModelList:
        return ModelList(object="list", data=[_card(m) for m in self.mounts])

    async def get_model(self, model_id: str) -> ModelCard:
        if model_id not in self.by_name:
            raise ApiError(404, f"model {model_id!r} is not served here", type="not_found_error",
                           param="model", code="model_not_found")
        return _card(self.by_name[model_id])

    async def health(self, response: Response) -> Health:
        models = [ModelHealth(id=m.name, path=m.path, closed=_unavailable(m), in_flight=m.gate.in_flight,
                              capacity=m.capacity) for m in self.mounts]
        ok = not any(entry.closed for entry in models)
        response.status_code = 200 if ok else 503
        return Health(status="ok" if ok else "unavailable", models=models)

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE)


def _splitter(generation: Generation, chunks: Any) -> Optional[OutputSplitter]:
    """A splitter for a chat stream whose text holds reasoning or tool calls; None for plain text."""
    fmt = getattr(generation.stream, "output_format", None)
    if fmt is None or fmt.plain or not hasattr(chunks, "reasoning"):
        return None
    return OutputSplitter(fmt)


def _split_events(chunks: Any, envelope: Envelope, parts: list[tuple[str, str]], index: int = 0) -> list[str]:
    return [event((chunks.reasoning(envelope, text) if channel == "reasoning" else chunks.text(envelope, text))
                  .scored(index)) for channel, text in parts]


# -- the POST endpoints (their body types are built per service) -------------------------------
def seed_endpoint(service: Service, mount: Mount, body_model: type) -> Callable[..., Any]:
    """``POST <path>`` of one served model: one prompt, answered whole."""

    async def chat(body: body_model, request: Request) -> Any:  # type: ignore[valid-type]
        call = seed_call(body, mount.path)
        generation = await service.admit(mount, call)
        response = await service.complete(mount, generation, request, call)
        if response is None:
            return Response(status_code=499)
        return ChatAnswer.of(mount.name, response)

    return chat


@dataclass(frozen=True)
class OpenAIRoute:
    """How one OpenAI route parses its body and shapes its answer."""

    make_call: Callable[[Any, int, bool], Call]  # body, max_tokens cap, lenient -> Call (400 for what it refuses)
    answer: Any  # the whole answer's model: ChatCompletion or TextCompletion (``of(envelope, response)``)
    chunks: Any  # the streamed chunks' model: ChatCompletionChunk or TextCompletionChunk
    id_prefix: str  # of the answer's id: chatcmpl-..., cmpl-...


CHAT_COMPLETIONS = OpenAIRoute(chat_call, ChatCompletion, ChatCompletionChunk, "chatcmpl")
COMPLETIONS = OpenAIRoute(completion_call, TextCompletion, TextCompletionChunk, "cmpl")


def _ignoring(response: Response, call: Call) -> Response:
    """``response`` (a stream, or the answer's injected headers) naming the unknown fields a lenient
    service ignored; no header when none were."""
    if call.ignored:
        response.headers[IGNORED_FIELDS_HEADER] = ignored_fields_header(call.ignored)
    return response


def openai_endpoint(service: Service, body_model: type, route: OpenAIRoute) -> Callable[..., Any]:
    """``POST /v1/chat/completions`` or ``/v1/completions``: answered whole, or streamed as SSE chunks."""

    async def openai_completion(body: body_model, request: Request, reply: Response) -> Any:  # type: ignore[valid-type]
        mount = service.mount_for(body.model)
        call = route.make_call(body, service.config.max_tokens, service.config.lenient_fields)
        generation = await service.admit(mount, call.choice(0))
        envelope = Envelope.new(route.id_prefix, mount.name, mount.model.fingerprint, call.seed)
        echo = call.prompt if call.echo else None
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            if call.n == 1:
                events = service.events(mount, generation, call, envelope, route.chunks, include_usage)
                return _ignoring(EventStream(events, generation), call)
            running = choices.Running([generation])
            events = choices.choice_events(service, mount, call, envelope, route.chunks, include_usage, running)
            return _ignoring(EventStream(events, running), call)
        if call.n == 1:
            response = await service.complete(mount, generation, request, call)
            responses = None if response is None else [response]
        else:
            responses = await choices.complete_choices(service, mount, call, request, generation)
        if responses is None:
            return Response(status_code=499)
        _ignoring(reply, call)
        return route.answer.of_choices(envelope, responses, echo=echo)

    return openai_completion


# -- the application ---------------------------------------------------------------------------
def build_app(config: ServiceConfig) -> FastAPI:
    """A new ASGI application serving ``config``'s leases (each build has its own pools and counters)."""
    metrics = ServiceMetrics()
    mounts = [Mount(path=s.path, model=s.model, name=s.name, max_concurrent=config.max_concurrent,
                    metrics=metrics.model(s.name)) for s in config.mounts]
    metrics.watch(lambda: mounts)
    routes = service_routes((m.path, m.name) for m in mounts)
    service = Service(config, mounts, metrics)
    app = FastAPI(title=config.title, version=__version__, docs_url=None, redoc_url=None,
                  description="Local GGUF models over HTTP (aner_nb): the seed /chat route and OpenAI-compatible "
                  "routes.", lifespan=_lifespan(mounts))
    app.state.mounts = mounts
    app.state.metrics = metrics  # a Server adds its connection registry's families (watch_connections)
    install_handlers(app)
    endpoints = _endpoints(service, request_models(max_tokens=config.max_tokens, max_rows=config.max_rows,
                                                   registry=config.registry))
    for route in routes:
        if not route.builtin:
            _add_route(app, route, endpoints[route.name])
    app.openapi = _openapi(app, bearer=config.authenticated)  # type: ignore[method-assign]
    labels = metric_labels(routes)
    app.add_middleware(Guard, max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s,
                       bearer_token=config.bearer_token, api_keys=config.api_keys,
                       open_paths=OPEN_PATHS, routes=labels, record=metrics.request)
    if config.cors_origins:  # outside the Guard: preflights are answered before the token check
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"], expose_headers=["retry-after"],
                           max_age=600)
    # Added last, so outermost: a Host or Origin that is not allowed is refused before CORS, auth or routing.
    app.add_middleware(OriginGuard, hosts=HostPolicy(config.host, config.allowed_hosts),
                       origins=OriginPolicy(config.cors_origins), record=metrics.request, routes=labels)
    return app


def _endpoints(service: Service, bodies: Any) -> dict[str, Callable[..., Any]]:
    """Every route's endpoint by route name (see ``routes``)."""
    seeds = {f"chat:{m.name}": seed_endpoint(service, m, bodies.seed) for m in service.mounts}
    return {
        **seeds,
        "chat_completions": openai_endpoint(service, bodies.chat, CHAT_COMPLETIONS),
        "completions": openai_endpoint(service, bodies.completion, COMPLETIONS),
        "list_models": service.list_models,
        "get_model": service.get_model,
        "health": service.health,
        "metrics": service.metrics_text,
        **embedding_routes.endpoints(service),
    }


def _add_route(app: FastAPI, route: Route, endpoint: Callable[..., Any]) -> None:
    extra = {"response_class": route.response_class} if route.response_class is not None else {}
    app.add_api_route(route.path, endpoint, methods=[route.method], name=route.name, summary=route.summary,
                      response_model=route.response_model, responses=dict(route.responses), **extra)


def _lifespan(mounts: list[Mount]) -> Callable[[FastAPI], Any]:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        for mount in mounts:  # cancel what still runs, then join the worker threads
            await asyncio.to_thread(mount.shutdown)

    return lifespan


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


def _card(mount: Mount) -> ModelCard:
    return ModelCard(id=mount.name, object="model", created=mount.created, owned_by="aner_nb")


def _openapi(app: FastAPI, *, bearer: bool) -> Callable[[], dict[str, Any]]:
    """``app.openapi`` that also publishes the SSE chunk schema and, with a token, the bearer requirement."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {})
            _add_models(components.setdefault("schemas", {}), ChatCompletionChunk, TextCompletionChunk)
            if bearer:  # enforced by the Guard
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for path, operations in schema.get("paths", {}).items():
                    if path not in OPEN_PATHS:
                        for operation in operations.values():
                            operation["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def _add_models(schemas: dict[str, Any], *models: type[BaseModel]) -> None:
    """Add ``models`` (and the models they use) to the schema's components, keeping those already there."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema([(m, "serialization") for m in models], ref_template="#/components/schemas/{model}")
    for name, definition in top.get("$defs", {}).items():
        schemas.setdefault(name, definition)
