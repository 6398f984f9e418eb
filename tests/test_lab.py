"""``python -m aner_nb lab``: JupyterLab on loopback serving the tutorials, kernels from this Python."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_print_command_names_this_python_and_the_tutorials():
    out = subprocess.run([sys.executable, "-m", "aner_nb", "lab", "--print-command", "--no-browser"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={REPO / 'notebooks'}" in out and "--ServerApp.ip=127.0.0.1" in out
    assert out[-1] == "--no-browser"  # JupyterLab's own options pass through


def test_lab_serves_the_tutorials_with_a_kernel_of_this_python(tmp_path):
    pytest.importorskip("jupyterlab")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "aner_nb", "lab", "--no-browser", f"--ServerApp.port={port}",
         f"--IdentityProvider.token={token}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):  # up to a minute for the server to come up; a dead process fails at once
            assert proc.poll() is None, proc.stderr.read()
            try:
                _get(f"{base}/api/status?token={token}")
                break
            except OSError:
                time.sleep(0.25)
        names = {item["name"] for item in _get(f"{base}/api/contents?token={token}")["content"]}
        assert {"01_quickstart.ipynb", "06_measurement.ipynb"} <= names
        specs = _get(f"{base}/api/kernelspecs?token={token}")
        argv = specs["kernelspecs"][specs["default"]]["spec"]["argv"]
        # ipykernel's own spec says "python", which jupyter_client replaces with the server's
        # interpreter (this venv's) when it starts a kernel; a spec naming another Python would not be.
        assert argv[0] in ("python", sys.executable) and "ipykernel_launcher" in " ".join(argv)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with pytest.raises(OSError):  # the server itself ended: terminating the command left nothing running
        _get(f"{base}/api/status?token={token}")
