"""nbval settings for the tutorials (active only with ``pytest --nbval``).

Outputs are compared after the regex rules of ``nbval_sanitize.cfg`` next to
this file, and each notebook runs in a kernel of the Python that runs pytest
(so a fresh virtual environment needs no registered kernelspec). Explicit
``--nbval-sanitize-with`` / ``--nbval-kernel-name`` options win.

Portability: greedy text depends on the CPU's float summation order (AVX2 and
AVX-512 kernels sum differently), so a saved output that holds model text
would fail on the other CPU of this project's machine kind. Another thread
count and flash attention switched off change the summation order on any CPU,
so the odd-numbered tutorials run their kernel under :data:`OTHER_ORDER`
(one thread, no flash attention) and must still match the outputs saved under
the defaults. Each tutorial runs once per ``pytest --nbval``; the notebook a
variant applies to is printed in the test's report header.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

SANITIZE = Path(__file__).with_name("nbval_sanitize.cfg")
#: The kernel environment that changes the float summation order (the library's process-wide defaults).
OTHER_ORDER = {"ANER_NB_THREADS": "1", "ANER_NB_FLASH_ATTENTION": "off"}


def kernel_environment(notebook: Path) -> dict[str, str]:
    """The environment overrides a tutorial's kernel starts with: odd-numbered ones use OTHER_ORDER."""
    match = re.match(r"(\d+)_", notebook.name)
    return dict(OTHER_ORDER) if match and int(match.group(1)) % 2 == 1 else {}


def pytest_configure(config):
    opt = config.option
    if not (getattr(opt, "nbval", False) or getattr(opt, "nbval_lax", False)):
        return
    if not getattr(opt, "nbval_sanitize_with", None):
        opt.nbval_sanitize_with = str(SANITIZE)
    if not getattr(opt, "nbval_kernel_name", None):
        opt.nbval_current_env = True


def pytest_report_header(config):
    if getattr(config.option, "nbval", False):
        return f"tutorials: odd-numbered notebooks run under {OTHER_ORDER} (another float summation order)"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    # nbval starts a notebook's kernel while setting up its first cell (the parent collector's
    # setup), and a kernel inherits os.environ at start: set the overrides just around it.
    overrides = kernel_environment(Path(str(item.fspath))) if str(item.fspath).endswith(".ipynb") else {}
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
