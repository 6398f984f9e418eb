"""Running ``model.embed()``: tokenize, plan (:mod:`aner_nb.llm.embeddings`), decode, pool, free.

One call creates one embedding context (``embeddings=True`` with the chosen
pooling) sized to its plan, decodes each group of inputs as sequences
``0..k-1`` of one batch, reads every sequence's pooled vector
(``llama_get_embeddings_seq``), clears the KV and moves on; the context and
batch are freed when the call ends, whatever happened. The call holds the
weights for its duration, so closing the lease meanwhile cannot free them
under it. Embedding contexts are separate from the lease's request contexts,
so no generation KV is touched.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from ._engine import Batch, NativeContext
from .embeddings import as_inputs, check_token_ids, declared_pooling, normalized, plan, resolve_pooling
from .errors import EngineError, InvalidRequestError
from .valid_text import check_text

if TYPE_CHECKING:
    from ._engine import ContextParams, NativeModel
    from .weights import SharedWeights

__all__ = ["embed", "model_pooling", "embed_tokens", "text_tokens"]


def model_pooling(native: "NativeModel", architecture: str) -> str | None:
    """The pooling the GGUF declares (``<arch>.pooling_type``), or None."""
    return declared_pooling(native.meta(f"{architecture}.pooling_type"))


def text_tokens(native: "NativeModel", text: str) -> list[int]:
    """An embedding input's tokens: the model's BOS plus the text, special-token text kept as text."""
    return native.tokenize(text, add_special=True, parse_special=False)


def embed(
    weights: "SharedWeights", params: "ContextParams", texts: Any, *, pooling: str | None, normalize: bool,
    context: int, param: str = "texts",
) -> tuple[np.ndarray, int]:
    """``(vectors, prompt tokens)`` for ``texts``: float32, ``(n, n_embd)``, or ``(n_embd,)`` for one bare input."""
    if not isinstance(normalize, bool):
        raise InvalidRequestError(f"normalize must be True or False, got {normalize!r}", param="normalize")
    native = weights.native
    chosen = resolve_pooling(pooling, model_pooling(native, weights.facts.architecture))
    inputs = as_inputs(texts, param=param)
    tokens: list[list[int]] = []
    for i, item in enumerate(inputs.items):
        if isinstance(item, str):
            check_text(item, f"{param}[{i}]" if not inputs.single else param)
            tokens.append(text_tokens(native, item))
        else:
            check_token_ids(item, native.n_vocab, param=f"{param}[{i}]" if not inputs.single else param)
            tokens.append(list(item))
    vectors = embed_tokens(native, params, tokens, pooling=chosen, context=context, param=param)
    if normalize:
        vectors = normalized(vectors)
    total = sum(len(t) for t in tokens)
    return (vectors[0] if inputs.single else vectors), total


def embed_tokens(
    native: "NativeModel", params: "ContextParams", tokens: list[list[int]], *, pooling: str, context: int,
    param: str = "texts",
) -> np.ndarray:
    """The pooled (not normalized) embeddings of token lists, one row each, on a fresh embedding context."""
    layout = plan([len(t) for t in tokens], context=context, batch_tokens=params.n_batch, n_vocab=native.n_vocab,
                  param=param)
    embedding_params = dataclasses.replace(
        params, n_ctx=layout.window, n_batch=layout.window, n_ubatch=layout.window, n_seq_max=layout.sequences,
        kv_unified=True, swa_full=False, embeddings=True, pooling=pooling,
    )
    out = np.empty((len(tokens), native.n_embd), dtype=np.float32)
    ctx = NativeContext(native, embedding_params)
    try:
        batch = Batch(layout.window, 1)
        try:
            for group in layout.groups:
                batch.clear()
                for seq, index in enumerate(group):
                    batch.add_run(tokens[index], 0, seq, all_outputs=True)
                if ctx.decode(batch) != 0:
                    raise EngineError(f"no KV room for an embedding batch of {batch.n_tokens} tokens")
                for seq, index in enumerate(group):
                    out[index] = ctx.pooled_embedding(seq)
                ctx.clear()
        finally:
            batch.free()
    finally:
        ctx.free()
    return out
