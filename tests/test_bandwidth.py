"""The decode-step byte count and the bandwidth probe behind benchmarks/bench_bandwidth.py."""

from __future__ import annotations

import gguf
import pytest

from aner_nb.bench.bandwidth import decode_reads, read_bandwidth, tensor_bytes


def test_tensor_bytes_are_the_table_sizes_by_quantisation_block(llama_path):
    reader = gguf.GGUFReader(str(llama_path), "r")
    sizes = tensor_bytes(str(llama_path))
    assert set(sizes) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        block, type_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        assert sizes[t.name] == int(t.n_elements) // block * type_bytes


def test_a_step_reads_every_weight_once_and_one_embedding_row_unless_tied():
    tensors = {"token_embd.weight": 1000 * 64, "blk.0.attn_q.weight": 4096, "output_norm.weight": 256}
    tied = decode_reads(tensors, vocab=1000, positions=0, kv_bytes_per_cell=[8], windows=[0])
    assert tied.tied_output and tied.weights == sum(tensors.values()) and tied.kv == 0
    untied = decode_reads({**tensors, "output.weight": 64_000}, vocab=1000, positions=0,
                          kv_bytes_per_cell=[8], windows=[0])
    assert not untied.tied_output and untied.weights == 64 + 4096 + 256 + 64_000


def test_kv_reads_stop_at_a_sliding_window():
    reads = decode_reads({}, vocab=1, positions=1000, kv_bytes_per_cell=[10, 10, 10], windows=[0, 256, 256])
    assert reads.kv == 10 * 1000 + 2 * 10 * 256 and reads.total == reads.kv
    with pytest.raises(ValueError):
        decode_reads({}, vocab=1, positions=1, kv_bytes_per_cell=[1], windows=[0, 0])


def test_the_probe_reads_its_whole_buffer_and_reports_best_over_median():
    bw = read_bandwidth(2, buffer_bytes=1 << 22, passes=3)
    assert bw.best >= bw.median > 0 and bw.buffer_bytes == 1 << 22 and bw.threads == 2
    with pytest.raises(ValueError):
        read_bandwidth(0)
