"""Shared driver of the atheris fuzz targets: libFuzzer defaults, the seed corpus and the CPU-time bound."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from typing import Callable

import atheris

HERE = os.path.dirname(os.path.abspath(__file__))
TIME_BOUND_S = 2.0  # CPU seconds per input, as in tests/fixtures/bounds.py


def scratch_dir(name: str) -> str:
    """A folder for this process's input files, in ``/dev/shm`` when there is one.

    libFuzzer ends the process with C ``exit()``, so Python's ``atexit`` never
    runs; instead each start removes the scratch folders of processes that are gone.
    """
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    prefix = f"aner-fuzz-{name}-scratch-"
    for entry in os.listdir(base):
        if entry.startswith(prefix) and entry[len(prefix):].isdigit():
            try:
                os.kill(int(entry[len(prefix):]), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(base, entry), ignore_errors=True)
            except OSError:
                pass  # alive, another user's
    path = os.path.join(base, f"{prefix}{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)
    os.mkdir(path, 0o700)
    return path


class TooSlow(AssertionError):
    """An input took longer than the bound: a crash for the fuzzer."""


def timed(fn: Callable[[], None]) -> None:
    """Run ``fn``; raise :class:`TooSlow` when it used more than the CPU-time bound."""
    t0 = time.thread_time()
    fn()
    spent = time.thread_time() - t0
    if spent > TIME_BOUND_S:
        raise TooSlow(f"one input took {spent:.2f} s of CPU (bound {TIME_BOUND_S} s)")


def main(name: str, test_one_input: Callable[[bytes], None]) -> None:
    """Run libFuzzer with this target's seed corpus and dictionary unless the command line names others.

    With no corpus directory on the command line, new inputs go to a fresh
    temporary folder (printed) and ``fuzz/corpus/<name>`` is read as seeds, so
    the committed corpus never changes; crash inputs are written there too.
    """
    args = sys.argv[1:]
    flags = {a.split("=", 1)[0] for a in args if a.startswith("-")}
    defaults = {
        "-timeout": "30",          # wall seconds per input before libFuzzer calls it a hang
        "-rss_limit_mb": "2048",   # the whole process, Python and numpy included
        "-dict": os.path.join(HERE, f"{name}.dict"),
        "-print_final_stats": "1",
    }
    extra = [f"{k}={v}" for k, v in defaults.items() if k not in flags]
    if not any(not a.startswith("-") for a in args):
        work = tempfile.mkdtemp(prefix=f"aner-fuzz-{name}-")
        print(f"fuzz_{name}: new inputs and crashes go to {work}", file=sys.stderr)
        if "-artifact_prefix" not in flags:
            extra.append(f"-artifact_prefix={work}/")
        args = args + [work, os.path.join(HERE, "corpus", name)]
    atheris.Setup([sys.argv[0], *extra, *args], test_one_input)
    atheris.Fuzz()
