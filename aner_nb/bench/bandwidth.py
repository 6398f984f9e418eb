"""The physical limit of plain decoding: bytes one decode step must read, and this machine's read bandwidth.

One greedy decode step of a dense model reads every weight tensor once (a
token's embedding is one row of ``token_embd``, unless the output layer is
tied to it and reads the whole table), plus the KV rows attention visits:
``positions`` cells on full-attention layers, at most the window on
sliding-window layers. At ``B`` bytes per second of memory reads, a step
cannot take less than ``read_bytes / B``, so ``tok/s * read_bytes / B`` is
the fraction of the bound a decoder achieves (1.0 is the ceiling; caches
can only help when the weights fit in them, which they do not here). The
KV count is a lower bound: llama.cpp visits cells in blocks of 256.

:func:`read_bandwidth` measures ``B`` in this process with NumPy reductions
over a buffer far larger than the last-level cache, split over the threads
the decoder uses (NumPy releases the GIL in reductions), best of several
passes, so both sides of the ratio come from the same run on the same CPU.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

__all__ = ["DecodeReads", "decode_reads", "tensor_bytes", "read_bandwidth", "Bandwidth"]


@dataclass(frozen=True)
class DecodeReads:
    """Bytes one decode step reads: weights (per token) and KV (at ``positions`` cells of history)."""

    weights: int
    kv: int
    positions: int
    tied_output: bool

    @property
    def total(self) -> int:
        return self.weights + self.kv


def tensor_bytes(path: str) -> dict[str, int]:
    """Each tensor's size in bytes, from the GGUF's tensor table (gguf's reader)."""
    from gguf import GGUFReader  # noqa: PLC0415 - benchmarks only

    return {t.name: int(t.n_bytes) for t in GGUFReader(path, "r").tensors}


def decode_reads(
    tensors: Mapping[str, int], *, vocab: int, positions: int, kv_bytes_per_cell: Sequence[int],
    windows: Sequence[int],
) -> DecodeReads:
    """What one decode step at ``positions`` cells of history reads.

    ``kv_bytes_per_cell[l]`` is layer ``l``'s K plus V bytes per cell (heads x
    row bytes); ``windows[l]`` its sliding window (0: full attention).
    """
    if len(kv_bytes_per_cell) != len(windows):
        raise ValueError("kv_bytes_per_cell and windows need one entry per layer")
    tied = "output.weight" not in tensors
    weights = 0
    for name, size in tensors.items():
        if name == "token_embd.weight" and not tied:
            weights += -(-size // vocab)  # one row: the token's embedding
        else:
            weights += size
    kv = sum(per_cell * (min(positions, w) if w > 0 else positions) for per_cell, w in zip(kv_bytes_per_cell, windows))
    return DecodeReads(weights=weights, kv=kv, positions=positions, tied_output=tied)


@dataclass(frozen=True)
class Bandwidth:
    """Measured read bandwidth: best and median of the passes, in bytes per second."""

    best: float
    median: float
    threads: int
    buffer_bytes: int
    passes: int


def read_bandwidth(threads: int, *, buffer_bytes: int = 1 << 30, passes: int = 7) -> Bandwidth:
    """Read bandwidth over ``buffer_bytes`` summed by ``threads`` threads (one slice each), ``passes`` times."""
    if threads < 1 or passes < 1:
        raise ValueError("threads and passes must be >= 1")
    data = np.ones(buffer_bytes // 8, dtype=np.float64)  # touched once here: pages are resident before timing
    slices = np.array_split(data, threads)
    times = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, slices))  # warm-up pass
        for _ in range(passes):
            t0 = time.perf_counter()
            total = sum(pool.map(np.sum, slices))
            times.append(time.perf_counter() - t0)
            if total != data.size:  # the reduction read every element
                raise RuntimeError("bandwidth probe: the sum does not match the buffer")
    times.sort()
    size = data.nbytes
    return Bandwidth(best=size / times[0], median=size / times[len(times) // 2], threads=threads,
                     buffer_bytes=size, passes=passes)
