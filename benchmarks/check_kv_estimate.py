"""The KV estimate against the KV buffers llama.cpp allocates, for the test fixtures and the demo model.

For each model, context size, KV type and sequence layout it creates one
context, reads back the KV buffers llama.cpp reported allocating
(``NativeContext.kv_buffers``) and compares their total with
``aner_nb.llm.memory.kv_caches_for`` of the model's GGUF facts and the
context's parameters. Prints a Markdown table (the one in
benchmarks/RESULTS.md, "KV estimate vs engine buffer").

    .venv/bin/python benchmarks/check_kv_estimate.py [--fixtures-only] [--model gemma smollm2 | PATH ...]

``--model`` (see ``_models.py``) names the real models measured after the
fixtures; default both demo models, Gemma 3 270M first (its sliding-window
cache is what the allocation rule has to get right: the section of
``RESULTS.md`` measured it alone) and SmolLM2-135M-Instruct (full attention, 3
KV heads of 64). Each row names its model; the header lines give each file's SHA-256.

Not a timing benchmark: it takes no benchmark lock and measures no speed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from _models import GEMMA, SMOLLM2, header, resolve

from aner_nb.llm import _engine
from aner_nb.llm.artifact import inspect_model, sha256_file
from aner_nb.llm.memory import kv_caches_for

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
FIXTURE_CONTEXTS = (4000, 8192, 32768)  # the tiny fixtures' KV is small: large contexts keep it >= 0.25 MiB
DEMO_CONTEXTS = (512, 2000, 8192)
KV_TYPES = ("f16", "q8_0", "q4_0")
LAYOUTS = ((1, True, False), (4, False, False), (4, True, False), (1, True, True))  # (n_seq, unified, swa_full)


@dataclass(frozen=True)
class Row:
    model: str
    context: int
    kv_cache_type: str
    n_seq: int
    unified: bool
    swa_full: bool
    estimate: int
    engine: int
    caches: str  # "cells x streams / layers" per cache, the engine's
    same_layout: bool  # the estimate's caches have the engine's kinds, cells, streams and layers

    @property
    def error(self) -> float:
        return (self.estimate - self.engine) / self.engine


def measure(path: str, name: str, contexts: tuple[int, ...], layouts=LAYOUTS, kv_types=KV_TYPES) -> Iterator[Row]:
    facts = inspect_model(path)
    model = _engine.NativeModel(path)
    try:
        for context in contexts:
            for kv in kv_types:
                for n_seq, unified, swa_full in layouts:
                    if swa_full and not facts.sliding_window:
                        continue  # the same layout as the plain one
                    params = _engine.ContextParams(
                        n_ctx=context, n_batch=512, n_ubatch=512, n_seq_max=n_seq, kv_cache_type=kv,
                        flash_attention="on", kv_unified=unified, swa_full=swa_full,
                    )
                    ctx = _engine.NativeContext(model, params)
                    try:
                        buffers = ctx.kv_buffers
                    finally:
                        ctx.free()
                    estimated = kv_caches_for(facts, params)
                    caches = ", ".join(f"{b.kind} {b.cells}x{b.streams}/{b.layers}L" for b in buffers)
                    same = [(c.kind, c.cells, c.streams, c.layers) for c in estimated] == [
                        (b.kind, b.cells, b.streams, b.layers) for b in buffers
                    ]
                    yield Row(name, context, kv, n_seq, unified, swa_full, sum(c.bytes for c in estimated),
                              sum(b.buffer_bytes for b in buffers), caches, same)
    finally:
        model.free()


def fixture_paths(directory: Path) -> dict[str, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fixtures.models import write_tiny_model  # noqa: PLC0415 - the test suite's fixture writer

    return {f: str(write_tiny_model(directory / f"tiny-{f}.gguf", f)) for f in FAMILIES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixtures-only", action="store_true", help="skip the real models")
    parser.add_argument("--model", nargs="+", default=[GEMMA, SMOLLM2], metavar="smollm2|gemma|PATH",
                        help=f"the real models measured after the fixtures (default: {GEMMA} {SMOLLM2})")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, path in fixture_paths(Path(tmp)).items():
            rows += measure(path, f"fixture {family}", FIXTURE_CONTEXTS)
    if not args.fixtures_only:
        for value in args.model:
            choice = resolve(value)  # smollm2 and gemma need the demo packages
            print(header(choice, fingerprint=sha256_file(choice.path)))
            label = f"demo {choice.label}" if choice.choice != "path" else choice.label
            rows += measure(choice.path, label, DEMO_CONTEXTS)
    print("| model | n_ctx | KV type | n_seq | unified | swa_full | estimate (bytes) | engine (bytes) "
          "| error % | engine caches (cells x streams / layers) | same layout |")
    print("|---|---:|---|---:|---|---|---:|---:|---:|---|---|")
    for r in rows:
        print(f"| {r.model} | {r.context} | {r.kv_cache_type} | {r.n_seq} | {r.unified} | {r.swa_full} "
              f"| {r.estimate:,} | {r.engine:,} | {100 * r.error:+.2f} | {r.caches} | {'yes' if r.same_layout else 'NO'} |")
    worst = max(rows, key=lambda r: abs(r.error))
    print(f"\n{len(rows)} contexts; largest |error| {100 * abs(worst.error):.2f}% "
          f"({worst.model}, n_ctx {worst.context}, {worst.kv_cache_type}, n_seq {worst.n_seq})")
    differ = [r for r in rows if not r.same_layout]
    print(f"cache layouts (kinds, cells, streams, layers) equal to the engine's: {len(rows) - len(differ)}/{len(rows)}")
    return 0 if abs(worst.error) <= 0.05 and not differ else 1


if __name__ == "__main__":
    raise SystemExit(main())
