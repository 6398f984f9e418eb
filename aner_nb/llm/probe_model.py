"""A tiny quantized GGUF that takes llama.cpp's CPU extra-buffer paths (AMX, repack).

The CPU probe (``cpu_guard``) loads it in a child process and decodes once.
llama.cpp moves a weight into an extra buffer type only when its kernels can
handle the type and shape: the AMX buffer type wants Q4_0/Q4_1/Q8_0 (or
K-quants) weights whose row length is a multiple of 32 and whose row count is
a multiple of 32, and the repack buffer type (AVX2/AVX-512) wants Q4_0 with
rows in groups of 4 or 8. Every matrix here fits both, so a CPU that
advertises AMX but faults on tile instructions, or a build with instructions
the CPU lacks, fails in the child the way the demo model would in the user's
process. The weights are random and the file is written once per cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.quants import quantize

__all__ = ["PROBE_MODEL_VERSION", "write_probe_model"]

PROBE_MODEL_VERSION = 1
_N_EMBD, _N_HEAD, _N_FF, _N_VOCAB, _N_LAYER = 256, 4, 512, 512, 2


def write_probe_model(path: "str | os.PathLike[str]") -> Path:
    """Write the probe model to ``path`` (atomically) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    rng = np.random.default_rng(PROBE_MODEL_VERSION)
    # A byte-level BPE vocabulary: 256 byte tokens, one merge (llama.cpp requires the key),
    # then filler tokens up to a row count the AMX and repack kernels accept.
    tokens = [f"<0x{b:02X}>" for b in range(256)] + ["<0x00><0x01>"]
    tokens += [f"<probe_{i}>" for i in range(_N_VOCAB - len(tokens))]
    w = GGUFWriter(tmp, "llama")
    w.add_name("aner-nb-cpu-probe")
    w.add_type("model")
    w.add_file_type(int(LlamaFileType.MOSTLY_Q8_0))
    w.add_context_length(256)
    w.add_embedding_length(_N_EMBD)
    w.add_block_count(_N_LAYER)
    w.add_feed_forward_length(_N_FF)
    w.add_head_count(_N_HEAD)
    w.add_head_count_kv(_N_HEAD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(_N_EMBD // _N_HEAD)
    w.add_vocab_size(_N_VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([int(TokenType.NORMAL)] * _N_VOCAB)
    w.add_token_merges(["<0x00> <0x01>"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def add(name: str, rows: int, cols: int, qtype: GGMLQuantizationType) -> None:
        data = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    q8, q4 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0
    add("token_embd.weight", _N_VOCAB, _N_EMBD, q8)
    w.add_tensor("output_norm.weight", np.ones(_N_EMBD, dtype=np.float32))
    add("output.weight", _N_VOCAB, _N_EMBD, q8)
    for i in range(_N_LAYER):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(_N_EMBD, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(_N_EMBD, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            add(p + name + ".weight", _N_EMBD, _N_EMBD, q8)
        add(p + "ffn_gate.weight", _N_FF, _N_EMBD, q4)
        add(p + "ffn_up.weight", _N_FF, _N_EMBD, q4)
        add(p + "ffn_down.weight", _N_EMBD, _N_FF, q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path
