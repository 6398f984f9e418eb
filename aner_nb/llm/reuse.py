"""How much of a prompt may come from cached KV, and with which attention kernel reuse is exact.

Every cache of evaluated prompts (a latency lease's prefix pool and its RAM
/ disk tiers, a batching lease's shared prefixes) asks :func:`reuse_limit`
and :func:`restore_point`; a lease that reuses prefix KV builds its contexts
with :func:`reuse_attention` and prefills over ``runner.prefill_chunks``.
Together they are engine facts turned into plain rules, so a cached
request's logits equal the uncached run's bit for bit.
"""

from __future__ import annotations

__all__ = [
    "ROW_BLOCK", "MIN_ROWS", "reuse_limit", "restore_point", "retained_rows", "conversation_keep", "micro_batch_rows",
    "reuse_attention",
]

# Engine facts (llama.cpp's CPU matrix kernels, ggml-cpu; measured bitwise on the logits of SmolLM2
# Q4_1 and Gemma 3 Q4_K_M on an AVX-512 Zen 4 CPU, flash attention off: benchmarks/check_reuse_shapes.py,
# RESULTS.md "exact prefix reuse"). A row's values depend on which kernel multiplied it, not on the
# micro-batch around it otherwise, and the kernel depends on the row's place in its micro-batch:
# - weights repacked for the CPU (repack.cpp, e.g. Gemma's Q4_K as q4_K_8x8) are multiplied by gemm for
#   the micro-batch's rows in blocks of ROW_BLOCK and by gemv for its last ``size % ROW_BLOCK`` rows;
# - K-quant weights left as they are (tiled/tiled.cpp, e.g. Gemma's Q6_K) take a tiled kernel for a
#   micro-batch of MIN_ROWS rows or more and the dot-product kernel below that (SmolLM2 also differs
#   after a one-row micro-batch).
# So every prefill starts on a multiple of ROW_BLOCK, its micro-batches but the last are multiples of
# ROW_BLOCK, and its last has at least MIN_ROWS rows (runner.prefill_chunks). Then only the prompt's last
# ``len % ROW_BLOCK`` rows are gemv rows, whichever cached part a request started from, and a cached row
# was computed by the kernel the uncached run of any later prompt computes it with.
ROW_BLOCK = 4
MIN_ROWS = 8


def _floor(n: int) -> int:
    return n - n % ROW_BLOCK


def reuse_limit(prompt_len: int) -> int:
    """Most prompt tokens a request may take from cached KV: a multiple of :data:`ROW_BLOCK` leaving at least
    :data:`MIN_ROWS` to evaluate (which also gives the last row's logits)."""
    return max(0, _floor(prompt_len - MIN_ROWS))


def restore_point(common: int, prompt_len: int) -> int:
    """Where a prompt sharing ``common`` leading tokens with cached KV starts evaluating (the tokens kept)."""
    return _floor(max(0, min(common, reuse_limit(prompt_len))))


def retained_rows(keep: int, prompt_len: int) -> int:
    """Of ``keep`` leading tokens of an evaluated prompt, how many a later prompt may reuse.

    The prompt's last ``prompt_len % ROW_BLOCK`` rows came from the gemv
    kernel, where a longer prompt computes them by gemm, so the kept part ends
    on a multiple of :data:`ROW_BLOCK`; a prompt of fewer than :data:`MIN_ROWS`
    tokens ran in one small micro-batch, by other kernels, and keeps nothing.
    """
    return _floor(max(0, min(keep, prompt_len))) if prompt_len >= MIN_ROWS else 0


def conversation_keep(common: int, prompt_len: int) -> int:
    """What a session keeps of its own KV for the next turn: the common prefix, leaving one token to evaluate.

    A conversation's KV holds its answers, decoded one row at a time, so no
    turn equals an uncached run of the whole conversation anyway; what a
    session must equal is the same session uninterrupted, and the same rule on
    both sides gives that. Keeping everything also lets a restored
    sliding-window state continue without a trim it could not make.
    """
    return max(0, min(common, prompt_len - 1))


def micro_batch_rows(n_ubatch: int) -> int:
    """The micro-batch a prefill uses under llama.cpp's ``n_ubatch``: a multiple of :data:`ROW_BLOCK`."""
    return _floor(n_ubatch) if n_ubatch >= 2 * MIN_ROWS else n_ubatch


def reuse_attention(requested: str, *, kv_cache_type: str, on_cpu: bool) -> str:
    """The flash-attention setting of a lease that reuses prefix KV: ``auto`` becomes ``off`` on a CPU.

    Engine fact (llama.cpp's CPU flash-attention kernel, ``ggml-cpu/ops.cpp``):
    a micro-batch of 64 or more query rows takes a tiled path, a smaller one a
    row-by-row path, and the two round differently. A cached prefix was
    evaluated inside an earlier, longer request, so its last rows sat in a
    micro-batch of another size than in the uncached run of this prompt, and
    reuse was exact only when the restore point fell on the uncached run's
    micro-batch start. Without flash attention the rules above make reuse
    bitwise exact; a request the cache cannot serve pays for it (measured on
    the demo models: 12-20% more prompt time than a plain lease, RESULTS.md,
    ``bench_prefix.py --miss-cost``). An explicit ``on`` is kept
    (reuse is then exact only up to near ties, see ``diagnostics``); a
    quantized KV cache needs flash attention, and GPU kernels are another
    matter, so both keep what was asked.
    """
    if requested == "auto" and on_cpu and kv_cache_type == "f16":
        return "off"
    return requested
