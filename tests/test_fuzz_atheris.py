"""The coverage-guided fuzz targets (fuzz/, atheris + libFuzzer) run clean for a bounded time.

Each target runs in a subprocess for 25 s from the committed seed corpus
(``fuzz/corpus/``, written by ``fuzz/make_corpus.py``) into a scratch
corpus, so the committed one never changes. A crash (an exception other than
the typed errors, an input over the CPU-time bound, the RSS limit) makes
libFuzzer exit non-zero; the run must also have executed a meaningful number
of inputs. Longer runs are on demand: ``.venv/bin/python fuzz/fuzz_gguf.py -max_total_time=600``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECONDS = 25
MIN_EXECUTIONS = 1000  # a few thousand per second locally; far fewer means the target barely ran


@pytest.mark.parametrize("target", ["gguf", "manifest", "grammar"])
def test_fuzz_target_runs_clean(tmp_path, target):
    seeds = ROOT / "fuzz" / "corpus" / target
    seed_files = sorted(p.name for p in seeds.iterdir())
    assert seed_files, f"no seed corpus in {seeds}"
    work = tmp_path / "corpus"
    work.mkdir()
    cmd = [sys.executable, str(ROOT / "fuzz" / f"fuzz_{target}.py"), f"-max_total_time={SECONDS}",
           "-seed=1", f"-artifact_prefix={tmp_path}/", str(work), str(seeds)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=SECONDS + 120)
    log = proc.stdout + proc.stderr
    crashes = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-", "finding-")))
    assert proc.returncode == 0 and not crashes, f"fuzz_{target} failed ({proc.returncode}, {crashes}):\n{log[-4000:]}"
    assert f"{len(seed_files)} files found in {seeds}" in log
    executed = int(re.search(r"stat::number_of_executed_units:\s*(\d+)", log).group(1))
    done = int(re.search(r"#(\d+)\s+DONE", log).group(1))
    assert executed == done >= MIN_EXECUTIONS, log[-2000:]
    assert sorted(p.name for p in seeds.iterdir()) == seed_files  # the committed corpus is read, not written
