"""The one OpenAI-style error body every refusal of the service carries.

``{"error": {"message", "type", "param", "code"}}``: the shape the ``openai``
SDK maps to its exception classes. The application's answers
(``errors.ApiError``), the ASGI middlewares (``guard``, ``origin``) and the
connection layer (``edges``, which answers before any application runs) all
build it here, so the shape cannot drift between them.
"""

from __future__ import annotations

import json
from typing import Any, Optional

__all__ = ["error_body", "error_json"]


def error_body(message: str, *, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    """The error body as a dict (for JSON responses and SSE error events)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_json(message: str, *, type: str, param: Optional[str] = None, code: Optional[str] = None) -> bytes:
    """The error body as UTF-8 JSON bytes (for answers written straight to ASGI ``send`` or a transport)."""
    return json.dumps(error_body(message, type=type, param=param, code=code)).encode()
