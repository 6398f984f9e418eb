#!/usr/bin/env python3
"""Coverage-guided fuzz target (atheris/libFuzzer) for grammar and JSON-schema bounds, with llama.cpp's parser.

Each input is a GBNF text, or (when it parses as a JSON object) a JSON schema
that is converted to GBNF as a request's ``json_schema`` would be. aner_nb's
bound checks run first (``aner_nb.llm.constraints``, instrumented for
coverage); they may only admit the text or refuse it with
:class:`InvalidRequestError`. Every admitted grammar is then parsed by
llama.cpp's real parser (``llama_sampler_init_grammar`` on a fixture model's
vocabulary) in a child process (``tests/fixtures/grammar_child.py``): a child
that dies by a signal, or gives no answer within its bound, is a finding. A
finding is recorded, not a dead run: the input is written to
``<artifact_prefix>finding-<sha1>`` with the outcome in its name's
``.txt`` companion, the child is restarted and fuzzing goes on.

    .venv/bin/python fuzz/fuzz_grammar.py -max_total_time=600     # on demand
    .venv/bin/python fuzz/fuzz_grammar.py CRASH_FILE              # replay one input

``tests/test_fuzz_atheris.py`` runs it for a bounded time in the suite.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys

import atheris

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from _common import main, scratch_dir, timed  # noqa: E402

from aner_nb.llm._engine import GrammarError, json_schema_grammar  # noqa: E402
from aner_nb.llm.errors import InvalidRequestError  # noqa: E402
from fixtures.grammar_child import GrammarChild  # noqa: E402
from fixtures.models import write_tiny_model  # noqa: E402

with atheris.instrument_imports(include=["aner_nb.llm.constraints"]):
    constraints = importlib.reload(importlib.import_module("aner_nb.llm.constraints"))

SCRATCH = scratch_dir("grammar")
MODEL = str(write_tiny_model(os.path.join(SCRATCH, "tiny.gguf")))
CHILD = GrammarChild(MODEL)
FINDINGS = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("-artifact_prefix=")), SCRATCH + "/")
STATS = {"admitted": 0, "refused_by_bounds": 0, "parsed": 0, "refused_by_llama": 0, "findings": 0}


def _record(data: bytes, outcome: str) -> None:
    STATS["findings"] += 1
    name = f"{FINDINGS}finding-{hashlib.sha1(data).hexdigest()}"
    with open(name, "wb") as f:
        f.write(data)
    with open(name + ".txt", "w") as f:
        f.write(outcome + "\n")
    print(f"fuzz_grammar: FINDING ({outcome}) written to {name}", file=sys.stderr)


def _grammar_of(data: bytes) -> tuple[str, str] | None:
    """(text, param) to parse, or None when the bounds (or the converter) refused it with a typed error."""
    text = data.decode("utf-8", "replace")
    schema = None
    if text.lstrip().startswith("{"):
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError):
            schema = None
    try:
        if isinstance(schema, dict):
            constraints.check_json_schema(schema)
            try:
                text = json_schema_grammar(json.dumps(schema))
            except GrammarError:
                return None  # the converter's own typed refusal
            constraints.check_grammar_text(text, param="json_schema")
            return text, "json_schema"
        constraints.check_grammar_text(text)
        return text, "grammar"
    except InvalidRequestError as exc:
        assert exc.param in ("grammar", "json_schema"), exc
        return None


def test_one_input(data: bytes) -> None:
    STATS["inputs"] = STATS.get("inputs", 0) + 1
    if STATS["inputs"] % 5000 == 0:
        _report()
    found: list[tuple[str, str] | None] = []
    timed(lambda: found.append(_grammar_of(data)))
    if found[0] is None:
        STATS["refused_by_bounds"] += 1
        return
    STATS["admitted"] += 1
    outcome = CHILD.parse(found[0][0])
    if outcome in ("parsed", "refused"):
        STATS["parsed" if outcome == "parsed" else "refused_by_llama"] += 1
    else:
        _record(data, outcome)


def _report() -> None:
    print("fuzz_grammar: " + " ".join(f"{k}={v}" for k, v in STATS.items()), file=sys.stderr)


if __name__ == "__main__":
    import atexit

    atexit.register(_report)  # replays exit normally; libFuzzer's own exit() skips it (see -print_final_stats)
    main("grammar", test_one_input)
