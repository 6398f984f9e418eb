#!/usr/bin/env python3
"""Write the seed corpora of the fuzz targets (fuzz/corpus/gguf, fuzz/corpus/manifest); deterministic.

    .venv/bin/python fuzz/make_corpus.py

The GGUF seeds are the smallest headers the inspector accepts (built with
``tests/fixtures/raw_gguf.py``) plus variants that reach the other admission
branches; the manifest seeds are one valid manifest and one per rule.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from fixtures import raw_gguf as rg  # noqa: E402


def _with(layout: rg.Layout, *extra: rg.KV, arch: str | None = None) -> rg.Layout:
    kvs = list(layout.kvs)
    if arch:
        kvs = [rg.kv_string("general.architecture", arch) if k.key == b"general.architecture"
               else dataclasses.replace(k, key=k.key.replace(b"llama.", arch.encode() + b".")) for k in kvs]
    keys = {k.key for k in extra}
    return dataclasses.replace(layout, kvs=tuple(k for k in kvs if k.key not in keys) + extra)


def gguf_seeds() -> dict[str, bytes]:
    m, a = rg.minimal_model(), rg.minimal_adapter()
    return {
        "model.gguf": rg.build(m),
        "adapter.gguf": rg.build(a),
        "model-v2.gguf": rg.build(dataclasses.replace(m, version=2)),
        "gemma3-window.gguf": rg.build(_with(m, rg.kv_u32("gemma3.attention.sliding_window", 512),
                                             rg.kv_array("gemma3.attention.sliding_window_pattern", rg.BOOL,
                                                         b"\1", 1), arch="gemma3")),
        "split-shard.gguf": rg.build(_with(m, rg.kv_u32("split.count", 2), rg.KV(b"split.no", rg.U16,
                                                                                 struct.pack("<H", 1)))),
        "aligned-64.gguf": rg.build(dataclasses.replace(_with(m, rg.kv_u32("general.alignment", 64)), alignment=64)),
        "projector.gguf": rg.build(_with(m, rg.kv_string("general.type", "mmproj"))),
        "adapter-no-alpha.gguf": rg.build(dataclasses.replace(a, kvs=a.kvs[:3])),
    }


VALID = {
    "schema": "aner.llm.adapter/1", "base_sha256": "0123456789abcdef" * 4, "adapter_sha256": "f" * 64,
    "architecture": "llama", "adapter_file": "adapter.gguf",
}


def manifest_seeds() -> dict[str, bytes]:
    def dump(**changes: object) -> bytes:
        return json.dumps({**VALID, **changes}, indent=2).encode()

    return {
        "valid.json": dump(),
        "uppercase-digest.json": dump(base_sha256=VALID["base_sha256"].upper()),
        "traversal.json": dump(adapter_file="../outside.gguf"),
        "symlink-escape.json": dump(adapter_file="escape.gguf"),
        "subfolder.json": dump(adapter_file="sub"),
        "extra-field.json": dump(extra=[1, {"a": None}]),
        "duplicate.json": b'{"schema": "aner.llm.adapter/1", "schema": "aner.llm.adapter/1"}',
        "nested.json": b"[" * 64 + b"]" * 64,
        "utf16.json": json.dumps(VALID).encode("utf-16"),
    }


def main() -> None:
    for name, seeds in (("gguf", gguf_seeds()), ("manifest", manifest_seeds())):
        folder = os.path.join(HERE, "corpus", name)
        os.makedirs(folder, exist_ok=True)
        for file, raw in seeds.items():
            with open(os.path.join(folder, file), "wb") as f:
                f.write(raw)
        print(f"{folder}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
