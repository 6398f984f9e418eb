"""One request on one context: prefill, decode loop, text assembly and timings.

The runner is shared by every lease kind that gives a request a context of
its own (ordinary leases, optimizer leases, sessions). It is a generator of
verified text pieces whose return value is the final :class:`Response`, so
``generate`` drains it and ``stream`` hands it to the caller.

KV positions: the prompt occupies positions ``0..len(prompt)-1`` of sequence
``seq``; the first ``n_cached`` of them may already be in the KV (prefix
reuse). Logits are requested only for rows that are sampled: the last prompt
row during prefill and the single row of each decode step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Generator, Sequence

from ._engine import DECODE_NO_KV_SLOT, Batch, NativeContext, NativeModel, Sampler
from .errors import EngineError
from .profiles import RequestSettings
from .response import NOT_MEASURED, Response, Timings, Usage
from .text import TextAssembler

__all__ = ["Job", "run_request", "validate_only"]

_now = time.perf_counter_ns


@dataclass
class Job:
    """Everything the runner needs besides the engine objects; plain data."""

    prompt_tokens: Sequence[int]
    request: RequestSettings
    t_call: int  # perf_counter_ns when the caller entered generate/stream
    seq: int = 0
    n_cached: int = 0  # prompt tokens already in the KV of ``seq`` at positions 0..n_cached-1
    model_name: str = ""
    cancel: threading.Event = field(default_factory=threading.Event)
    timings: dict[str, int] = field(default_factory=dict)  # fields the caller measured (clear, pool, profile)
    result: Response | None = None


def _finish(job: Job, tokens: list[int], text: str, reason: str, measured: dict[str, int]) -> Response:
    values = dict(job.timings)
    values.update(measured)
    values["total_duration"] = _now() - job.t_call
    response = Response(
        text=text,
        tokens=tuple(tokens),
        finish_reason=reason,
        usage=Usage(
            prompt_tokens=len(job.prompt_tokens),
            cached_input_tokens=max(job.timings.get("cached_input_tokens", 0), 0),
            completion_tokens=len(tokens),
        ),
        timings=Timings(**values),
        model=job.model_name,
    )
    job.result = response
    return response


def validate_only(job: Job) -> Generator[str, None, Response]:
    """``max_tokens=0``: the request was validated; nothing touches a context or the KV."""
    measured = {"prompt_tokens": len(job.prompt_tokens), "generated_tokens": 0, "decode_calls": 0, "evaluated_prompt_tokens": 0}
    return _finish(job, [], "", "length", measured)
    yield  # pragma: no cover - makes this a generator like run_request


def _prefill(ctx: NativeContext, batch: Batch, tokens: Sequence[int], start: int, seq: int) -> int:
    """Evaluate ``tokens[start:]`` at positions ``start..``; logits only for the last row.

    Returns the number of llama_decode calls. Chunks are at most ``n_batch``
    tokens; llama.cpp splits each into micro-batches of ``n_ubatch`` itself.
    """
    calls = 0
    n_batch = batch.capacity
    for lo in range(start, len(tokens), n_batch):
        hi = min(lo + n_batch, len(tokens))
        batch.clear()
        batch.add_run(tokens[lo:hi], lo, seq, logits_last=hi == len(tokens))
        calls += 1
        if ctx.decode(batch) == DECODE_NO_KV_SLOT:
            raise EngineError(f"no KV slot for prompt tokens {lo}..{hi - 1} (context {ctx.n_ctx})")
    return calls


def run_request(
    model: NativeModel, ctx: NativeContext, batch: Batch, job: Job
) -> Generator[str, None, Response]:
    """Run ``job`` to completion, yielding each newly verified piece of text.

    The generator returns the Response. On cancellation (``job.cancel`` set,
    the generator closed, or KeyboardInterrupt) ``job.result`` holds a
    response with ``finish_reason="cancelled"``; the context's KV for ``seq``
    is then in an unknown state and the caller must discard or clear it.
    """
    request, prompt, seq = job.request, job.prompt_tokens, job.seq
    if not 0 <= job.n_cached < len(prompt):
        raise ValueError(f"n_cached must leave at least one prompt token to evaluate, got {job.n_cached}")
    sampler = None if request.greedy else Sampler(request.temperature, request.seed)
    assembler = TextAssembler(request.stop)
    tokens: list[int] = []
    measured = {
        "prompt_tokens": len(prompt),
        "evaluated_prompt_tokens": len(prompt) - job.n_cached,
        "generated_tokens": 0,
        "decode_calls": 0,
    }
    reason = "length"
    t_first = NOT_MEASURED
    t_work = _now()
    try:
        t0 = _now()
        _prefill(ctx, batch, prompt, job.n_cached, seq)
        logits_row = batch.n_tokens - 1
        measured["prompt_eval_duration"] = _now() - t0
        pos = len(prompt)
        while True:
            token = ctx.greedy(logits_row) if sampler is None else sampler.sample(ctx, logits_row)
            now = _now()
            measured["generated_tokens"] += 1
            if t_first == NOT_MEASURED:
                t_first = now
                measured["first_token_duration"] = now - t_work
            measured["decode_duration"] = now - t_first
            if model.is_eog(token):
                reason = "stop"
                break
            tokens.append(token)
            piece = assembler.feed(model.token_bytes(token))
            if piece:
                yield piece
            if assembler.stopped:
                reason = "stop"
                break
            if len(tokens) >= request.max_tokens:
                break
            if job.cancel.is_set():
                reason = "cancelled"
                break
            batch.clear()
            logits_row = batch.add(token, pos, seq, logits=True)
            measured["decode_calls"] += 1
            if ctx.decode(batch) == DECODE_NO_KV_SLOT:
                raise EngineError(f"no KV slot for position {pos} (context {ctx.n_ctx})")
            pos += 1
    except (GeneratorExit, KeyboardInterrupt):
        _finish(job, tokens, assembler.text, "cancelled", measured)
        raise
    finally:
        if sampler is not None:
            sampler.free()
    tail = assembler.finish()
    if tail:
        yield tail
    return _finish(job, tokens, assembler.text, reason, measured)
