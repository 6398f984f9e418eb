"""KV-cache arithmetic: pure functions over plain numbers, following llama.cpp's allocation.

Rows of K and V are stored per layer and per KV head; quantized types pack
32 elements into a block (q8_0: 32 int8 + one f16 scale = 34 bytes; q4_0:
16 bytes of nibbles + one f16 scale = 18 bytes), so a row of ``head_dim``
elements costs ``head_dim / 32`` blocks and ``head_dim`` must be a multiple
of 32 for those types.

How many cells llama.cpp allocates (the pinned llama-cpp-python 0.3.36,
``llama-context.cpp`` and ``llama-kv-cache-iswa.cpp``):

* the context is padded up to a multiple of 256 cells;
* a unified cache (``kv_unified``) is one stream of that many cells shared by
  every sequence; a per-sequence cache has ``n_seq`` streams of
  ``pad256(n_ctx // n_seq)`` cells each;
* a model with sliding-window layers gets two caches: its full-attention
  layers take the cells above, its sliding-window layers take
  ``pad256(min(cells, window x (n_seq if unified else 1) + n_ubatch))`` per
  stream, or the full size with ``swa_full``; ``n_ubatch`` is
  ``min(n_ubatch, n_batch, n_ctx)`` as llama.cpp clamps it.

:func:`kv_caches` returns that allocation cache by cache; :func:`kv_estimate`
its total in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .errors import ConfigurationError

__all__ = [
    "KV_CACHE_TYPES",
    "KV_CELL_PADDING",
    "KVCache",
    "kv_row_bytes",
    "kv_cells",
    "kv_caches",
    "kv_estimate",
    "kv_caches_for",
    "sliding_window_layers",
]

# type -> (elements per block, bytes per block)
_BLOCKS = {"f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}
KV_CACHE_TYPES = tuple(_BLOCKS)
KV_CELL_PADDING = 256  # llama.cpp pads n_ctx, n_ctx_seq and the SWA cache to this many cells


def _positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an integer >= {minimum}, got {value!r}", param=name)
    return value


def _pad(n: int) -> int:
    return -(-n // KV_CELL_PADDING) * KV_CELL_PADDING


def kv_row_bytes(head_dim: int, kv_cache_type: str = "f16") -> int:
    """Bytes of one K or V row of ``head_dim`` elements stored as ``kv_cache_type``."""
    head_dim = _positive_int("head_dim", head_dim)
    try:
        per_block, block_bytes = _BLOCKS[kv_cache_type]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_cache_type!r}",
            param="kv_cache_type",
        ) from None
    if head_dim % per_block:
        raise ConfigurationError(
            f"head_dim {head_dim} is not a multiple of the {kv_cache_type} block size {per_block}",
            param="head_dim",
        )
    return head_dim // per_block * block_bytes


def kv_cells(context: int, n_seq: int = 1, *, unified: bool = True) -> tuple[int, int]:
    """``(cells per stream, streams)`` llama.cpp allocates for the full-attention layers."""
    context = _positive_int("context", context)
    n_seq = _positive_int("n_seq", n_seq)
    n_ctx = _pad(context)
    if unified:
        return n_ctx, 1
    per_seq = _pad(n_ctx // n_seq)
    if per_seq == 0:  # llama.cpp: "n_ctx_seq == 0"
        raise ConfigurationError(
            f"context {context} is smaller than n_seq {n_seq}: each sequence needs at least one cell", param="context"
        )
    return per_seq, n_seq


@dataclass(frozen=True)
class KVCache:
    """One KV cache as llama.cpp allocates it: ``streams`` x ``cells`` cells on ``layers`` layers."""

    kind: str  # "full" (full-attention layers) or "sliding-window"
    cells: int  # per stream
    streams: int  # 1 for a unified cache, n_seq for per-sequence streams
    layers: int
    k_bytes: int
    v_bytes: int

    @property
    def bytes(self) -> int:
        return self.k_bytes + self.v_bytes


def sliding_window_layers(layers: int, sliding_window: int, pattern: "int | Sequence[bool]") -> tuple[int, ...]:
    """Indices of the layers llama.cpp runs with the sliding window (``llama_hparams::set_swa_pattern``).

    ``pattern`` is ``{arch}.attention.sliding_window_pattern``: a list of
    per-layer flags, or ``n`` meaning every ``n``-th layer is full attention
    (layer ``il`` slides when ``il % n < n - 1``; 0: every layer slides).
    No window, no sliding layers.
    """
    if sliding_window <= 0:
        return ()
    if not isinstance(pattern, int):
        flags = list(pattern)
        return tuple(il for il in range(layers) if il < len(flags) and flags[il])
    return tuple(il for il in range(layers) if pattern == 0 or il % pattern < pattern - 1)


def kv_caches(
    context: int,
    layers: int,
    kv_heads: "int | Sequence[int]",
    head_dim_k: int,
    head_dim_v: int,
    kv_cache_type: str = "f16",
    *,
    sliding_window: int = 0,
    swa_layers: Sequence[int] = (),
    n_seq: int = 1,
    unified: bool = True,
    n_batch: int = 512,
    n_ubatch: int = 512,
    swa_full: bool = False,
    v_trans: bool = False,
) -> tuple[KVCache, ...]:
    """The KV caches llama.cpp allocates for a context: one, or a full and a sliding-window one.

    ``kv_heads`` is one count for every layer or one per layer (GGUF allows
    a per-layer ``head_count_kv``); ``swa_layers`` the indices of the
    sliding-window layers (:func:`sliding_window_layers`), used only when
    ``sliding_window > 0``. ``n_seq``/``unified``/``n_batch``/``n_ubatch``/
    ``swa_full`` are the context's parameters (``n_seq_max``, ``kv_unified``...).
    ``v_trans`` (flash attention off) stores V transposed, every layer as wide
    as the widest when the per-layer head counts differ.
    """
    layers = _positive_int("layers", layers)
    heads = [kv_heads] * layers if isinstance(kv_heads, int) else list(kv_heads)
    if len(heads) != layers:
        raise ConfigurationError(f"kv_heads has {len(heads)} per-layer values for {layers} layers", param="kv_heads")
    for h in heads:
        _positive_int("kv_heads", h)
    row_k, row_v = kv_row_bytes(head_dim_k, kv_cache_type), kv_row_bytes(head_dim_v, kv_cache_type)
    cells, streams = kv_cells(context, n_seq, unified=unified)
    sliding = set(swa_layers) if sliding_window > 0 else set()
    if any(not 0 <= il < layers for il in sliding):
        raise ConfigurationError(f"swa_layers must be layer indices below {layers}", param="swa_layers")

    def cache(kind: str, n_cells: int, members: list[int]) -> KVCache:
        n_heads = sum(heads[il] for il in members)
        v_heads = max(heads) * len(members) if v_trans else n_heads
        return KVCache(kind, n_cells, streams, len(members), n_cells * streams * n_heads * row_k,
                       n_cells * streams * v_heads * row_v)

    full = [il for il in range(layers) if il not in sliding]
    if not sliding:
        return (cache("full", cells, full),)
    ubatch = min(_positive_int("n_ubatch", n_ubatch), _positive_int("n_batch", n_batch), context)
    swa_cells = cells if swa_full else _pad(min(cells, sliding_window * (n_seq if unified else 1) + ubatch))
    return (cache("full", cells, full), cache("sliding-window", swa_cells, sorted(sliding)))


def kv_estimate(
    context: int,
    layers: int,
    kv_heads: "int | Sequence[int]",
    head_dim_k: int,
    head_dim_v: int,
    kv_cache_type: str = "f16",
    **options: Any,
) -> int:
    """KV bytes llama.cpp allocates for a context: the sum of :func:`kv_caches` (same arguments).

    Without options: one unified stream of ``pad256(context)`` cells on every
    layer, i.e. cells x layers x kv_heads x (K row + V row).
    """
    return sum(c.bytes for c in kv_caches(context, layers, kv_heads, head_dim_k, head_dim_v, kv_cache_type, **options))


def kv_caches_for(facts: Any, params: Any) -> tuple[KVCache, ...]:
    """:func:`kv_caches` of a model's facts (``ModelFacts``) and a context's parameters (``ContextParams``)."""
    heads = getattr(facts, "kv_heads_per_layer", ()) or facts.kv_heads
    return kv_caches(
        params.n_ctx, facts.layers, heads, facts.head_dim_k, facts.head_dim_v, params.kv_cache_type,
        sliding_window=facts.sliding_window, swa_layers=getattr(facts, "swa_layers", ()),
        n_seq=params.n_seq_max, unified=params.kv_unified, n_batch=params.n_batch, n_ubatch=params.n_ubatch,
        swa_full=params.swa_full, v_trans=params.flash_attention == "off",
    )
