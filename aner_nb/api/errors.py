"""HTTP error answers: one JSON shape, the mapping from the library's typed errors, and the handlers.

Every error is ``{"error": {"message", "type", "param", "code"}}`` (the
OpenAI shape, built by ``envelope.error_body``, so the ``openai`` SDK raises its matching exception class).
``param`` names the offending request field when there is one: for a
library error it is the error's own ``param`` (``max_tokens``, ``stop[0]``,
``messages[2].role``), kept only when the route has that field, and spelt in
the route's terms (the seed route's input is ``prompt``, not ``messages``).

=====================================  ======  ==========================
library error                          status  notes
=====================================  ======  ==========================
InvalidRequestError                    400     ``param`` from the error
ContextOverflowError                   400     ``code=context_length_exceeded``
BusyError                              503     ``Retry-After``
ClosedError                            503     the model was closed
EngineError (and anything unexpected)  500
=====================================  ======  ==========================

The OpenAI routes add their own 400s before the library is called
(``openai_fields``): ``unsupported_parameter`` for a field the service
cannot honour, ``unknown_parameter`` for one OpenAI does not define.
"""

from __future__ import annotations

import logging
from typing import Any, Collection, Mapping, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from ..llm import errors as llm_errors
from .body_depth import deepest_field
from .envelope import error_body

__all__ = ["ApiError", "from_library", "busy", "request_param", "install_handlers"]

log = logging.getLogger("aner_nb.api")


class ApiError(Exception):
    """An answer other than 200: status, error type, message, and the field it concerns."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def busy(message: str, retry_after_s: int) -> ApiError:
    return ApiError(
        503, message, type="overloaded_error", code="busy", headers={"Retry-After": str(retry_after_s)}
    )


def request_param(param: str | None, fields: Collection[str], prompt_field: str,
                  renames: Mapping[str, str] | None = None) -> str | None:
    """A library error's ``param`` as the route's request field, or None when the route has no such field.

    ``fields`` are the route's request fields and ``prompt_field`` the one
    holding its input: where that is ``prompt``, the library's ``messages...``
    (the prompt rendered as messages) is reported as ``prompt``. ``renames``
    maps a library option to the route's field for it (on the OpenAI routes
    ``json_schema`` is ``response_format``).
    """
    if param is None:
        return None
    name = param.split("[", 1)[0].split(".", 1)[0]
    if name == "messages" and prompt_field == "prompt":
        return "prompt"
    if renames and name in renames:
        return renames[name]
    return param if name in fields else None


def from_library(exc: BaseException, *, fields: Collection[str], prompt_field: str, retry_after_s: int = 1,
                 renames: Mapping[str, str] | None = None) -> ApiError:
    """The HTTP answer for a library error on a route with request ``fields`` whose input is ``prompt_field``."""
    message = " ".join(str(exc).split())
    if isinstance(exc, llm_errors.ContextOverflowError):
        return ApiError(400, message, param=prompt_field, code="context_length_exceeded")
    if isinstance(exc, (llm_errors.InvalidRequestError, llm_errors.ChatTemplateError)):
        return ApiError(400, message, param=request_param(exc.param, fields, prompt_field, renames),
                        code="invalid_value")
    if isinstance(exc, llm_errors.UnsupportedFeatureError) and exc.param:  # a request option this lease lacks
        return ApiError(400, message, param=request_param(exc.param, fields, prompt_field, renames),
                        code="unsupported_parameter")
    if isinstance(exc, llm_errors.BusyError):
        return busy(message, retry_after_s)
    if isinstance(exc, llm_errors.ClosedError):
        return ApiError(503, message, type="unavailable_error", code="model_closed")
    return ApiError(500, "the engine failed while answering this request; see the server log",
                    type="server_error", code="engine_error")


# -- the application's exception handlers ------------------------------------------------------
def install_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in the one JSON shape."""
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming every invalid field (the first is ``param``); 400 for a body that is not JSON."""
    problems = list(exc.errors())
    if any(p.get("type") == "json_invalid" for p in problems):
        return ApiError(400, "the request body is not valid JSON", code="invalid_json").response()
    first = problems[0] if problems else {}
    params = [_loc(p.get("loc", ())) for p in problems]
    message = "; ".join(f"{param or 'body'}: {p.get('msg', 'invalid')}" for param, p in zip(params, problems))
    return ApiError(422, message, param=params[0] if params else None, code=first.get("type")).response()


async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):  # JSON nested past Python's limit
        param, depth = deepest_field(await _request.body())  # the body was read whole before parsing
        where = f"{param}: " if param else ""
        return ApiError(400, f"{where}the JSON is nested {depth:,} levels deep, too deep to parse",
                        param=param, code="invalid_value").response()
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    return ApiError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {})).response()


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error while answering a request", exc_info=exc)
    return ApiError(500, "internal error; see the server log", type="server_error", code="internal").response()


def _loc(loc: Any) -> Optional[str]:
    """A validation error's location as a field path: ``messages[0].role``."""
    parts = [p for p in loc if p != "body"]
    if not parts:
        return None
    out = str(parts[0])
    for p in parts[1:]:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out
