"""The CPU probe's child: ``python -m aner_nb.llm._probe_child MODEL on|off``.

Loads ``MODEL`` with or without CPU extra buffer types, evaluates a 32-token
prompt (a batch wide enough for AMX tiles) and one single-token decode, and
exits 0. If the build or the CPU cannot execute what that takes, this process
dies by a signal, which is the answer the parent (``cpu_guard``) wants.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    model_path, mode = argv
    from aner_nb.llm import _engine

    print(f"system_info={_engine.system_info()}", flush=True)
    model = _engine.NativeModel(model_path, extra_buffers=mode == "on")
    ctx = _engine.NativeContext(model, _engine.ContextParams(n_ctx=64, n_batch=32, n_ubatch=32))
    batch = _engine.Batch(32)
    batch.add_run(list(range(2, 34)), 0, logits_last=True)
    if ctx.decode(batch) != _engine.DECODE_OK:
        return 3
    token = ctx.greedy(batch.n_tokens - 1)
    batch.clear()
    batch.add(token, 32, logits=True)
    if ctx.decode(batch) != _engine.DECODE_OK:
        return 3
    ctx.greedy(0)
    ctx.free()
    model.free()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
