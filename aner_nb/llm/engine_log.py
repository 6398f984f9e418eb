"""llama.cpp's log lines: forwarded to ``logging``, captured per call, and the KV-cache report parsed.

``_engine.py`` (the only module that imports llama_cpp) installs :func:`forward`
as llama.cpp's log callback and wraps ``llama_init_from_model`` in
:func:`capturing`; :func:`kv_buffers` reads what llama.cpp reported allocating
for a context's KV cache from those lines, since there is no C function for it.
Nothing here touches llama_cpp.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

__all__ = ["KVBuffer", "KV_LOG_RESOLUTION", "kv_buffers", "forward", "capturing"]

log = logging.getLogger("aner_nb.engine")

# ggml_log_level: 0 none, 1 info, 2 warn, 3 error, 4 debug, 5 continuation of the previous line.
_LOG_LEVELS = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.DEBUG}

# The native log lines of the call being captured on this thread (None: not capturing).
# llama.cpp logs from the calling thread, and reports its KV buffers only there.
_capture = threading.local()


def forward(level: int, text: bytes, _user_data: Any) -> None:
    """llama.cpp's log callback: append to this thread's capture, if any, and log to ``aner_nb.engine``."""
    lines = getattr(_capture, "lines", None)
    if lines is not None and text:
        lines.append(text.decode("utf-8", "replace"))
    # Native warnings are mostly informational for this toolkit (e.g. "n_ctx_seq < n_ctx_train"),
    # so they are demoted one level; real failures surface as return codes, which we check.
    if text and log.isEnabledFor(logging.DEBUG):
        log.log(_LOG_LEVELS.get(level, logging.DEBUG), "%s", text.decode("utf-8", "replace").rstrip("\n"))


@contextlib.contextmanager
def capturing() -> Iterator[list[str]]:
    """Collect the native log lines this thread receives during the ``with`` block."""
    previous = getattr(_capture, "lines", None)
    lines: list[str] = []
    _capture.lines = lines
    try:
        yield lines
    finally:
        _capture.lines = previous


@dataclass(frozen=True)
class KVBuffer:
    """One KV cache of a context as llama.cpp reported allocating it (``llama_kv_cache`` log lines).

    A sliding-window model's context has two: ``kind`` ``"full"`` and
    ``"sliding-window"``; others one ``"full"``. Cells, layers and streams are
    exact; the byte figures are logged in MiB with two decimals, so each is
    within :data:`KV_LOG_RESOLUTION` bytes of the allocation.
    """

    kind: str
    cells: int  # per stream
    layers: int
    streams: int  # 1 unified, else n_seq_max
    type_k: str
    type_v: str
    buffer_bytes: int  # the backend buffers (ggml_backend_buffer_get_size), summed over devices
    k_bytes: int
    v_bytes: int


KV_LOG_RESOLUTION = -(-(2**20) // 200)  # half of the 0.01 MiB llama.cpp prints, rounded up
_MIB = 2**20
_KV_CREATING = re.compile(r"creating\s+(non-SWA|SWA)\s+KV cache")
_KV_BUFFER = re.compile(r"llama_kv_cache:\s+\S+ KV buffer size =\s*([\d.]+) MiB")
_KV_SIZE = re.compile(
    r"llama_kv_cache: size =\s*[\d.]+ MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*\d+/(\d+) seqs\), "
    r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB"
)


def kv_buffers(lines: Sequence[str]) -> tuple[KVBuffer, ...]:
    """The KV caches reported in the native log lines of one context's creation, in order.

    llama.cpp has no C function for a context's KV buffer size; it logs each
    cache's buffers ("CPU KV buffer size = X MiB"), then a summary line with
    cells, layers and streams; an interleaved-SWA model first says which
    cache (non-SWA or SWA) it is creating.
    """
    out: list[KVBuffer] = []
    kind, buffer = "full", 0.0
    for line in lines:
        if m := _KV_CREATING.search(line):
            kind, buffer = ("full" if m.group(1) == "non-SWA" else "sliding-window"), 0.0
        elif m := _KV_BUFFER.search(line):
            buffer += float(m.group(1))
        elif m := _KV_SIZE.search(line):
            cells, layers, streams, tk, k_mib, tv, v_mib = m.groups()
            out.append(KVBuffer(kind, int(cells), int(layers), int(streams), tk, tv, round(buffer * _MIB),
                                round(float(k_mib) * _MIB), round(float(v_mib) * _MIB)))
            kind, buffer = "full", 0.0
    return tuple(out)
