"""Why two greedy outputs differ: replay plain greedy decoding and look at the logits.

Batch shape changes the order of floating-point sums, so a prefix-cached,
speculative or batched request can flip a near-tied greedy choice relative
to plain decoding. ``first_divergence`` replays plain greedy decoding (prompt
in one prefill, then one token per decode call, as an ordinary lease does)
along the common prefix of two outputs and reports the top-2 logit gap at the
first position where they differ. To judge the gap it also evaluates the same
tokens with a different batch shape (prompt and prefix in one prefill) and
measures how far the logits move: a flip between the top two tokens needs a
relative shift of at least ``gap``, and two logits can shift apart by up to
twice the largest movement, so ``near_tie`` means ``gap <= 2 * perturbation``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ._engine import DECODE_NO_KV_SLOT, Batch, NativeContext
from .errors import EngineError
from .lease import LLMModel, _as_messages, context_params
from .runner import prefill

__all__ = ["Divergence", "first_divergence"]


@dataclass(frozen=True)
class Divergence:
    """First differing position of outputs ``a`` and ``b`` and the logits there (None if equal)."""

    position: int | None
    token_a: int | None = None
    token_b: int | None = None
    logit_a: float | None = None
    logit_b: float | None = None
    top1: int | None = None
    top2: int | None = None
    gap: float | None = None  # logit(top1) - logit(top2) in the plain replay
    perturbation: float | None = None  # max |logit change| when the same tokens are batched differently
    near_tie: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_divergence(
    model: LLMModel,
    prompt: "str | Sequence[Mapping[str, Any]]",
    a: Sequence[int],
    b: Sequence[int],
) -> Divergence:
    """Replay plain greedy decoding of ``prompt`` along ``a`` up to where ``a`` and ``b`` differ."""
    a, b = list(a), list(b)
    n = min(len(a), len(b))
    position = next((i for i in range(n) if a[i] != b[i]), None)
    if position is None:
        if len(a) == len(b):
            return Divergence(None)
        position = n  # one output stopped earlier (end of generation or a stop string)
    prompt_tokens = model.prompt_tokens(_as_messages(prompt))
    plain = _logits_after(model, prompt_tokens, a[:position], one_batch=False)
    batched = _logits_after(model, prompt_tokens, a[:position], one_batch=True)
    perturbation = float(np.max(np.abs(plain - batched)))
    logits = plain
    order = np.argsort(logits)[::-1][:2]
    top1, top2 = int(order[0]), int(order[1])
    gap = float(logits[top1] - logits[top2])
    token_a = a[position] if position < len(a) else None
    token_b = b[position] if position < len(b) else None
    return Divergence(
        position=position,
        token_a=token_a,
        token_b=token_b,
        logit_a=None if token_a is None else float(logits[token_a]),
        logit_b=None if token_b is None else float(logits[token_b]),
        top1=top1,
        top2=top2,
        gap=gap,
        perturbation=perturbation,
        near_tie=gap <= 2 * perturbation,
    )


def _logits_after(model: LLMModel, prompt: Sequence[int], continuation: Sequence[int], *, one_batch: bool) -> np.ndarray:
    """Logits after ``prompt + continuation`` on a fresh context of the model's ordinary shape.

    ``one_batch=False`` replays plain decoding: the prompt in prefill chunks,
    then one token per decode call. ``one_batch=True`` evaluates everything
    as one prefill, the shape a cached or verified request would use.
    """
    weights = model._weights
    params = context_params(weights, model.profile)
    ctx = NativeContext(weights.native, params)
    batch = Batch(params.n_batch)
    try:
        tokens = list(prompt) + list(continuation) if one_batch else list(prompt)
        prefill(ctx, batch, tokens, 0, 0)
        row = batch.n_tokens - 1
        if not one_batch:
            pos = len(prompt)
            for token in continuation:
                batch.clear()
                row = batch.add(token, pos, 0, logits=True)
                if ctx.decode(batch) == DECODE_NO_KV_SLOT:
                    raise EngineError("no KV slot while replaying")
                pos += 1
        return np.array(ctx.logits(row), copy=True)
    finally:
        ctx.free()
        batch.free()

