"""KV-cache arithmetic: pure functions over plain numbers.

Rows of K and V are stored per layer and per KV head; quantized types pack
32 elements into a block (q8_0: 32 int8 + one f16 scale = 34 bytes; q4_0:
16 bytes of nibbles + one f16 scale = 18 bytes), so a row of ``head_dim``
elements costs ``head_dim / 32`` blocks and ``head_dim`` must be a multiple
of 32 for those types.
"""

from __future__ import annotations

from .errors import ConfigurationError

__all__ = ["KV_CACHE_TYPES", "kv_row_bytes", "kv_estimate"]

# type -> (elements per block, bytes per block)
_BLOCKS = {"f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}
KV_CACHE_TYPES = tuple(_BLOCKS)


def _positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def kv_row_bytes(head_dim: int, kv_cache_type: str = "f16") -> int:
    """Bytes of one K or V row of ``head_dim`` elements stored as ``kv_cache_type``."""
    head_dim = _positive_int("head_dim", head_dim)
    try:
        per_block, block_bytes = _BLOCKS[kv_cache_type]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_cache_type!r}"
        ) from None
    if head_dim % per_block:
        raise ConfigurationError(
            f"head_dim {head_dim} is not a multiple of the {kv_cache_type} block size {per_block}"
        )
    return head_dim // per_block * block_bytes


def kv_estimate(
    context: int,
    layers: int,
    kv_heads: int,
    head_dim_k: int,
    head_dim_v: int,
    kv_cache_type: str = "f16",
) -> int:
    """KV bytes for ``context`` cells: context x layers x kv_heads x (K row + V row)."""
    context = _positive_int("context", context)
    layers = _positive_int("layers", layers)
    kv_heads = _positive_int("kv_heads", kv_heads)
    row = kv_row_bytes(head_dim_k, kv_cache_type) + kv_row_bytes(head_dim_v, kv_cache_type)
    return context * layers * kv_heads * row
