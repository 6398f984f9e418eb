"""How the service runs a request (``aner_nb/api/runtime.py``): one admission control, no worker hop per piece.

The runtime is driven directly on an event loop (no HTTP server): a real
batching or ordinary lease of the tiny fixture model where the engine
matters, a scripted lease where the scheduler's queue must be full at a
chosen moment. Worker calls are counted by a pool that counts its submits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from types import SimpleNamespace

import pytest

from aner_nb import api, llm
from aner_nb.api.config import ServiceConfig
from aner_nb.api.envelope import error_body
from aner_nb.api.errors import ApiError
from aner_nb.api.metrics import ServiceMetrics
from aner_nb.api.runtime import Generation, Mount, RequestTimeout
from aner_nb.api.service import Service
from aner_nb.llm.errors import BusyError
from fixtures.leases import one_thread_lease


class CountingPool(concurrent.futures.ThreadPoolExecutor):
    """A mount's pool that counts the worker calls made on it."""

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers)
        self.submits = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submits += 1
        return super().submit(fn, *args, **kwargs)


def counted(mount: Mount) -> CountingPool:
    pool = CountingPool(mount.capacity)
    mount._pool = pool  # before the first request: the mount creates its pool on first use
    return pool


@pytest.fixture(scope="module")
def base(llama_path):
    with one_thread_lease(llama_path, 1024) as model:
        yield model


def stream_through(mount: Mount, max_tokens: int) -> tuple[list[str], Generation]:
    """Admit one greedy streamed request on ``mount`` and read it to its end on a fresh event loop."""

    async def scenario():
        assert mount.gate.try_enter()
        generation = Generation(mount, timeout_s=60.0)
        await generation.open(lambda: mount.model.stream("Tell me about the harbour.", max_tokens=max_tokens,
                                                         temperature=0))
        pieces = [piece async for piece in generation.pieces()]
        await generation.wait_closed()
        return pieces, generation

    return asyncio.run(scenario())


# -- nothing outlives its request -------------------------------------------------------------------
def test_a_finished_generation_and_its_stream_are_collected(base):
    """The library's request reaches its outbox, and the stream's finalizer (held by the finalizer
    registry) reaches the request: an outbox holding its generation strongly kept every stream alive
    (seen: the soak's server RSS doubled in three minutes)."""
    import gc
    import weakref

    with base.with_batching(2) as batching:
        mount = Mount(path="/b", model=batching, name="b", max_concurrent=None)
        refs = []
        for _ in range(3):
            pieces, generation = stream_through(mount, 4)
            refs += [weakref.ref(generation), weakref.ref(generation.stream)]
            del generation
        gc.collect()
        assert [r() for r in refs] == [None] * len(refs)


# -- no worker thread per piece ----------------------------------------------------------------
def test_a_batching_stream_is_read_on_the_loop_not_on_a_worker_per_piece(base):
    with base.with_batching(2) as batching:
        mount = Mount(path="/b", model=batching, name="b", max_concurrent=None)
        pool = counted(mount)
        pieces, generation = stream_through(mount, 32)
        long_submits = pool.submits
        short, _ = stream_through(mount, 2)
        assert len(pieces) > 4 and generation.response.usage.completion_tokens >= len(pieces)
        # open + the last read, whatever the length: the old runtime made one worker call per piece
        assert long_submits == 2 and pool.submits - long_submits == 2, (long_submits, pool.submits, len(pieces))
        assert len(generation._outboxes) == 1  # the scheduler's outbox was observed and woke the loop
        assert "".join(pieces) == generation.response.text
        assert mount.gate.in_flight == 0 and batching.stats().active == 0
        mount.shutdown()


def test_an_ordinary_stream_is_drained_by_one_worker_call(base):
    mount = Mount(path="/a", model=base, name="a", max_concurrent=None)
    pool = counted(mount)
    pieces, generation = stream_through(mount, 24)
    assert len(pieces) > 4 and pool.submits == 2  # open, then one drain that hands every piece to the loop
    assert "".join(pieces) == generation.response.text and mount.gate.in_flight == 0
    mount.shutdown()


# -- one admission control ---------------------------------------------------------------------
class ScriptedBatching:
    """A batching lease whose scheduler (one sequence, a queue of one) takes a waiting request only on ``step()``.

    ``stream()`` refuses as the real scheduler does when its queue is full,
    and counts the refusals: the runtime must never provoke one.
    """

    closed = False
    name = "scripted"
    fingerprint = "fp"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = self.active = self.refused = self.stats_calls = 0

    def supports(self, feature: str) -> bool:
        return feature == "continuous_batching"

    def stats(self) -> SimpleNamespace:
        with self._lock:
            self.stats_calls += 1
            return SimpleNamespace(max_sequences=1, queue_limit=1, waiting=self.waiting, active=self.active,
                                   closed=False, running=True)

    def stream(self) -> "ScriptedStream":
        with self._lock:
            if self.waiting >= 1:
                self.refused += 1
                raise BusyError("the batching queue is full")
            self.waiting += 1
        return ScriptedStream()

    def step(self) -> None:
        with self._lock:
            if self.waiting and not self.active:
                self.waiting, self.active = self.waiting - 1, self.active + 1


class ScriptedStream:
    """A stream that has ended at once (the admission is what these tests look at)."""

    done = False
    response = None

    def __iter__(self):
        return self

    def __next__(self):
        self.done = True
        raise StopIteration

    def cancel(self) -> None:
        self.done = True


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.001)


def test_the_gate_alone_admits_and_the_scheduler_is_never_asked_to_refuse():
    lease = ScriptedBatching()

    async def scenario():
        mount = Mount(path="/s", model=lease, name="s", max_concurrent=None)
        service = Service(ServiceConfig(), [mount], ServiceMetrics())
        assert mount.capacity == 2  # one sequence + a queue of one
        service._enter(mount)
        first = Generation(mount, timeout_s=60.0)
        await first.open(lease.stream)  # waits in the scheduler's queue: the queue is full now
        service._enter(mount)
        second = Generation(mount, timeout_s=60.0)
        opening = asyncio.ensure_future(second.open(lease.stream))
        calls = lease.stats_calls
        # It re-reads the queue's length while it waits (an open that asked the lease would be refused and done).
        await until(lambda: lease.stats_calls >= calls + 2 or opening.done())
        assert not opening.done() and lease.refused == 0
        with pytest.raises(ApiError) as refused:  # the third request: the gate answers
            service._enter(mount)
        assert (refused.value.status, refused.value.code) == (503, "busy")
        assert "retry-after" in {k.lower() for k in refused.value.headers}
        lease.step()  # the scheduler takes the first request into its sequence: the queue has room
        await opening
        assert (lease.refused, lease.waiting, lease.active) == (0, 1, 1)
        await first.collect()
        await second.collect()
        assert mount.gate.in_flight == 0
        mount.shutdown()

    asyncio.run(scenario())


def test_a_request_given_up_while_the_queue_is_full_leaves_the_gate_without_submitting():
    lease = ScriptedBatching()

    async def scenario():
        mount = Mount(path="/s", model=lease, name="s", max_concurrent=None)
        assert mount.gate.try_enter()
        await Generation(mount, timeout_s=60.0).open(lease.stream)  # fills the queue
        assert mount.gate.try_enter()
        late = Generation(mount, timeout_s=0.0)  # its deadline has passed while it waits for room
        with pytest.raises(RequestTimeout):
            await late.open(lease.stream)
        assert mount.gate.in_flight == 1 and lease.refused == 0 and lease.waiting == 1
        mount.shutdown()

    asyncio.run(scenario())


# -- one error envelope, one config ----------------------------------------------------------------
def test_every_error_body_of_the_api_package_is_built_by_the_envelope():
    import ast
    from pathlib import Path

    import aner_nb.api

    builders = set()
    for path in Path(aner_nb.api.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "error" for k in node.keys):
                builders.add(path.name)  # a literal {"error": ...}: an error body built by hand
    assert builders == {"envelope.py"}
    assert ApiError(400, "m", param="p", code="c").body() == error_body("m", type="invalid_request_error", param="p",
                                                                         code="c")


def test_the_app_holds_its_service_config_and_the_service_holds_it_without_leases(base):
    builder = api.app("t").llm(path="/chat", model=base).limits(timeout_ms=5000, retry_after_s=7).sse(keepalive_s=0)
    config = builder.config
    assert isinstance(config, ServiceConfig) and config.mounts == builder.served
    assert (builder.title, builder.timeout_ms, builder.retry_after_s, builder.sse_keepalive_s) == ("t", 5000, 7, 0.0)
    for f in dataclasses.fields(ServiceConfig):  # every setting reads through the App as before
        if f.name not in ("mounts", "allowed_hosts"):
            assert getattr(builder, f.name) == getattr(config, f.name)
    with pytest.raises(AttributeError):
        builder.no_such_setting
    mount = Mount(path="/chat", model=base, name="m", max_concurrent=None)
    service = Service(config, [mount], ServiceMetrics())
    assert service.config == dataclasses.replace(config, mounts=())  # settings as given; the specs hold leases
    mount.shutdown()
