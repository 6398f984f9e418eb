"""``python -m aner_nb lab``: open the tutorials in JupyterLab with this Python's kernel.

JupyterLab comes from the ``lab`` extra (``pip install -e '.[lab]'``). The
server runs in this interpreter (``python -m jupyterlab``), and ipykernel's own
``python3`` kernel spec starts kernels with the interpreter that runs the
server, so the notebooks' kernel is this virtual environment's Python with
aner_nb importable; nothing needs registering. It serves ``notebooks/`` of
the checkout (or ``--notebook-dir``) on loopback with JupyterLab's token; the
other options pass through to JupyterLab (``--port 8890``, ``--no-browser``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["lab_command", "main"]

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def lab_command(notebook_dir: Path, extra: list[str]) -> list[str]:
    """The JupyterLab command line: this Python, loopback, rooted at ``notebook_dir``.

    As root (containers, this project's machines) JupyterLab refuses to start
    unless told it may; the server still listens on loopback only.
    """
    root = ["--ServerApp.allow_root=True"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [sys.executable, "-m", "jupyterlab", "--ServerApp.ip=127.0.0.1", f"--ServerApp.root_dir={notebook_dir}",
            *root, *extra]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aner_nb lab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notebook-dir", type=Path, default=NOTEBOOKS, help="folder to serve (default: the tutorials)")
    parser.add_argument("--print-command", action="store_true", help="print the command instead of running it")
    args, extra = parser.parse_known_args(argv)
    if not args.notebook_dir.is_dir():
        parser.error(f"--notebook-dir {args.notebook_dir} is not a folder")
    if importlib.util.find_spec("jupyterlab") is None:
        print("JupyterLab is not installed in this environment: pip install -e '.[lab]'", file=sys.stderr)
        return 2
    command = lab_command(args.notebook_dir.resolve(), extra)
    if args.print_command:
        print(" ".join(command))
        return 0
    if os.name == "posix":
        # JupyterLab replaces this process, so Ctrl-C and SIGTERM reach the server itself: a wrapper
        # process that was terminated would leave the server running, orphaned.
        os.execv(command[0], command)
    return subprocess.call(command, env=dict(os.environ))
