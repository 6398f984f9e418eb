"""Token log probabilities: the pure math over one logits row, and the frozen records a Response carries.

A token's logprob is the log-softmax of the model's raw logits row at the
position that chose it, taken before any sampling stage (``logit_bias``,
penalties, grammar, top-k/p, temperature): OpenAI's definition, and what
llama-cpp-python's ``Llama(logits_all=True)`` gives. The normalizer is a
float64 log-sum-exp over the float32 row (numerically stable: the maximum is
subtracted first); the top-k alternatives come from ``argpartition`` (O(n))
and are then sorted, most likely first. Nothing here is computed unless a
request asks for logprobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["TokenLogprob", "Piece", "log_normalizer", "top_tokens", "token_logprob", "pieces_logprobs"]


@dataclass(frozen=True)
class TokenLogprob:
    """One token, its log probability, and (for a chosen token) the most likely alternatives at its position.

    ``piece`` is the token's raw bytes (possibly an incomplete UTF-8
    sequence); ``top`` is sorted most likely first and holds entries without
    alternatives of their own.
    """

    token: int
    piece: bytes
    logprob: float
    top: tuple["TokenLogprob", ...] = ()

    @property
    def text(self) -> str:
        """The piece as text (an incomplete UTF-8 sequence shows replacement characters)."""
        return self.piece.decode("utf-8", "replace")

    @property
    def probability(self) -> float:
        return math.exp(self.logprob)


class Piece(str):
    """A streamed text piece that also carries the logprobs of the tokens that became final with it.

    It is a ``str`` (every consumer of a stream's pieces keeps working);
    ``logprobs`` holds the entries of the tokens accepted since the previous
    piece (a token whose text was held back for a stop string travels with
    the next piece).
    """

    logprobs: tuple[TokenLogprob, ...]

    def __new__(cls, text: str, logprobs: Sequence[TokenLogprob] = ()) -> "Piece":
        piece = super().__new__(cls, text)
        piece.logprobs = tuple(logprobs)
        return piece


def log_normalizer(row: np.ndarray) -> float:
    """``log(sum(exp(row)))`` in float64, stable for any finite row (its maximum is subtracted first)."""
    values = np.asarray(row, dtype=np.float64)
    peak = float(values.max())
    return peak + math.log(float(np.exp(values - peak).sum()))


def top_tokens(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest logits, largest first (ties in id order)."""
    n = row.shape[0]
    k = min(max(k, 0), n)
    if k == 0:
        return np.empty(0, dtype=np.int64)
    ids = np.argpartition(-row, k - 1)[:k] if k < n else np.arange(n)
    order = np.lexsort((ids, -row[ids].astype(np.float64)))
    return ids[order]


def token_logprob(
    row: np.ndarray, token: int, k: int, piece: Callable[[int], bytes], *, normalizer: float | None = None
) -> TokenLogprob:
    """The entry of ``token`` chosen from ``row``, with its ``k`` most likely alternatives.

    ``piece`` gives a token id's bytes; ``normalizer`` (from
    :func:`log_normalizer`) may be passed when it is already known.
    """
    lse = log_normalizer(row) if normalizer is None else normalizer
    top = tuple(
        TokenLogprob(int(t), piece(int(t)), float(row[t]) - lse) for t in top_tokens(row, k)
    )
    return TokenLogprob(int(token), piece(int(token)), float(row[token]) - lse, top)


def pieces_logprobs(pieces: Sequence[str]) -> tuple[TokenLogprob, ...]:
    """The logprobs a sequence of streamed pieces carried, in order (plain strings carry none)."""
    out: list[TokenLogprob] = []
    for p in pieces:
        out.extend(getattr(p, "logprobs", ()))
    return tuple(out)
