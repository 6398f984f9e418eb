#!/usr/bin/env python3
"""Coverage-guided fuzz target (atheris/libFuzzer) for the GGUF inspector.

Each input is written to a file and given to ``inspect_model`` and
``inspect_adapter``; the only allowed outcomes are facts or the typed errors
(:class:`InvalidArtifactError` and its subclasses, :class:`AdapterError` for
adapters), within 2 s of CPU per input. Anything else (another exception, a
slow input, the process past its RSS limit) is a crash that libFuzzer reports
with the input saved.

    .venv/bin/python fuzz/fuzz_gguf.py -max_total_time=600     # on demand
    .venv/bin/python fuzz/fuzz_gguf.py CRASH_FILE              # replay one input

``tests/test_fuzz_atheris.py`` runs it for a bounded time in the suite.
"""

from __future__ import annotations

import importlib
import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import main, scratch_dir, timed  # noqa: E402

from aner_nb.llm.errors import AdapterError, InvalidArtifactError  # noqa: E402

# Importing aner_nb loads the whole package; reloading only the module under test inside the hook
# instruments it alone, so coverage feedback (and the slowdown) comes from the parser.
with atheris.instrument_imports(include=["aner_nb.llm.artifact", "aner_nb.llm.gguf_header"]):
    artifact = importlib.reload(importlib.import_module("aner_nb.llm.artifact"))
inspect_model, inspect_adapter = artifact.inspect_model, artifact.inspect_adapter

PATH = os.path.join(scratch_dir("gguf"), "input.gguf")
FD = os.open(PATH, os.O_RDWR | os.O_CREAT, 0o600)


def _inspect() -> None:
    try:
        inspect_model(PATH)
    except InvalidArtifactError:
        pass
    try:
        inspect_adapter(PATH)
    except AdapterError:
        pass


def test_one_input(data: bytes) -> None:
    os.ftruncate(FD, 0)
    os.pwrite(FD, data, 0)
    timed(_inspect)


if __name__ == "__main__":
    main("gguf", test_one_input)
