"""Why two greedy outputs differ: replay plain greedy decoding and judge the emitted tokens.

Batch shape changes the order of floating-point sums, so a speculative or
batched request can flip a near-tied greedy choice relative to plain
decoding (a prefix-cached one too when its kernels are not the ones
``reuse`` makes exact: flash attention asked for explicitly, a GPU). ``first_divergence`` replays plain greedy decoding of
output ``a`` (prompt in one prefill, then one token per decode call, as an
ordinary lease does) up to the first position where ``b`` differs, and reads
the logits of the two *emitted* tokens there. It then evaluates the same
tokens in the batch shape side ``b`` used (:class:`BatchShape`: one prefill,
a verification batch, or a multi-sequence step) and measures how far the
logits move. Two logits can shift apart by at most twice the largest
movement, so a flip from ``token_a`` to ``token_b`` is explained by the
batch shape only if ``logit(token_a) - logit(token_b) <= 2 * perturbation``.
A token that plain decoding ranks far below is not a near tie, however close
the top two happen to be.

At most one divergence per output is excused. After the first position the
two outputs follow different histories, so ``b`` is not compared with ``a``
there: the rest of ``b`` is replayed with plain greedy decoding of ``b``'s
own tokens (the prompt in one prefill, then one token per decode call), and
every further token of ``b`` must be the plain greedy choice after its own
history. The first position where it is not is ``later_position``, and the
output is not excused however close that second flip is. ``near_tie`` is
True only when the first divergence passes the rule above and there is no
``later_position``. (Where ``b`` stops is not judged after the first
divergence: its length may be set by ``max_tokens``.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np

from ._engine import DECODE_NO_KV_SLOT, Batch, NativeContext
from .draft_policy import MAX_SPECULATIVE_TOKENS
from .errors import EngineError
from .lease import LLMModel
from .requests import as_messages, context_params
from .runner import prefill

__all__ = ["BatchShape", "Divergence", "first_divergence", "is_near_tie"]


@dataclass(frozen=True)
class BatchShape:
    """How side ``b`` evaluated the token whose logits chose the differing token.

    - ``prefill``: prompt and output so far in prefill chunks (a prefix-cached
      or otherwise re-evaluated prompt). ``cached`` is how many prompt tokens
      ``b`` took from a prefix cache (its response's ``cached_input_tokens``):
      they were evaluated by an earlier request and ``b`` prefilled only the
      tail, in chunks that start at ``cached``, then decoded as plain decoding
      does; that path is measured too.
    - ``verification``: a prompt-lookup step of ``size`` rows (the pending
      token plus ``size - 1`` proposals); the deciding row may be any of them,
      so every offset is measured and the largest movement kept.
    - ``sequences``: a continuous-batching step with ``size`` sequences, one
      logits row each; every row index is measured.
    """

    kind: str
    size: int = 1
    cached: int = 0  # prefill only: prompt tokens b took from a prefix cache

    def __post_init__(self) -> None:
        if self.kind not in ("prefill", "verification", "sequences"):
            raise ValueError(f"BatchShape kind must be prefill, verification or sequences, got {self.kind!r}")
        if not 1 <= self.size <= MAX_SPECULATIVE_TOKENS + 1:  # a verification batch: pending token + proposals
            raise ValueError(f"BatchShape size must be 1..{MAX_SPECULATIVE_TOKENS + 1}, got {self.size}")
        if self.cached < 0 or (self.cached and self.kind != "prefill"):
            raise ValueError(f"BatchShape cached applies to a prefill shape and is >= 0, got {self.cached}")

    def check_fits(self, batch_tokens: int) -> None:
        if self.size > batch_tokens:
            raise ValueError(f"BatchShape size {self.size} exceeds the lease's batch_tokens={batch_tokens}")

    @classmethod
    def prefill(cls, cached: int = 0) -> "BatchShape":
        return cls("prefill", cached=cached)

    @classmethod
    def verification(cls, speculative_tokens: int) -> "BatchShape":
        return cls("verification", speculative_tokens + 1)

    @classmethod
    def sequences(cls, max_sequences: int) -> "BatchShape":
        return cls("sequences", max_sequences)


def is_near_tie(logit_a: float, logit_b: float, perturbation: float) -> bool:
    """The rule: plain decoding prefers ``token_a`` by at most twice the measured movement."""
    return logit_a - logit_b <= 2 * perturbation


@dataclass(frozen=True)
class Divergence:
    """First differing position of outputs ``a`` (plain greedy) and ``b``, judged (None if equal)."""

    position: int | None
    token_a: int | None = None
    token_b: int | None = None  # the model's end-of-generation token when ``b`` stopped here
    logit_a: float | None = None  # in the plain replay
    logit_b: float | None = None
    rank_b: int | None = None  # 1 = plain decoding's first choice
    gap: float | None = None  # logit_a - logit_b
    top1: int | None = None
    top2: int | None = None
    perturbation: float | None = None  # max |logit change| in the shape ``b`` used
    shape: str | None = None
    # First position after ``position`` where ``b`` is not plain greedy decoding of its own history
    # (a second divergence: never excused); None when there is none or ``b`` ends at ``position``.
    later_position: int | None = None
    near_tie: bool | None = None  # the first divergence is a near tie and there is no second one

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_divergence(
    model: LLMModel,
    prompt: "str | Sequence[Mapping[str, Any]]",
    a: Sequence[int],
    b: Sequence[int],
    *,
    shape: BatchShape,
) -> Divergence:
    """Judge where ``b`` first leaves ``a`` (plain greedy output of ``prompt`` on ``model``)."""
    a, b = list(a), list(b)
    n = min(len(a), len(b))
    position = next((i for i in range(n) if a[i] != b[i]), None)
    if position is None:
        if len(a) == len(b):
            return Divergence(None, shape=shape.kind)
        position = n  # one output stopped earlier (end of generation or a stop string)
    eos = model._weights.native.eos
    token_a = a[position] if position < len(a) else eos
    token_b = b[position] if position < len(b) else eos
    prompt_tokens = model.prompt_tokens(as_messages(prompt))
    plain, perturbation = _measure(model, prompt_tokens, a[:position], shape)
    order = np.argsort(plain)[::-1]
    logit_a, logit_b = float(plain[token_a]), float(plain[token_b])
    first_excused = is_near_tie(logit_a, logit_b, perturbation)
    later = None
    if first_excused and position < len(b) - 1:  # b goes on after its first divergence: judge the rest
        later = _leaves_plain_greedy(model, prompt_tokens, b, position + 1)
    return Divergence(
        position=position,
        token_a=token_a,
        token_b=token_b,
        logit_a=logit_a,
        logit_b=logit_b,
        rank_b=int(np.count_nonzero(plain > plain[token_b])) + 1,
        gap=logit_a - logit_b,
        top1=int(order[0]),
        top2=int(order[1]),
        perturbation=perturbation,
        shape=f"prefill(cached={shape.cached})" if shape.cached else f"{shape.kind}({shape.size})",
        later_position=later,
        near_tie=first_excused and later is None,
    )


def _leaves_plain_greedy(model: LLMModel, prompt: Sequence[int], b: Sequence[int], start: int) -> int | None:
    """The first position ``>= start`` where ``b[i]`` is not the plain greedy choice after
    ``prompt + b[:i]`` (an ordinary lease's shape: one prefill, then one token per decode), or None."""
    weights = model._weights
    params = context_params(weights, model.profile)

    def judge(ctx: NativeContext, batch: Batch) -> int | None:
        _plain_replay(ctx, batch, prompt, b[:start])  # logits after b[start - 1] in the last row
        pos, row = len(prompt) + start, batch.n_tokens - 1
        for i in range(start, len(b)):
            if ctx.greedy(row) != b[i]:
                return i
            batch.clear()
            row = batch.add(b[i], pos, 0, logits=True)
            _decode(ctx, batch)
            pos += 1
        return None

    return _in_context(weights, params, judge)


def _measure(
    model: LLMModel, prompt: Sequence[int], continuation: Sequence[int], shape: BatchShape
) -> tuple[np.ndarray, float]:
    """Plain-replay logits after ``prompt + continuation`` and the largest movement under ``shape``."""
    weights = model._weights
    ordinary = context_params(weights, model.profile)
    shape.check_fits(ordinary.n_batch)
    plain = _in_context(weights, ordinary, lambda ctx, batch: _plain_replay(ctx, batch, prompt, continuation))
    tokens = list(prompt) + list(continuation)
    if shape.kind == "prefill":
        # A latency-profile context (full SWA cache), the prompt and output so far as prefill chunks.
        def measure(ctx: NativeContext, batch: Batch) -> float:
            prefill(ctx, batch, tokens, 0, 0)
            return _movement(plain, ctx.logits(batch.n_tokens - 1))

        def measure_split(ctx: NativeContext, batch: Batch) -> float:
            return _movement(plain, _plain_replay(ctx, batch, prompt, continuation, shape.cached))

        latency = replace(ordinary, swa_full=True, prefix_reuse=weights.reuse_shape)  # a prefix-cache lease's context
        moved = _in_context(weights, latency, measure)
        if 0 < shape.cached < len(prompt):
            moved = max(moved, _in_context(weights, latency, measure_split))
        return plain, moved
    if shape.kind == "verification":
        # The deciding row ``row`` of a step that started ``row`` tokens earlier; the rows after it
        # hold proposals (their values do not matter for the shape: the last token stands in).
        def measure(ctx: NativeContext, batch: Batch) -> float:
            _plain_replay(ctx, batch, prompt, continuation)
            moved, end = 0.0, len(tokens)
            for row in range(min(shape.size, len(continuation))):
                start = end - 1 - row
                if not ctx.seq_rm(0, start, -1):
                    raise EngineError(f"could not remove positions {start}.. while measuring")
                batch.clear()
                window = tokens[start:end] + tokens[-1:] * (shape.size - row - 1)
                for i, token in enumerate(window):
                    batch.add(token, start + i, 0, logits=True)
                _decode(ctx, batch)
                moved = max(moved, _movement(plain, ctx.logits(row)))
            return moved

        return plain, _in_context(weights, replace(ordinary, swa_full=True), measure)

    # sequences: the batching lease's context (one KV stream per sequence). The whole history of
    # the judged sequence is replayed as a batched request sees it: its prompt prefilled in the
    # same llama_decode as the other sequences' prompts, then every token in a step that carries
    # one row of each other sequence. Measured with the judged rows first and last in each batch.
    def measure(ctx: NativeContext, batch: Batch, first: bool) -> float:
        others = list(range(1, shape.size))
        filler = list(prompt)[: max(1, min(len(prompt), (batch.capacity - len(prompt)) // max(len(others), 1)))]
        rows = _batched_replay(ctx, batch, prompt, continuation, others, filler, first)
        return _movement(plain, ctx.logits(rows))

    params = replace(ordinary, n_seq_max=shape.size, kv_unified=False)
    return plain, max(
        _in_context(weights, params, lambda ctx, batch, f=f: measure(ctx, batch, f)) for f in (True, False)
    )


def _batched_replay(
    ctx: NativeContext, batch: Batch, prompt: Sequence[int], continuation: Sequence[int],
    others: Sequence[int], filler: Sequence[int], first: bool,
) -> int:
    """Sequence 0 sharing every llama_decode with ``others``; returns the batch row of its last logits."""
    pending = {seq: list(filler) for seq in others}
    pos = {seq: 0 for seq in others}
    row = -1
    for lo in range(0, len(prompt), batch.capacity):  # prompt chunks, the others' prompts alongside
        chunk = list(prompt)[lo : lo + batch.capacity]
        last_chunk = lo + batch.capacity >= len(prompt)
        batch.clear()
        if not first:
            _add_others(batch, pending, pos, batch.capacity - len(chunk))
        row = batch.add_run(chunk, lo, 0, logits_last=last_chunk)
        if first:
            _add_others(batch, pending, pos, batch.capacity - batch.n_tokens)
        _decode(ctx, batch)
    at = len(prompt)
    for token in continuation:
        batch.clear()
        if not first:
            _add_others(batch, pending, pos, len(others), one_each=True)
        row = batch.add(token, at, 0, logits=True)
        if first:
            _add_others(batch, pending, pos, len(others), one_each=True)
        _decode(ctx, batch)
        at += 1
    return row


def _add_others(batch: Batch, pending: dict, pos: dict, room: int, *, one_each: bool = False) -> None:
    """The other sequences' rows: the rest of their prompts, or one decode row each (with logits)."""
    for seq, tokens in pending.items():
        take = 1 if one_each else min(len(tokens), room // max(len(pending), 1))
        for _ in range(take):
            token = tokens.pop(0) if tokens else 0
            batch.add(token, pos[seq], seq, logits=one_each)
            pos[seq] += 1


def _in_context(weights: Any, params: Any, work: Any) -> Any:
    """Run ``work(ctx, batch)`` on a fresh context with ``params``; always frees both."""
    ctx = NativeContext(weights.native, params)
    # The lease's own chunk size, so the plain replay prefills exactly as the lease does.
    batch = Batch(params.n_batch, params.n_seq_max)
    try:
        return work(ctx, batch)
    finally:
        ctx.free()
        batch.free()


def _plain_replay(
    ctx: NativeContext, batch: Batch, prompt: Sequence[int], continuation: Sequence[int], cached: int = 0
) -> np.ndarray:
    """The prompt in prefill chunks, then one token per decode call: an ordinary lease's shape.

    With ``cached``, a prefix-cached request's path: ``prompt[:cached]`` prefilled (by the earlier
    request), then the tail in chunks from position ``cached``."""
    if cached:
        prefill(ctx, batch, list(prompt[:cached]), 0, 0)
    prefill(ctx, batch, list(prompt), cached, 0)
    row = batch.n_tokens - 1
    pos = len(prompt)
    for token in continuation:
        batch.clear()
        row = batch.add(token, pos, 0, logits=True)
        _decode(ctx, batch)
        pos += 1
    return np.array(ctx.logits(row), copy=True)


def _decode(ctx: NativeContext, batch: Batch) -> None:
    if ctx.decode(batch) == DECODE_NO_KV_SLOT:
        raise EngineError("no KV slot while replaying")


def _movement(plain: np.ndarray, other: np.ndarray) -> float:
    return float(np.max(np.abs(plain - np.asarray(other))))
