#!/usr/bin/env python3
"""Coverage-guided fuzz target (atheris/libFuzzer) for the adapter-manifest parser.

Each input is parsed as manifest bytes (``parse_manifest``), as text decoded
with surrogate escapes, and as a manifest file (``read_manifest``); whatever
parses is resolved against a folder holding ``adapter.gguf``, a subfolder and
a symlink that points out of it. The only allowed outcomes are a manifest (and
a regular file inside the folder) or :class:`AdapterError`, within 2 s of CPU.

    .venv/bin/python fuzz/fuzz_manifest.py -max_total_time=600
"""

from __future__ import annotations

import importlib
import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import main, scratch_dir, timed  # noqa: E402

from aner_nb.llm.errors import AdapterError  # noqa: E402

# Importing aner_nb loads the whole package; reloading only the module under test inside the hook
# instruments it alone, so coverage feedback (and the slowdown) comes from the parser.
with atheris.instrument_imports(include=["aner_nb.llm.adapters"]):
    adapters = importlib.reload(importlib.import_module("aner_nb.llm.adapters"))
parse_manifest, read_manifest, resolve_adapter_file = (
    adapters.parse_manifest, adapters.read_manifest, adapters.resolve_adapter_file)

_ROOT = scratch_dir("manifest")
FOLDER = os.path.realpath(os.path.join(_ROOT, "folder"))
os.mkdir(FOLDER)
os.mkdir(os.path.join(FOLDER, "sub"))
with open(os.path.join(FOLDER, "adapter.gguf"), "wb") as f:
    f.write(b"GGUF")
with open(os.path.join(_ROOT, "outside.gguf"), "wb") as f:
    f.write(b"GGUF")
os.symlink(os.path.join(_ROOT, "outside.gguf"), os.path.join(FOLDER, "escape.gguf"))
MANIFEST = os.path.join(FOLDER, "m.json")
FD = os.open(MANIFEST, os.O_RDWR | os.O_CREAT, 0o600)  # rewritten in place: reopening costs milliseconds


def _check(data: bytes) -> None:
    for text in (data, data.decode("utf-8", "surrogateescape")):
        try:
            manifest = parse_manifest(text, folder=FOLDER)
        except AdapterError:
            continue
        try:
            path = resolve_adapter_file(manifest)
        except AdapterError:
            continue
        if os.path.commonpath([FOLDER, path]) != FOLDER or not os.path.isfile(path):
            raise AssertionError(f"adapter_file {manifest.adapter_file!r} resolved outside the folder: {path}")
    os.ftruncate(FD, 0)
    os.pwrite(FD, data, 0)
    try:
        read_manifest(MANIFEST)
    except AdapterError:
        pass


def test_one_input(data: bytes) -> None:
    timed(lambda: _check(data))


if __name__ == "__main__":
    main("manifest", test_one_input)
