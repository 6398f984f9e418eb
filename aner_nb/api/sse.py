"""Server-sent events: the event encoding, keep-alive comments, and the streaming response.

A streamed answer is ``data: <json>`` events ending with ``data: [DONE]``.
While no text comes (the request waits in the scheduler's queue, its prompt
is evaluated, or a decode step is slow) a comment line ``: keep-alive`` is
sent every ``keepalive_s`` seconds, so a proxy with an idle timeout (nginx's
``proxy_read_timeout``, a load balancer's 60 s) does not cut the stream.
SSE clients skip comment lines (the ``openai`` SDK, browsers' EventSource).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Optional

from pydantic import BaseModel
from starlette.responses import StreamingResponse

__all__ = ["KEEPALIVE", "DONE", "event", "with_keepalive", "EventStream"]

KEEPALIVE = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"


def event(payload: Any) -> str:
    """One SSE ``data:`` event: a response model (only the fields it was given) or a plain dict."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json", exclude_unset=True)
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def with_keepalive(items: AsyncIterator[str], keepalive_s: float) -> AsyncIterator[Optional[str]]:
    """``items``, with ``None`` yielded each time ``keepalive_s`` seconds pass without one (0: never).

    The next item is awaited as a task that survives a keep-alive; if this
    generator is cancelled or closed (the client went away), that task is
    cancelled, which cancels ``items`` where it waits, and waited for.
    """
    if keepalive_s <= 0:
        async for item in items:
            yield item
        return
    iterator = items.__aiter__()
    pending: Optional[asyncio.Future] = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            if not pending.done():
                pending.cancel()
                # Let ``items`` see its cancellation before the caller goes on (the response then aborts the
                # generation; ``items`` must learn first that its client went away, to count it as such).
                await asyncio.wait({pending})
            if not pending.cancelled():
                # It may have ended (e.g. StopAsyncIteration) just as the client left: mark its outcome
                # retrieved, or asyncio logs "Task exception was never retrieved".
                pending.exception()


class EventStream(StreamingResponse):
    """SSE answer whose generation is cancelled however the response ends (even before it starts).

    Ending before the generation did means the client went away (a timeout
    or an error ends the generation first), which the generation counts.
    """

    def __init__(self, events: AsyncIterator[str], generation: Any) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._generation = generation

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.client_gone()  # a no-op once the generation ended
