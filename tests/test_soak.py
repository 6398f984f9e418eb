"""The soak's CI short mode: ``benchmarks/soak.py --minutes 3`` (issue 18: 3 minutes in CI, 30 on demand).

Eight clients send a mixed load (chat, streams, cancels, disconnects, bad
requests, bursts past the admission limit) to an ``aner-nb serve`` process
for three minutes; the script samples the server's RSS, threads, open file
descriptors and live llama.cpp contexts every 10 s and judges growth after
the warm-up, the status codes and the answers. This test checks the
script's verdict and that the manifest shows each part of the load really
happened, so a soak that silently stopped exercising something fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("chat", "stream", "cancel", "disconnect", "bad", "burst")
RESOURCES = ("rss_bytes", "threads", "fds", "native_contexts")


def test_soak_short_mode(tmp_path):
    manifest = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "3",
                           "--json", str(manifest)], capture_output=True, text=True, timeout=600)
    assert manifest.exists(), done.stdout + done.stderr
    result = json.loads(manifest.read_text())
    assert done.returncode == 0 and result["ok"], (done.stdout, result["failures"], result["failure_examples"])

    assert result["manifest"]["clients"] == 8 and result["elapsed_s"] >= 180
    assert len(result["samples"]) >= 18  # every 10 s
    by_kind = result["requests"]["by_kind"]
    assert all(by_kind.get(kind, 0) > 0 for kind in KINDS), by_kind
    assert result["status_by_kind"]["chat"].get("200", 0) > 0
    assert result["status_by_kind"]["stream"].get("200", 0) > 0
    assert result["status_by_kind"]["burst"].get("503", 0) > 0  # the overflow was refused busy
    assert all(400 <= int(code) < 500 for code in result["status_by_kind"]["bad"])
    assert result["outcomes"].get("busy_503", 0) > 0 and result["outcomes"].get("cancelled_mid_stream", 0) > 0
    assert result["client_5xx_other_than_503"] == {}
    assert result["server_requests_total"] == result["requests"]["http_sent"]  # every request answered
    assert all(s["idle"] for s in result["samples"])  # nothing left in flight, queued or decoding
    assert result["server_exit_code"] == 0
    for key in RESOURCES:
        g = result["growth"][key]
        assert g["baseline"] > 0 and g["growth"] < 0.05, (key, g)
