"""How much of a prompt may come from cached KV, and with which attention kernel reuse is exact.

Every cache of evaluated prompts (a latency lease's prefix pool and its RAM
/ disk tiers, a batching lease's shared prefixes) asks a :class:`ReuseShape`
where a prompt may start (the model's own, :func:`reuse_shape`, on a latency
lease; :data:`BLOCKED`, the module-level functions, elsewhere); a lease that
reuses prefix KV builds its contexts with :func:`reuse_attention` and the
shape, and prefills over ``runner.prefill_chunks``.
Together they are engine facts turned into plain rules, so a cached
request's logits equal the uncached run's bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "ROW_BLOCK", "MIN_ROWS", "TAIL_ROWS", "ROW_LOCAL_TYPES", "ReuseShape", "BLOCKED", "RAGGED", "ROW_LOCAL", "reuse_shape",
    "softmax_lanes", "for_restored_windows",
    "reuse_limit", "restore_point", "retained_rows", "conversation_keep", "micro_batch_rows",
    "reuse_attention",
]

# Engine facts (llama.cpp's CPU matrix kernels, ggml-cpu; measured bitwise on the logits of SmolLM2
# Q4_1 and Gemma 3 Q4_K_M on an AVX-512 Zen 4 CPU, flash attention off: benchmarks/check_reuse_shapes.py,
# RESULTS.md "exact prefix reuse"). A row's values depend on which kernel multiplied it, not on the
# micro-batch around it otherwise, and the kernel depends on the row's place in its micro-batch:
# - weights repacked for the CPU (repack.cpp, e.g. Gemma's Q4_K as q4_K_8x8) are multiplied by gemm for
#   the micro-batch's rows in blocks of ROW_BLOCK and by gemv for its last ``size % ROW_BLOCK`` rows;
# - K-quant weights left as they are (tiled/tiled.cpp, e.g. Gemma's Q6_K) take a tiled kernel for a
#   micro-batch of MIN_ROWS rows or more and the dot-product kernel below that; llamafile's tinyBLAS
#   (sgemm.cpp) declines a one-row product (SmolLM2 differs after a one-row micro-batch).
# So a prompt's *body* (everything but its tail, below) is evaluated in micro-batches that start on a
# multiple of the shape's row block, hold whole row blocks and at least MIN_ROWS rows
# (runner.prefill_chunks): every body row is a gemm row of a large micro-batch, whichever cached part a
# request started from. The prompt's *tail*, its last ``len - reuse_limit(len)`` rows (TAIL_ROWS to
# TAIL_ROWS + row_block - 1), is always its own micro-batch, in the uncached run too: a request repeating
# a cached prompt evaluates that same micro-batch over the same KV, so it equals the uncached run without
# re-evaluating MIN_ROWS rows (RESULTS.md: 1 row on SmolLM2, 1-8 on Gemma with AVX2, for_restored_windows,
# against llama-server's 1).
# The micro-batch the tail costs a request the cache cannot serve is one more pass over the weights.
# Each tail row costs a pass over the repacked weights too (gemv: 3.7 ms a row on Gemma at 2 threads,
# AVX2), so on x86 a body may end inside a row block (RAGGED): the rows after its last whole block are
# the gemv rows at the end of its last micro-batch, in the uncached run as in any restored one, and serve
# only a prompt whose body ends in that same block; the tail is then its last row alone.
ROW_BLOCK = 4
MIN_ROWS = 8
TAIL_ROWS = 1  # the fewest prompt rows a request evaluates: the last one gives the first token's logits

# Weight types whose CPU product computes a row alike wherever it sits in a micro-batch of MIN_ROWS rows or
# more, on an x86 build without AMX: dot products (vec_dot) or llamafile's tinyBLAS, neither repacked
# (repack.cpp repacks Q4_0, Q4_K, IQ4_NL, MXFP4 and, with AVX-512, Q2_K) nor tiled (tiled/tiled.cpp: the
# K-quants and IQ types). A model made only of these needs no row block (SmolLM2 Q4_1 measured exact at
# restore points off a row block, RESULTS.md).
ROW_LOCAL_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_1", "Q5_0", "Q5_1"})


ROW_BLOCKS = (1, ROW_BLOCK, 8, 16)  # 8 and 16: a sliding-window model's restored states (for_restored_windows)


@dataclass(frozen=True)
class ReuseShape:
    """Where a prompt may start evaluating over cached KV, for one model's kernels on this build.

    ``row_block``: restore points and body micro-batches are whole blocks of
    this many rows (:data:`ROW_BLOCK` where weights are repacked or tiled, 1
    where every weight type is row-local). ``ragged_body``: a body may end
    inside a row block, its rows after the last whole block reusable only by a
    prompt whose body ends in the same block; the tail is then always
    :data:`TAIL_ROWS` tokens (without it, :data:`TAIL_ROWS` to ``TAIL_ROWS + row_block - 1``).
    """

    row_block: int = ROW_BLOCK
    ragged_body: bool = False

    def __post_init__(self) -> None:
        if self.row_block not in ROW_BLOCKS:
            raise ValueError(f"row_block must be one of {ROW_BLOCKS}, got {self.row_block}")

    def floor(self, n: int) -> int:
        return n - n % self.row_block

    def reuse_limit(self, prompt_len: int) -> int:
        """Where a prompt's tail starts (its body's end): the most prompt tokens a request may take from cached KV.

        0 for a prompt whose body would be shorter than :data:`MIN_ROWS` (its
        rows ran in one small micro-batch).
        """
        body = max(0, prompt_len - TAIL_ROWS)
        limit = body if self.ragged_body else self.floor(body)
        return limit if limit >= MIN_ROWS else 0

    def restore_point(self, common: int, prompt_len: int, stored: int | None = None) -> int:
        """Where a prompt sharing ``common`` leading tokens with a cached entry of ``stored`` tokens starts evaluating.

        The whole body when it is cached, else a row block at least
        :data:`MIN_ROWS` before the tail, so what is left of the body is one or
        more large micro-batches (see the engine facts above). On a ragged
        shape the whole body comes from an entry only when the body ends on a
        row block or the entry's body ends in the same block (``stored``; None:
        unknown, so it does not).
        """
        limit = self.reuse_limit(prompt_len)
        if self.ragged_body and limit % self.row_block:
            same_end = stored is not None and self.floor(stored) == self.floor(limit)
            if common >= limit and same_end:
                return limit
            return self.floor(max(0, min(common, limit - MIN_ROWS)))
        keep = self.floor(max(0, min(common, limit)))
        return keep if keep == limit else min(keep, max(0, limit - MIN_ROWS))

    def retained_rows(self, keep: int, prompt_len: int) -> int:
        """Of ``keep`` leading tokens of an evaluated prompt, how many a later prompt may reuse.

        Only body rows: the tail ran in its own small micro-batch, where a
        longer prompt computes those rows inside its body. A ragged body is
        kept whole (its last rows serve a prompt whose body ends in the same
        block, :meth:`restore_point`) or cut to a row block.
        """
        limit = self.reuse_limit(prompt_len)
        if self.ragged_body and keep >= limit:
            return limit
        return self.floor(max(0, min(keep, limit)))

    def micro_batch_rows(self, n_ubatch: int) -> int:
        """The micro-batch a prefill uses under llama.cpp's ``n_ubatch``: whole row blocks."""
        return self.floor(n_ubatch) if n_ubatch >= 2 * MIN_ROWS else n_ubatch


BLOCKED = ReuseShape(ROW_BLOCK)  # every model; the module-level rules below are this shape's
RAGGED = ReuseShape(ROW_BLOCK, ragged_body=True)  # repacked or tiled weights on an x86 CPU build without AMX
ROW_LOCAL = ReuseShape(1)


def reuse_shape(tensor_types: Iterable[str], *, build_flags: Iterable[str], machine: str, on_cpu: bool) -> ReuseShape:
    """The shape of a model's weights on this build: :data:`ROW_LOCAL` or :data:`RAGGED` only where every fact above was read.

    That is an x86 CPU build without AMX (AMX kernels tile other types their
    own way): :data:`ROW_LOCAL` for weights all of :data:`ROW_LOCAL_TYPES`,
    else :data:`RAGGED` (repack.cpp's gemm/gemv split); anything else, a GPU
    included, gets :data:`BLOCKED`.
    """
    x86 = machine.lower() in ("x86_64", "amd64")
    if on_cpu and x86 and "AMX_INT8" not in set(build_flags):
        return ROW_LOCAL if set(tensor_types) <= ROW_LOCAL_TYPES else RAGGED
    return BLOCKED


def softmax_lanes(build_flags: Iterable[str], *, machine: str, on_cpu: bool) -> int:
    """How many attention scores the CPU's softmax sums per vector (``ggml_vec_soft_max_f32``): 8 with AVX2,
    16 with AVX-512, and 16 where it was not read (another architecture, a GPU)."""
    flags = set(build_flags)
    if on_cpu and machine.lower() in ("x86_64", "amd64"):
        if "AVX512" in flags or "AVX512F" in flags:
            return 16
        if "AVX2" in flags:
            return 8
    return 16


def for_restored_windows(shape: ReuseShape, lanes: int) -> ReuseShape:
    """The shape of a sliding-window model whose prefixes are restored from saved states (RAM / disk tiers).

    Engine fact (llama.cpp's per-sequence state, ``llama-kv-cache.cpp``; measured on Gemma 3 with AVX2,
    ``tests/test_reuse.py``): a saved state keeps only the sliding-window cells its last position still
    sees, and a load puts them in the context's first cells, so after a restore of ``n`` positions the
    window layers hold position ``p`` in cell ``p - (n - n_swa)``, not ``p``. The softmax over a row of
    cells sums ``lanes`` scores per vector from cell 0, so a restored request rounds as the uncached run
    only where ``n - n_swa`` is a multiple of ``lanes``: with ``n_swa`` a multiple of it too (Gemma: 512),
    where ``n`` is. So every restore point, and the tail's start, is a whole block of ``lanes`` rows (the
    tail is 1 to ``lanes`` tokens). A batching lease (several sequences, per-sequence states) uses it with
    or without tiers: the uncached run's calls are the shape's, and a lease with tiers must answer as one
    without. A one-sequence latency lease saves states of every cell instead (``ContextParams.saves_all_cells``:
    each cell back in its own cell) and keeps the plain shape.
    """
    if lanes <= shape.row_block and not shape.ragged_body:
        return shape
    return ReuseShape(max(shape.row_block, lanes))


reuse_limit = BLOCKED.reuse_limit
restore_point = BLOCKED.restore_point
retained_rows = BLOCKED.retained_rows
micro_batch_rows = BLOCKED.micro_batch_rows


def conversation_keep(common: int, prompt_len: int) -> int:
    """What a session keeps of its own KV for the next turn: the common prefix, leaving one token to evaluate.

    A conversation's KV holds its answers, decoded one row at a time, so no
    turn equals an uncached run of the whole conversation anyway; what a
    session must equal is the same session uninterrupted, and the same rule on
    both sides gives that. Keeping everything also lets a restored
    sliding-window state continue without a trim it could not make.
    """
    return max(0, min(common, prompt_len - 1))


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
