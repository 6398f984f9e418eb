"""nbval settings for the tutorials (active only with ``pytest --nbval``).

Outputs are compared after the regex rules of ``nbval_sanitize.cfg`` next to
this file, and each notebook runs in a kernel of the Python that runs pytest
(so a fresh virtual environment needs no registered kernelspec). Explicit
``--nbval-sanitize-with`` / ``--nbval-kernel-name`` options win.
"""

from __future__ import annotations

from pathlib import Path

SANITIZE = Path(__file__).with_name("nbval_sanitize.cfg")


def pytest_configure(config):
    opt = config.option
    if not (getattr(opt, "nbval", False) or getattr(opt, "nbval_lax", False)):
        return
    if not getattr(opt, "nbval_sanitize_with", None):
        opt.nbval_sanitize_with = str(SANITIZE)
    if not getattr(opt, "nbval_kernel_name", None):
        opt.nbval_current_env = True
