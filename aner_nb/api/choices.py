"""OpenAI's ``n``: several choices of one request, each a generation of its own.

Choice ``i`` is the request with seed ``seed + i`` (``Call.choice``), so a
seeded request's choices are reproducible one by one and greedy choices are
identical. On a batching lease every choice is admitted at once (each takes
a slot of the mount's gate, so ``n`` above the free capacity is answered 503
busy) and the choices run as concurrent sequences of the scheduler; on any
other lease they run one after another, each admitted when the previous one
has ended. Streamed, each choice's chunks carry its ``index`` (interleaved as
they come on a batching lease); the usage chunk (prompt once, every choice's
completion tokens) and ``[DONE]`` close the stream once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from ..llm.response import Response
from .errors import ApiError
from .runtime import Generation, Mount
from .sse import DONE, event

if TYPE_CHECKING:
    from .calls import Call
    from .schemas import Envelope
    from .service import Service

__all__ = ["Running", "complete_choices", "choice_events", "summed"]


class Running:
    """The generations of one request's choices, so an ended stream cancels every one of them."""

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = list(generations)

    def add(self, generation: Generation) -> None:
        self.generations.append(generation)

    def client_gone(self) -> None:
        for generation in self.generations:
            generation.client_gone()

    def abort(self) -> None:
        for generation in self.generations:
            generation.abort()


def summed(responses: list[Response]) -> Response:
    """The first choice's Response with every choice's completion tokens (the prompt counted once)."""
    first = responses[0]
    usage = dataclasses.replace(first.usage, completion_tokens=sum(r.usage.completion_tokens for r in responses))
    return dataclasses.replace(first, usage=usage)


async def _admit_rest(service: "Service", mount: Mount, call: "Call", running: Running) -> None:
    """Admit choices 1..n-1 (a batching lease runs them concurrently); on a refusal the admitted ones end."""
    try:
        for index in range(1, call.n):
            running.add(await service.admit(mount, call.choice(index)))
    except BaseException:
        running.abort()
        raise


async def complete_choices(
    service: "Service", mount: Mount, call: "Call", request: Any, first: Generation
) -> Optional[list[Response]]:
    """Every choice's Response in index order; None when the client went away meanwhile."""
    running = Running([first])
    if mount.batching:
        await _admit_rest(service, mount, call, running)
        try:
            done = await asyncio.gather(*(service.complete(mount, g, request, call) for g in running.generations))
        except BaseException:
            running.abort()
            raise
        return None if any(r is None for r in done) else list(done)
    responses: list[Response] = []
    for index in range(call.n):
        generation = first if index == 0 else await service.admit(mount, call.choice(index))
        response = await service.complete(mount, generation, request, call)
        if response is None:
            return None
        responses.append(response)
    return responses


async def choice_events(
    service: "Service", mount: Mount, call: "Call", envelope: "Envelope", chunks: Any, include_usage: bool,
    running: Running,
) -> AsyncIterator[str]:
    """The SSE events of ``n`` streamed choices; a failed choice (its error event) ends the stream."""
    ended: list[Response] = []
    if mount.batching:
        try:
            await _admit_rest(service, mount, call, running)
        except ApiError as exc:
            yield event(exc.body())
            return
        async for item in _merged([service.events(mount, g, call, envelope, chunks, include_usage, index=i,
                                                  framed=False, ended=ended)
                                   for i, g in enumerate(running.generations)]):
            yield item
    else:
        for index in range(call.n):
            if index:
                try:
                    running.add(await service.admit(mount, call.choice(index)))
                except ApiError as exc:
                    yield event(exc.body())
                    return
            count = len(ended)
            async for item in service.events(mount, running.generations[index], call, envelope, chunks,
                                             include_usage, index=index, framed=False, ended=ended):
                yield item
            if len(ended) == count:  # this choice failed: its error event was the last one
                return
    if len(ended) < call.n:
        running.abort()
        return
    if include_usage:
        yield event(chunks.usage_of(envelope, summed(ended)))
    yield DONE


async def _merged(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The items of every stream as they come; stops (closing the others) after an error event."""
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(stream: AsyncIterator[str]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        finally:
            await queue.put(finished)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    left = len(tasks)
    try:
        while left:
            item = await queue.get()
            if item is finished:
                left -= 1
                continue
            yield item
            if item.startswith('data: {"error"'):
                return
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
