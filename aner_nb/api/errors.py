"""HTTP error answers: one JSON shape, and the mapping from the library's typed errors.

Every error is ``{"error": {"message", "type", "param", "code"}}`` (the
OpenAI shape, so the ``openai`` SDK raises its matching exception class).
``param`` names the offending request field when there is one.

=====================================  ======  ==========================
library error                          status  notes
=====================================  ======  ==========================
InvalidRequestError                    400     ``param`` from the message
ContextOverflowError                   400     ``code=context_length_exceeded``
BusyError                              503     ``Retry-After``
ClosedError                            503     the model was closed
EngineError (and anything unexpected)  500
=====================================  ======  ==========================
"""

from __future__ import annotations

import re
from typing import Any

from starlette.responses import JSONResponse

from ..llm import errors as llm_errors

__all__ = ["ApiError", "from_library", "busy", "REQUEST_FIELDS"]

REQUEST_FIELDS = ("prompt", "messages", "max_tokens", "temperature", "seed", "stop", "model", "n", "stream")
_PARAM = re.compile(r"^(?P<name>[a-z_]+)(?P<rest>(?:\[\d+\])?(?:\.[a-z_]+)?)(?=[\s:=]|$)")


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
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def busy(message: str, retry_after_s: int) -> ApiError:
    return ApiError(
        503, message, type="overloaded_error", code="busy", headers={"Retry-After": str(retry_after_s)}
    )


def _param(message: str, prompt_field: str) -> str | None:
    match = _PARAM.match(message)
    if match and match.group("name") in REQUEST_FIELDS:
        name = match.group("name")
        return ("prompt" if prompt_field == "prompt" and name == "messages" else name) + match.group("rest")
    return None


def from_library(exc: BaseException, *, prompt_field: str = "messages", retry_after_s: int = 1) -> ApiError:
    """The HTTP answer for a library error (``prompt_field`` is what the route calls the input)."""
    message = " ".join(str(exc).split())
    if isinstance(exc, llm_errors.ContextOverflowError):
        return ApiError(400, message, param=prompt_field, code="context_length_exceeded")
    if isinstance(exc, (llm_errors.InvalidRequestError, llm_errors.ChatTemplateError)):
        return ApiError(400, message, param=_param(message, prompt_field), code="invalid_value")
    if isinstance(exc, llm_errors.BusyError):
        return busy(message, retry_after_s)
    if isinstance(exc, llm_errors.ClosedError):
        return ApiError(503, message, type="unavailable_error", code="model_closed")
    return ApiError(500, "the engine failed while answering this request; see the server log",
                    type="server_error", code="engine_error")
