"""One request on one context: prefill, decode loop, text assembly and timings.

The runner is shared by every lease kind that gives a request a context of
its own (ordinary leases, optimizer leases, sessions). It is a generator of
verified text pieces whose return value is the final :class:`Response`, so
``generate`` drains it and ``stream`` hands it to the caller.

KV positions: the prompt occupies positions ``0..len(prompt)-1`` of sequence
``seq``; the first ``n_cached`` of them may already be in the KV (prefix
reuse). Logits are requested only for rows that are sampled: the last prompt
row during prefill and the single row of each decode step; a request with
``prompt_logprobs`` asks for every prompt row (in chunks whose logits stay
under :data:`PROMPT_LOGITS_BYTES`), and ``max_tokens=0`` then only scores it.

Logprobs (``logprobs=True``) are read from the row each token was chosen
from, before the next decode overwrites it: the prompt's last row, a decode
step's row, or each verified position's row of a speculative step.

A prompt restored whole from a stored entry (``Job.cached_logits``: the
prefix tiers keep a whole prompt with its last row's logits) evaluates
nothing: its KV holds every prompt position and the first token is chosen
from the stored row. ``Job.capture_logits`` asks for a copy of that row
after the prefill, for the tiers to store.
"""

from __future__ import annotations

import codecs
import threading
import time
from dataclasses import dataclass, field
from typing import Generator, Iterator, Sequence

import numpy as np

from ._engine import DECODE_NO_KV_SLOT, Batch, NativeContext, NativeModel, greedy_of
from .errors import EngineError
from .profiles import RequestSettings
from .response import Response, Usage
from .reuse import BLOCKED, MIN_ROWS, ReuseShape
from .timings import NOT_MEASURED, PoolTimings, RunTimings, SpeculativeTimings, Timings, TimingsPart
from .json_closing import JsonCloser
from .speculation import RequestDrafts, Speculator
from .output import OutputFormat
from .logprobs import Piece, TokenLogprob, token_logprob
from .sampling import new_sampler
from .text import TextAssembler

__all__ = [
    "Job", "SequenceOutput", "PrefillCancelled", "PROMPT_LOGITS_BYTES", "prefill", "prefill_scored", "run_request", "unstarted_response", "validate_only",
    "validated_response",
]

_now = time.perf_counter_ns
# Logits bytes one prompt-scoring chunk may ask for: llama.cpp's output buffer grows to the largest
# request and keeps that size, so a scored prompt is evaluated in chunks of at most this many bytes of logits.
PROMPT_LOGITS_BYTES = 32 * 2**20


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
    grammar: str | None = None  # GBNF the output must match (from the request's grammar or json_schema)
    output: OutputFormat = field(default_factory=OutputFormat)  # reasoning markers and tools to read from the text
    parts: list[TimingsPart] = field(default_factory=list)  # timings measured before and around the run
    result: Response | None = None
    started: bool = False  # run_request began; a job closed before that touched no KV
    # The last prompt row's logits from a stored entry: then n_cached == len(prompt_tokens), nothing is evaluated.
    cached_logits: "np.ndarray | None" = None
    capture_logits: bool = False  # keep a copy of the last prompt row's logits in prompt_logits (for the tiers)
    prompt_logits: "np.ndarray | None" = None

    def add(self, part: TimingsPart) -> None:
        """Record one producer's timings part (profile, pool, queue, batch...)."""
        self.parts.append(part)


@dataclass
class SpeculationCounts:
    """Prompt-lookup counters of one speculative run, updated as it verifies (mutable, one owner)."""

    proposed: int = 0
    accepted: int = 0
    verification_steps: int = 0


class SequenceOutput:
    """What one request has produced so far, and whether it is finished.

    Shared by every decoding strategy: the plain runner, prompt-lookup
    verification (several tokens per step) and the batching scheduler (one
    per sequence). ``accept`` takes each verified token in order and returns
    the text that became final; it stops at an end-of-generation token, a
    stop string, ``max_tokens`` or a cancellation. The counters below are
    what :class:`RunTimings` reports; the strategies add to them.
    """

    def __init__(self, model: NativeModel | None, job: Job) -> None:
        self.model = model  # None only for validate_only, which accepts no token
        self.job = job
        self.tokens: list[int] = []
        self.assembler = TextAssembler(job.request.stop)
        self.finished = False
        self.reason = "length"
        self.evaluated_prompt_tokens = len(job.prompt_tokens) - job.n_cached
        self.generated_tokens = 0
        self.decode_calls = 0
        self.prompt_eval_duration = NOT_MEASURED
        self.first_token_duration = NOT_MEASURED
        self.decode_duration = NOT_MEASURED
        self.speculation: SpeculationCounts | None = None  # speculative runs only
        self.t_work = _now()
        self.t_first = NOT_MEASURED
        # logprobs=True: one entry per accepted token; those not yet sent with a piece wait in _unsent.
        self.logprobs: list[TokenLogprob] | None = [] if job.request.logprobs else None
        self._unsent: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        # json_schema: the answer is followed so that, when max_tokens nears, it ends in valid JSON.
        schema = job.request.json_schema
        self._closer = JsonCloser(schema) if schema is not None and model is not None else None
        self._closing = self._closer.closing() if self._closer is not None else None  # fits the budget?
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._forced: list[int] = []  # the closing's token ids, once it is written
        self.closed_early = False

    def score(self, ctx: NativeContext, row: int, token: int) -> TokenLogprob | None:
        """The logprob entry of ``token`` chosen from logits ``row``; None when the request did not ask."""
        return self.score_row(ctx.logits(row), token) if self.logprobs is not None else None

    def score_row(self, logits: np.ndarray, token: int) -> TokenLogprob | None:
        """:meth:`score` from a logits row itself."""
        if self.logprobs is None:
            return None
        assert self.model is not None
        return token_logprob(logits, token, self.job.request.top_logprobs, self.model.token_bytes)

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> str:
        """Record one verified token (and its logprob entry); returns newly final text (possibly empty).

        With logprobs the text is a :class:`~aner_nb.llm.logprobs.Piece` carrying the entries of the
        tokens accepted since the last piece.
        """
        if self.finished:
            raise RuntimeError("accept() after the sequence finished")
        now = _now()
        self.generated_tokens += 1
        if self.t_first == NOT_MEASURED:
            self.t_first = now
            # From the call, so waiting in a queue counts (queue_duration still says how much).
            self.first_token_duration = now - self.job.t_call
        else:  # a one-token answer had no timed decode: decode_duration stays -1
            self.decode_duration = now - self.t_first
        assert self.model is not None
        if self.model.is_eog(token):
            return self._stop("stop")
        if self._closer is not None and self._close_instead(token):
            return self._closed()
        self.tokens.append(token)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
            self._unsent.append(logprob)
        piece = self._carry(self.assembler.feed(self.model.token_bytes(token)))
        if self.assembler.stopped:
            self._stop("stop")
        elif len(self.tokens) >= self.job.request.max_tokens:
            self._stop("length")
        elif self.job.cancel.is_set():
            self._stop("cancelled")
        return piece

    def _fits(self, text: str, room: int) -> bool:
        """Whether ``text`` takes at most ``room`` tokens (a token is at least one byte: count bytes first)."""
        assert self.model is not None
        return len(text.encode()) <= room or len(self.model.tokenize(text, parse_special=False)) <= room

    def _close_instead(self, token: int) -> bool:
        """Follow ``token`` in the JSON answer; True when its closing would no longer fit after it.

        Invariant: ``_closing`` (the closing of the text before ``token``) fits the tokens left before
        ``token``, so writing it instead always ends the answer validly within ``max_tokens``.
        """
        assert self._closer is not None and self.model is not None
        before = self._closing
        room_before = self.job.request.max_tokens - len(self.tokens)
        text = self._utf8.decode(self.model.token_bytes(token))
        self._closer.feed(text)
        after = self._closer.closing()
        if after is not None and self._utf8.getstate()[0]:
            after = None  # half a UTF-8 character is pending: no closing can follow it yet
        if after is not None and self._fits(after, room_before - 1):
            self._closing = after
            return False
        if before is not None and after is not None:
            ids = self._closing_ids(before)
            if ids is not None and len(ids) <= room_before:
                self._forced = ids
                return True
        self._closing = None  # no closing is known from here (a pattern string begun): cut as before
        return False

    def _closing_ids(self, text: str) -> list[int] | None:
        """Token ids whose bytes are exactly ``text`` (a tokenizer that adds a space prefix is tokenized
        one character at a time instead); None when no such ids are found."""
        assert self.model is not None
        want = text.encode()
        for ids in (self.model.tokenize(text, parse_special=False),
                    [t for ch in text for t in self.model.tokenize(ch, parse_special=False)]):
            if b"".join(self.model.token_bytes(t) for t in ids) == want:
                return ids
        return None

    def _closed(self) -> str:
        """Write the closing instead of the token that would leave no room for it; the answer ends here."""
        assert self.model is not None
        ids = self._forced
        pieces = [self.assembler.feed(self.model.token_bytes(t)) for t in ids]
        self.tokens.extend(ids)
        self.generated_tokens += len(ids) - 1  # the replaced token was counted already
        self.closed_early = True
        self._stop("length")
        return self._carry("".join(pieces))

    def _stop(self, reason: str) -> str:
        self.finished, self.reason = True, reason
        return ""

    def _carry(self, piece: str) -> str:
        """``piece`` with the logprobs not yet sent (a plain str without logprobs, or when empty)."""
        if not piece or not self._unsent:
            return piece
        carried, self._unsent = Piece(piece, self._unsent), []
        return carried

    def tail(self) -> str:
        """Text held back for a possible stop string, released at the end."""
        return self._carry(self.assembler.finish())

    def run_timings(self) -> RunTimings:
        return RunTimings(
            prompt_tokens=len(self.job.prompt_tokens),
            evaluated_prompt_tokens=self.evaluated_prompt_tokens,
            generated_tokens=self.generated_tokens,
            decode_calls=self.decode_calls,
            prompt_eval_duration=self.prompt_eval_duration,
            first_token_duration=self.first_token_duration,
            decode_duration=self.decode_duration,
            total_duration=_now() - self.job.t_call,
        )

    def response(self, reason: str | None = None) -> Response:
        """Build (and record on the job) the final Response."""
        job = self.job
        split = job.output.split(self.assembler.text)  # the content without reasoning or call markup
        parts = list(job.parts)
        if self.speculation is not None:
            c = self.speculation
            parts.append(SpeculativeTimings(c.proposed, c.accepted, c.verification_steps))
        timings = Timings.assemble(*parts, self.run_timings())  # the total is taken last: the response is ready
        response = Response(
            text=split.content,
            reasoning=split.reasoning,
            tool_calls=split.tool_calls,
            tokens=tuple(self.tokens),
            finish_reason=reason or self.reason,
            usage=Usage(
                prompt_tokens=len(job.prompt_tokens),
                cached_input_tokens=timings.cached_input_tokens,
                completion_tokens=len(self.tokens),
            ),
            timings=timings,
            model=job.model_name,
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else tuple(self.prompt_logprobs),
            closed_early=self.closed_early,
        )
        job.result = response
        return response


def validated_response(job: Job) -> Response:
    """``max_tokens=0``: the request was validated; nothing touches a context or the KV."""
    out = SequenceOutput(None, job)
    out.evaluated_prompt_tokens = 0
    job.add(PoolTimings(cached_input_tokens=0))  # exactly none: no context was acquired
    return out.response("length")


def unstarted_response(job: Job) -> Response:
    """The cancelled Response of a request whose run never started (cancelled while it waited); no KV touched."""
    out = SequenceOutput(None, job)
    out.evaluated_prompt_tokens = 0
    return out.response("cancelled")


def validate_only(job: Job) -> Generator[str, None, Response]:
    """:func:`validated_response` as a generator with no pieces, like :func:`run_request`."""
    return validated_response(job)
    yield  # pragma: no cover - makes this a generator


class PrefillCancelled(Exception):
    """The request was cancelled before its prompt was fully evaluated (``evaluated`` tokens were)."""

    def __init__(self, evaluated: int) -> None:
        super().__init__(f"cancelled after {evaluated} prompt tokens")
        self.evaluated = evaluated


def prefill_chunks(
    start: int, end: int, n_batch: int, n_ubatch: int, *, reuse: ReuseShape | None = None
) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` position ranges of a prefill's llama_decode calls, shaped for exact reuse (:mod:`.reuse`).

    ``reuse`` (a context serving a prefix cache, its model's shape): the
    prompt's tail, from ``reuse.reuse_limit(end)``, is a call of its own; without
    it the shape is ``reuse.BLOCKED`` and the tail stays in the last micro-batch. llama.cpp splits each call into micro-batches of ``n_ubatch`` rows from
    the call's start (``n_ubatch`` clamped to ``n_batch``). Before the tail,
    every micro-batch but the last has the shape's ``micro_batch_rows``,
    whole row blocks (one per call when that is not ``n_ubatch`` itself), and
    a last one under ``MIN_ROWS`` rows takes whole row blocks from the one
    before. Only a body too short to lend from keeps
    a small micro-batch.
    """
    shape = reuse or BLOCKED
    tail = max(start, min(end, shape.reuse_limit(end))) if reuse is not None else end
    return [*_body_chunks(start, tail, n_batch, n_ubatch, shape), *([(tail, end)] if end > tail else [])]


def _body_chunks(start: int, end: int, n_batch: int, n_ubatch: int, shape: ReuseShape) -> list[tuple[int, int]]:
    if end <= start:
        return []
    ub = max(1, min(n_ubatch, n_batch))
    step = shape.micro_batch_rows(ub)
    bounds = [*range(start, end, step), end]  # micro-batch boundaries
    short = end - bounds[-2]
    if len(bounds) > 2 and 0 < short < MIN_ROWS:
        lend = -(-(MIN_ROWS - short) // shape.row_block) * shape.row_block
        if bounds[-2] - lend - bounds[-3] >= MIN_ROWS:
            bounds[-2] -= lend
    per_call = max(1, n_batch // ub) if step == ub else 1
    chunks: list[tuple[int, int]] = []
    i = 0
    while i < len(bounds) - 1:
        k = i + 1
        # whole micro-batches share a call; a shorter one must be its call's last (llama.cpp splits from the start)
        while k < min(i + per_call, len(bounds) - 1) and bounds[k] - bounds[k - 1] == ub:
            k += 1
        chunks.append((bounds[i], bounds[k]))
        i = k
    return chunks


def prefill(
    ctx: NativeContext, batch: Batch, tokens: Sequence[int], start: int, seq: int,
    *, cancel: threading.Event | None = None,
) -> int:
    """Evaluate ``tokens[start:]`` at positions ``start..``; logits only for the last row.

    Returns the number of llama_decode calls, made over :func:`prefill_chunks`
    (at most ``n_batch`` tokens each). ``cancel`` is checked before every
    chunk, so a long prompt stops within one chunk of a cancellation
    (:class:`PrefillCancelled`).
    """
    calls = 0
    chunks = prefill_chunks(start, len(tokens), batch.capacity, ctx.params.n_ubatch, reuse=ctx.params.prefix_reuse)
    for lo, hi in chunks:
        if cancel is not None and cancel.is_set():
            raise PrefillCancelled(lo - start)
        batch.clear()
        batch.add_run(tokens[lo:hi], lo, seq, logits_last=hi == len(tokens))
        calls += 1
        if ctx.decode(batch) == DECODE_NO_KV_SLOT:
            raise EngineError(f"no KV slot for prompt tokens {lo}..{hi - 1} (context {ctx.n_ctx})")
    return calls


def prefill_scored(
    ctx: NativeContext, batch: Batch, tokens: Sequence[int], seq: int, out: SequenceOutput,
    *, cancel: threading.Event | None = None,
) -> int:
    """Evaluate the whole prompt from position 0 with logits on every row, recording its logprobs in ``out``.

    Position ``p``'s entry comes from the row of position ``p - 1`` (the
    first token has none: ``None``); the last row's logits stay for the
    first sampled token. Chunks are at most ``n_batch`` rows and at most
    :data:`PROMPT_LOGITS_BYTES` of logits. Returns the llama_decode calls.
    """
    model = out.model
    assert model is not None
    k = out.job.request.top_logprobs
    rows = max(1, min(batch.capacity, PROMPT_LOGITS_BYTES // (4 * model.n_vocab)))
    entries: list[TokenLogprob | None] = [None]
    calls = 0
    for lo in range(0, len(tokens), rows):
        if cancel is not None and cancel.is_set():
            raise PrefillCancelled(lo)
        hi = min(lo + rows, len(tokens))
        batch.clear()
        batch.add_run(tokens[lo:hi], lo, seq, all_outputs=True)
        calls += 1
        if ctx.decode(batch) == DECODE_NO_KV_SLOT:
            raise EngineError(f"no KV slot for prompt tokens {lo}..{hi - 1} (context {ctx.n_ctx})")
        for i in range(hi - lo):
            if lo + i + 1 < len(tokens):
                entries.append(token_logprob(ctx.logits(i), tokens[lo + i + 1], k, model.token_bytes))
    out.prompt_logprobs = entries
    return calls


def run_request(
    model: NativeModel, ctx: NativeContext, batch: Batch, job: Job, *, speculator: Speculator | None = None
) -> Generator[str, None, Response]:
    """Run ``job`` to completion, yielding each newly verified piece of text.

    With a ``speculator`` (greedy only), each step evaluates the pending
    token plus the prompt-lookup proposals its policy finds worth their
    rows (up to ``speculator.maximum``) in one batch and keeps the proposals
    the model agrees with (see :func:`verify_drafts`); a completed request adds
    its prompt and answer to the lease's corpus.

    The generator returns the Response. On cancellation (``job.cancel`` set,
    the generator closed, or KeyboardInterrupt) ``job.result`` holds a
    response with ``finish_reason="cancelled"``; the context's KV for ``seq``
    is then in an unknown state and the caller must discard or clear it.
    ``job.cancel`` is checked before every prefill chunk and after every
    verified token, so a cancelled long prompt stops within one chunk.
    """
    job.started = True
    request, prompt = job.request, job.prompt_tokens
    whole = job.cached_logits is not None
    if whole and job.n_cached != len(prompt):
        raise ValueError(f"stored last-row logits serve a whole cached prompt only, got {job.n_cached} of {len(prompt)}")
    if not whole and not 0 <= job.n_cached < len(prompt):
        raise ValueError(f"n_cached must leave at least one prompt token to evaluate, got {job.n_cached}")
    if request.prompt_logprobs and job.n_cached:
        raise ValueError("prompt_logprobs scores the whole prompt: nothing of it may come from a cache")
    if speculator is not None and not request.plain_argmax:
        raise ValueError("prompt-lookup speculation verifies plain greedy choices only")
    sampler = new_sampler(model, request, job.grammar, prompt)
    out = SequenceOutput(model, job)
    drafts_of = speculator.start(prompt) if speculator is not None else None
    if drafts_of is not None:
        out.speculation = SpeculationCounts()
    try:
        if whole:
            first = job.cached_logits
            assert first is not None
            out.prompt_eval_duration = 0  # every prompt position came from the stored entry
        elif not _evaluate_prompt(ctx, batch, job, out):
            return out.response("cancelled")
        else:
            row = batch.n_tokens - 1
            first = ctx.logits(row)  # a view: the next decode overwrites it
        if job.capture_logits:  # the tiers store it (a restored row is stored already: found, not a shorter one)
            job.prompt_logits = first if whole else first.copy()
        if request.max_tokens == 0:  # prompt_logprobs: the prompt was scored, nothing is generated
            return out.response("length")
        if sampler is None:
            verified = [greedy_of(first)]
        else:  # llama.cpp's own sampling of a context's row, or the same chain over the stored row
            verified = [sampler.sample_row(first) if whole else sampler.sample(ctx, row)]
        scores = [out.score_row(first, verified[0])]
        pos = len(prompt)  # KV position of ``verified[-1]``, which is sampled but not yet evaluated
        while True:
            yield from _accept(out, verified, scores)
            if out.finished:
                break
            if drafts_of is not None:
                drafts_of.extend(verified)
            drafts = _drafts(ctx, out, drafts_of, pos)
            _decode(ctx, batch, out, verified[-1], pos, drafts)
            if drafts:
                verified = verify_drafts(ctx, drafts)
                scores = [out.score(ctx, i, token) for i, token in enumerate(verified)]  # row i chose token i
                pos = keep_accepted(ctx, out, drafts_of, pos, drafts, len(verified) - 1)
            else:
                verified = [ctx.greedy(0) if sampler is None else sampler.sample(ctx, 0)]
                scores = [out.score(ctx, 0, verified[0])]
                pos += 1
    except (GeneratorExit, KeyboardInterrupt):
        out.response("cancelled")
        raise
    finally:
        if sampler is not None:
            sampler.free()
    if drafts_of is not None:
        drafts_of.finish(out.tokens)
    tail = out.tail()
    if tail:
        yield tail
    return out.response()


def _evaluate_prompt(ctx: NativeContext, batch: Batch, job: Job, out: SequenceOutput) -> bool:
    """Prefill the uncached prompt, timed into ``out``; False when it was cancelled before the end."""
    t0 = _now()
    try:
        if job.request.prompt_logprobs:
            prefill_scored(ctx, batch, job.prompt_tokens, job.seq, out, cancel=job.cancel)
        else:
            prefill(ctx, batch, job.prompt_tokens, job.n_cached, job.seq, cancel=job.cancel)
    except PrefillCancelled as stopped:  # cancelled before (or while) its prompt was evaluated
        out.prompt_eval_duration = _now() - t0
        out.evaluated_prompt_tokens = stopped.evaluated
        return False
    out.prompt_eval_duration = _now() - t0
    return True


def _accept(
    out: SequenceOutput, verified: Sequence[int], scores: Sequence[TokenLogprob | None]
) -> Iterator[str]:
    """Accept the verified tokens (with their logprob entries) in order, yielding their text, until the end."""
    for token, score in zip(verified, scores):
        piece = out.accept(token, score)
        if piece:
            yield piece
        if out.finished:
            return


def _drafts(ctx: NativeContext, out: SequenceOutput, drafts_of: RequestDrafts | None, pos: int) -> list[int]:
    """The prompt-lookup proposals to verify after the token at ``pos`` (none without speculation)."""
    if drafts_of is None:
        return []
    return drafts_of.propose(min(out.job.request.max_tokens - len(out.tokens), ctx.n_ctx - pos) - 1)


def _decode(
    ctx: NativeContext, batch: Batch, out: SequenceOutput, token: int, pos: int, drafts: Sequence[int]
) -> None:
    """Evaluate the pending ``token`` at ``pos`` and the ``drafts`` after it, logits on every row."""
    seq = out.job.seq
    batch.clear()
    batch.add(token, pos, seq, logits=True)
    for i, draft in enumerate(drafts):
        batch.add(draft, pos + 1 + i, seq, logits=True)
    out.decode_calls += 1
    if ctx.decode(batch) == DECODE_NO_KV_SLOT:
        raise EngineError(f"no KV slot for positions {pos}..{pos + len(drafts)} (context {ctx.n_ctx})")


def keep_accepted(
    ctx: NativeContext, out: SequenceOutput, drafts_of: RequestDrafts | None, pos: int, drafts: Sequence[int],
    accepted: int,
) -> int:
    """Count ``accepted`` of ``drafts`` verified after the token at ``pos``, drop the rejected rows' KV
    (in the job's sequence); returns the next pending position. Shared with the batching scheduler."""
    drafts_of.record(len(drafts), accepted)  # type: ignore[union-attr]
    counts = out.speculation
    assert counts is not None
    counts.proposed += len(drafts)
    counts.accepted += accepted
    counts.verification_steps += 1
    if accepted < len(drafts) and not ctx.seq_rm(out.job.seq, pos + 1 + accepted, -1):
        raise EngineError(f"could not remove rejected proposals at positions {pos + 1 + accepted}..")
    # Rejected rows leave no trace: the KV ends at the last verified position.
    return pos + 1 + accepted


def verify_drafts(ctx: NativeContext, drafts: Sequence[int], first: int = 0) -> list[int]:
    """Greedy verification of the rows ``[pending, d0, d1, ...]`` starting at batch row ``first`` (logits on each).

    Row ``first + i`` holds the model's choice after ``d0..d(i-1)``. Proposals are kept
    while they equal that choice; the first disagreement is replaced by the
    model's own token (the correction), and if all agree the last row yields
    one more token. Returns the verified tokens: accepted proposals plus that
    final token, exactly what plain greedy decoding would produce.
    """
    verified = []
    for i, draft in enumerate(drafts):
        choice = ctx.greedy(first + i)
        verified.append(choice)
        if choice != draft:
            return verified
    verified.append(ctx.greedy(first + len(drafts)))
    return verified

