"""Two llama.cpp builds of the pinned llama-cpp-python on the demo model: prompt and decode tokens/s.

A build is a folder holding an unpacked llama-cpp-python wheel (``unzip
WHEEL -d DIR``); it is put first on ``PYTHONPATH`` of a child process, so
each side runs its own shared libraries with this checkout's aner_nb. Every
round starts one child per side in ABBA order after a warm-up child each;
a child loads the demo model, warms up, then reports the median of
``--repeats`` prompt evaluations (a ~512-token ledger, ``max_tokens=1``) and
greedy decodes (``--max-tokens``) at the same ``threads``/``prefill_threads``,
context and flash-attention setting on both sides.

``--model`` (see ``_models.py``) defaults to ``smollm2`` (SmolLM2-135M-Instruct): a build's
instruction sets are not specific to a model. The section of ``RESULTS.md`` measured before the
option existed ran on Gemma 3 270M (``--model gemma``).

Run (builds made with ``pip wheel --no-cache-dir`` under two ``CMAKE_ARGS``)::

    python benchmarks/bench_build.py --build portable=/tmp/portable_site --build native=/tmp/native_site
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _models import SMOLLM2, add_model_option, header, manifest_fields, resolve

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, statistics, sys
sys.path.insert(0, os.environ["BENCH_ROOT"]); sys.path.insert(0, os.path.join(os.environ["BENCH_ROOT"], "benchmarks"))
from aner_nb import llm
from _models import resolve
from _workloads import evidence_of_tokens
threads, repeats, max_tokens = (int(x) for x in sys.argv[1:4])
base = resolve(sys.argv[4]).load(context=2048)
model = base.with_optimizer(threads=threads, prefill_threads=threads)
ledger = evidence_of_tokens(model, 512)
story = "Write a short story about a lighthouse keeper who finds a message in a bottle."
model.generate(ledger, max_tokens=1); model.generate(story, max_tokens=16)  # warm-up
prompt, decode = [], []
ledger_tokens = len(model.prompt_tokens(ledger))
for _ in range(repeats):
    t = model.generate(ledger, max_tokens=1).timings
    prompt.append(t.evaluated_prompt_tokens * 1e9 / t.prompt_eval_duration)
    decode.append(model.generate(story, max_tokens=max_tokens).tokens_per_second())
t = model.generate(story, max_tokens=1).timings
print(json.dumps({
    "prompt": statistics.median(prompt), "decode": statistics.median(decode),
    "threads": t.threads, "prefill_threads": t.prefill_threads, "prompt_tokens": ledger_tokens,
    "system_info": llm.system_info().build_info, "extra_buffers": base.load_summary().cpu_extra_buffers,
    "llama_cpp": __import__("llama_cpp").__file__, "model": base.name, "sha256": base.fingerprint,
}))
"""


def run_child(site: str, threads: int, repeats: int, max_tokens: int, model: str) -> dict:
    env = dict(os.environ, PYTHONPATH=site, BENCH_ROOT=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(threads), str(repeats), str(max_tokens), model],
        env=env, cwd="/", capture_output=True, text=True, check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="append", required=True, metavar="NAME=DIR",
                        help="exactly two: the baseline first")
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds (default 4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads and prefill threads on both sides (default: logical CPUs)")
    parser.add_argument("--json", default=None)
    add_model_option(parser, SMOLLM2)
    args = parser.parse_args()
    sides = [tuple(b.split("=", 1)) for b in args.build]
    if len(sides) != 2:
        parser.error("give exactly two --build NAME=DIR")
    from aner_nb.bench import environment

    choice = resolve(args.model)
    model = choice.path if choice.choice == "path" else choice.choice  # what each child resolves

    results: dict[str, list[dict]] = {name: [] for name, _ in sides}
    for name, site in sides:  # warm-up child each (page cache, CPU probe verdict)
        run_child(site, args.threads, 1, 16, model)
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for name, site in order:
            results[name].append(run_child(site, args.threads, args.repeats, args.max_tokens, model))
    (a, _), (b, _) = sides
    summary = {}
    for metric in ("prompt", "decode"):
        va, vb = [x[metric] for x in results[a]], [x[metric] for x in results[b]]
        summary[metric] = {
            a: {"median": statistics.median(va), "min": min(va), "max": max(va)},
            b: {"median": statistics.median(vb), "min": min(vb), "max": max(vb)},
            "ratio_of_medians": statistics.median(vb) / statistics.median(va),
            "paired_ratio_median": statistics.median(y / x for x, y in zip(va, vb)),
        }
    first = {name: results[name][0] for name, _ in sides}
    print(header(choice, fingerprint=first[a]["sha256"]))
    print(f"threads={first[a]['threads']} prefill_threads={first[a]['prefill_threads']} (both sides); "
          f"rounds={args.rounds} ABBA, {args.repeats} repeats per child; CPU: {environment().get('cpu', '?')}")
    for name, _ in sides:
        print(f"{name}: {first[name]['system_info']} extra_buffers={first[name]['extra_buffers']}")
    for metric, unit in (("prompt", f"prompt tok/s ({first[a]['prompt_tokens']}-token ledger)"),
                         ("decode", f"decode tok/s ({args.max_tokens} tokens)")):
        s = summary[metric]
        print(f"{unit}: {a} {s[a]['median']:.1f} [{s[a]['min']:.1f}..{s[a]['max']:.1f}]  "
              f"{b} {s[b]['median']:.1f} [{s[b]['min']:.1f}..{s[b]['max']:.1f}]  "
              f"{b}/{a} = {s['ratio_of_medians']:.3f} (paired {s['paired_ratio_median']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment(),
                                               **manifest_fields(choice, fingerprint=first[a]["sha256"]),
                                               "summary": summary, "results": results}, indent=2))


if __name__ == "__main__":
    from aner_nb.bench import exclusive

    with exclusive("bench_build"):  # one benchmark at a time: two would measure each other
        main()
