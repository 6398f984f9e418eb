#!/usr/bin/env python3
"""Write the seed corpora of the fuzz targets (fuzz/corpus/gguf, manifest, grammar); deterministic.

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


def grammar_seeds() -> dict[str, bytes]:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                             "maxItems": 3},
        "id": {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]+$"}, "next": {"$ref": "#/$defs/node"}},
        "$defs": {"node": {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}}}
    return {
        "yes-no.gbnf": b'root ::= "yes" | "no"\n',
        "json-ish.gbnf": (b'root ::= obj\nobj ::= "{" ws (pair ("," ws pair)*)? "}"\n'
                          b'pair ::= str ws ":" ws val  # a comment ( [ "\nval ::= str | [0-9]+ | obj\n'
                          b'str ::= "\\"" [^"\\\\]* "\\""\nws ::= [ \\t\\n]{0,4}\n'),
        "nested.gbnf": b"root ::= " + b"(" * 40 + b'"a"' + b")" * 40 + b"\n",
        "repeat.gbnf": b'root ::= ("ab" [c-e]?){2,5} "x"+ .*\n',
        "tokens.gbnf": b'root ::= <[1]> !<[2]> "z"\n',
        "chain.gbnf": b"".join(b"r%d ::= r%d \"x\"\n" % (i, i + 1) for i in range(30)) + b'r30 ::= "y"\nroot ::= r0\n',
        "comment-run.gbnf": b"{" + b"#" * 27 + b"{" * 24 + b"(\0",  # backtracked exponentially in the checker once
        "schema.json": json.dumps(schema).encode(),
        "schema-string.json": b'{"type": "string", "minLength": 2, "maxLength": 40}',
    }


def main() -> None:
    for name, seeds in (("gguf", gguf_seeds()), ("manifest", manifest_seeds()), ("grammar", grammar_seeds())):
        folder = os.path.join(HERE, "corpus", name)
        os.makedirs(folder, exist_ok=True)
        for file, raw in seeds.items():
            with open(os.path.join(folder, file), "wb") as f:
                f.write(raw)
        print(f"{folder}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
