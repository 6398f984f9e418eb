"""llama.cpp's server as the reference for restoring a prefix after a restart: slot save and restore.

The server keeps one slot's KV in a file chosen by the client (``--slot-save-path
DIR``, then ``POST /slots/0?action=save`` / ``?action=restore`` with a file name);
nothing restores a prefix by itself. ``--swa-full`` is passed so a sliding-window
model's slot state is whole (without it the restored slot's window is missing and
the next request re-evaluates everything: the issue measured ``cache_n`` 0).
``--flash-attn off`` gives the server the attention kernel of our prefix-cache
leases (``bench_prefix``'s docstring).
"""

from __future__ import annotations

import subprocess
import time

import httpx
from bench_llama_server import start_server, stream_completion


def start(binary: str, model: str, *, context: int, threads: int, slot_dir: str) -> tuple[subprocess.Popen, str]:
    """One slot, prompt cache on, the given threads for prompt and decode, slots saved under ``slot_dir``."""
    return start_server(binary, model, 1, context, threads, cache_prompt=True,
                        extra=("--swa-full", "--flash-attn", "off", "--slot-save-path", slot_dir))


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def text_prompt(client: httpx.Client, url: str, text: str, tokens: list[int]) -> "str | list[int]":
    """``text`` (the rendered prompt) if the server tokenizes it to exactly ``tokens``, else ``tokens``.

    The measured request then sends text, as a client does, so the server's
    tokenization is in its figure as ours is in ours. ``/completion`` adds the
    model's BOS itself, so a render that starts with it is also tried without.
    """
    body = {"add_special": True, "parse_special": True}
    for candidate in (text, *_without_bos(client, url, text, tokens)):
        r = client.post(f"{url}/tokenize", json={"content": candidate, **body}, timeout=60)
        r.raise_for_status()
        if r.json().get("tokens") == tokens:
            return candidate
    print("llama-server: the rendered text does not tokenize to our ids there; sending the ids", flush=True)
    return tokens


def _without_bos(client: httpx.Client, url: str, text: str, tokens: list[int]) -> list[str]:
    if not tokens:
        return []
    r = client.post(f"{url}/detokenize", json={"tokens": tokens[:1]}, timeout=60)
    r.raise_for_status()
    piece = r.json().get("content", "")
    return [text[len(piece):]] if piece and text.startswith(piece) else []


def ask(client: httpx.Client, url: str, tokens: "list[int] | str", n_predict: int) -> dict:
    """One streamed greedy ``/completion`` with the prompt cache on: first-token ms, tokens, the server's timings."""
    timings: dict = {}
    first, out = stream_completion(client, url, tokens, n_predict, timings)
    return {"first_token_ms": 1000.0 * first, "tokens": tuple(out), "cache_n": int(timings.get("cache_n", -1)),
            "prompt_n": int(timings.get("prompt_n", -1)), "prompt_ms": float(timings.get("prompt_ms", -1.0))}


def slot(client: httpx.Client, url: str, action: str, filename: str) -> dict:
    """``POST /slots/0?action=save|restore``; the server's answer (``n_saved`` / ``n_restored``, bytes, ms)."""
    r = client.post(f"{url}/slots/0", params={"action": action}, json={"filename": filename}, timeout=600)
    r.raise_for_status()
    return r.json()


def fill(binary: str, model: str, prompts: dict[str, list[int]], *, context: int, threads: int, slot_dir: str,
         n_predict: int) -> None:
    """Answer each prompt once on a fresh server and save its slot as ``NAME.bin``; then stop the server."""
    proc, url = start(binary, model, context=context, threads=threads, slot_dir=slot_dir)
    try:
        with httpx.Client() as client:
            for name, tokens in prompts.items():
                ask(client, url, tokens, n_predict)
                saved = slot(client, url, "save", f"{name}.bin")
                print(f"llama-server saved {name}: {saved.get('n_saved')} tokens, {saved.get('n_written'):,} bytes",
                      flush=True)
    finally:
        stop(proc)


def restore_and_ask(client: httpx.Client, url: str, name: str, prompt: "list[int] | str", n_predict: int) -> dict:
    """Restore ``NAME.bin`` into slot 0, then the request (``prompt``: ids, or text from :func:`text_prompt`):
    restore + first token as the client waits for them."""
    t0 = time.perf_counter()
    restored = slot(client, url, "restore", f"{name}.bin")
    restore_ms = 1000.0 * (time.perf_counter() - t0)
    row = ask(client, url, prompt, n_predict)
    row["restore_ms"] = restore_ms
    row["request_first_token_ms"] = row["first_token_ms"]
    row["first_token_ms"] = restore_ms + row["first_token_ms"]
    row["restored_tokens"] = int(restored.get("n_restored", -1))
    return row
