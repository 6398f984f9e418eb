"""Embedding policy: which pooling, which inputs are allowed, and how inputs share decodes.

Plain Python, no model: :mod:`aner_nb.llm.embedder` runs what is decided
here on an embedding context (``_engine``). The rules:

* **Pooling.** ``pooling=None`` takes the model's own ``<arch>.pooling_type``
  when it declares mean, cls or last; a model that declares none (every
  generative model) is mean-pooled, what sentence-transformers and
  llama.cpp's embedding models use most. ``"none"`` (per-token vectors) and
  ``"rank"`` (a reranker's score) are not sentence embeddings and are refused.
* **Inputs.** A text is tokenized with the model's BOS and its special-token
  text kept as text (llama-cpp-python's ``Llama.embed`` does the same); a
  list of token ids is used as given. Empty inputs, ids outside the
  vocabulary, an input longer than the lease's context, more than
  :data:`MAX_INPUTS` inputs or more than :data:`MAX_TOTAL_TOKENS` tokens in
  all are refused before any native call, each naming the input.
* **Batching.** Consecutive inputs share one decode, one sequence id each,
  while their tokens fit the call's window; llama.cpp pools each sequence
  within one micro-batch, so the window is both the context's batch and
  micro-batch size and no input is ever split across two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import InvalidRequestError, UnsupportedFeatureError

__all__ = [
    "POOLINGS", "MAX_INPUTS", "MAX_TOTAL_TOKENS", "MAX_SEQUENCES", "PACKING_OUTPUT_BYTES", "EmbedInputs", "EmbedPlan",
    "declared_pooling", "resolve_pooling", "as_inputs", "check_token_ids", "plan", "normalized",
]

POOLINGS = ("mean", "cls", "last")  # what embed() pools with
_GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's enum llama_pooling_type
MAX_INPUTS = 2048  # inputs per call (OpenAI's bound for /v1/embeddings)
MAX_TOTAL_TOKENS = 65536  # tokens per call, all inputs together
MAX_SEQUENCES = 64  # inputs per decode (sequence ids of one embedding context)
# llama.cpp computes and keeps a logits row for every token of an embedding decode (the generative graph's
# output layer runs anyway): about n_vocab * 8 bytes per token (buffer and graph output). Short inputs are
# packed into a decode only while that stays under this; one long input still gets a window of its own.
PACKING_OUTPUT_BYTES = 256 * 2**20


def declared_pooling(value: str | None) -> str | None:
    """The pooling a GGUF declares (the ``<arch>.pooling_type`` value as text), or None when absent."""
    if value is None or not value.strip().lstrip("-").isdigit():
        return None
    return _GGUF_POOLING.get(int(value))


def resolve_pooling(requested: str | None, declared: str | None) -> str:
    """The pooling to use: ``requested`` (one of :data:`POOLINGS`), else the declared one, else mean."""
    if requested is None:
        if declared == "rank":
            raise UnsupportedFeatureError(
                "this model declares rank pooling (a reranker: it scores pairs and has no sentence embedding); "
                f"pass pooling= one of {', '.join(POOLINGS)} to embed with its hidden states anyway",
                param="pooling",
            )
        return declared if declared in POOLINGS else "mean"
    if not isinstance(requested, str) or requested not in POOLINGS:
        hint = " (per-token vectors are not a sentence embedding)" if requested == "none" else ""
        hint = " (a reranker's score is not an embedding)" if requested == "rank" else hint
        raise InvalidRequestError(
            f"pooling must be one of {', '.join(POOLINGS)} or None (the model's own), got {requested!r}{hint}",
            param="pooling",
        )
    return requested


@dataclass(frozen=True)
class EmbedInputs:
    """What a call asked to embed: each input as text or token ids, and whether one input came bare."""

    items: tuple["str | tuple[int, ...]", ...]
    single: bool  # a bare str (or one flat list of ids): the answer is one vector, not a matrix


def _is_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def as_inputs(texts: Any, *, param: str = "texts") -> EmbedInputs:
    """Check the shape of ``texts``: a str, a list of str, one list of token ids, or a list of them."""
    if isinstance(texts, str):
        if not texts:
            raise InvalidRequestError(f"{param} is an empty string: give text to embed", param=param)
        return EmbedInputs((texts,), single=True)
    if isinstance(texts, (list, tuple)) and texts and _is_ids(texts):
        return EmbedInputs((tuple(texts),), single=True)
    if not isinstance(texts, (list, tuple)):
        raise InvalidRequestError(
            f"{param} must be a str, a list of str, or token ids (a list of int, or a list of such lists); "
            f"got {type(texts).__name__}", param=param,
        )
    if not texts:
        raise InvalidRequestError(f"{param} is empty: give at least one input", param=param)
    if len(texts) > MAX_INPUTS:
        raise InvalidRequestError(f"{param} has {len(texts)} inputs; at most {MAX_INPUTS} per call", param=param)
    items: list[str | tuple[int, ...]] = []
    for i, item in enumerate(texts):
        if isinstance(item, str):
            items.append(item)
        elif _is_ids(item):
            items.append(tuple(item))
        else:
            raise InvalidRequestError(
                f"{param}[{i}] must be a str or a list of token ids (int), got {type(item).__name__}",
                param=f"{param}[{i}]",
            )
        if len(item) == 0:
            raise InvalidRequestError(f"{param}[{i}] is empty: every input needs text or tokens", param=f"{param}[{i}]")
    return EmbedInputs(tuple(items), single=False)


def check_token_ids(tokens: Sequence[int], n_vocab: int, *, param: str = "tokens") -> None:
    """Refuse ids outside ``0..n_vocab-1`` (llama.cpp would read past its tables) and non-integers."""
    for j, t in enumerate(tokens):
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= int(t) < n_vocab:
            raise InvalidRequestError(
                f"{param}[{j}] = {t!r} is not a token id of this model (integers 0..{n_vocab - 1})",
                param=f"{param}[{j}]",
            )


@dataclass(frozen=True)
class EmbedPlan:
    """How one call runs: the context window and the inputs of each decode (sequence id = place in its group)."""

    window: int  # n_ctx = n_batch = n_ubatch of the embedding context
    groups: tuple[tuple[int, ...], ...]  # input indices per decode, in order
    sequences: int  # n_seq_max of the embedding context
    total_tokens: int


def plan(
    lengths: Sequence[int], *, context: int, batch_tokens: int, n_vocab: int = 0, param: str = "texts"
) -> EmbedPlan:
    """Group consecutive inputs into decodes; refuse inputs longer than ``context`` and calls over the bounds.

    The window is at least the longest input and, when inputs are short, the
    lease's ``batch_tokens`` (so many short inputs share a decode) but never
    more than the call needs or the context allows, rounded up to a multiple
    of the sequences per decode. With ``n_vocab`` the packing window also
    keeps the engine's logits rows under :data:`PACKING_OUTPUT_BYTES`.
    """
    total = 0
    for i, n in enumerate(lengths):
        if n == 0:
            raise InvalidRequestError(f"{param}[{i}] has no tokens: give text to embed", param=f"{param}[{i}]")
        if n > context:
            raise InvalidRequestError(
                f"{param}[{i}] has {n} tokens; an input may have at most {context} (the lease's context): "
                "nothing is truncated, so shorten or split it",
                param=f"{param}[{i}]",
            )
        total += n
    if total > MAX_TOTAL_TOKENS:
        raise InvalidRequestError(
            f"{param} has {total} tokens in all; at most {MAX_TOTAL_TOKENS} per call: send fewer inputs per call",
            param=param,
        )
    if n_vocab:
        batch_tokens = min(batch_tokens, max(1, PACKING_OUTPUT_BYTES // (8 * n_vocab)))
    window = min(context, max(max(lengths), min(total, batch_tokens)))
    groups: list[tuple[int, ...]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and (used + n > window or len(current) >= MAX_SEQUENCES):
            groups.append(tuple(current))
            current, used = [], 0
        current.append(i)
        used += n
    groups.append(tuple(current))
    sequences = max(len(g) for g in groups)
    # llama.cpp reserves a pooling graph of window // n_seq_max tokens per sequence and asserts when that
    # drops tokens (mean pooling's matrix no longer matches): the window is a multiple of the sequences.
    window = -(-window // sequences) * sequences
    return EmbedPlan(window=window, groups=tuple(groups), sequences=sequences, total_tokens=total)


def normalized(vectors: np.ndarray) -> np.ndarray:
    """Each row scaled to unit Euclidean length (a zero row stays zero), as llama-cpp-python normalizes."""
    norms = np.linalg.norm(vectors.astype(np.float64), axis=-1, keepdims=True)
    return (vectors / np.where(norms == 0.0, 1.0, norms)).astype(np.float32)
