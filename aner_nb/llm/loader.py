"""``load()``: admission, device choice, hashing and the native load.

Order matters: the GGUF header is inspected and every setting validated
before llama.cpp parses the file; the first SHA-256 pass runs on a thread
while llama.cpp maps the weights (both release the GIL), and the second pass
runs once the weights are resident, so a file that changed while loading is
caught (``ArtifactChangedError``) without doubling the load time.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from . import _engine, cpu_guard
from .artifact import inspect_model, sha256_file
from .chat import resolve_template
from .errors import ArtifactChangedError, ConfigurationError, DeviceUnavailableError
from .lease import LLMModel
from .profiles import CPU_EXTRA_BUFFERS, FLASH_ATTENTION, LoadSettings, choice_or_env, parse_device
from .weights import LoadSummary, SharedWeights

__all__ = ["load", "resolve_device", "native_available", "FLASH_ATTENTION_ENV"]

FLASH_ATTENTION_ENV = "ANER_NB_FLASH_ATTENTION"  # the default of load(flash_attention=...)

native_available = _engine.native_available


def resolve_device(device: str) -> tuple[str, int]:
    """Map a requested device to (name, n_gpu_layers); explicit devices never fall back."""
    kind, index = parse_device(device)
    if kind == "cpu":
        return "cpu", 0
    accelerator = _engine.accelerator_kind()
    if kind == "auto":
        return (accelerator, -1) if accelerator else ("cpu", 0)
    if kind == "metal" and sys.platform != "darwin":
        raise DeviceUnavailableError(f"device={device!r} needs macOS with Metal; available here: cpu" + (
            f", {accelerator}" if accelerator else ""))
    if accelerator != kind:
        raise DeviceUnavailableError(
            f"device={device!r} is not available in this llama-cpp-python build "
            f"(available: {', '.join(['cpu'] + ([accelerator] if accelerator else []))}); "
            "use device='cpu' or 'auto', or install a build with that backend"
        )
    if kind == "cuda" and index != 0:
        raise DeviceUnavailableError(f"device={device!r}: only cuda:0 is supported by this toolkit for now")
    return kind, -1


def load(
    path: "str | os.PathLike[str]",
    *,
    context: int = 4096,
    device: str = "auto",
    kv_cache_type: str = "f16",
    flash_attention: str | None = None,
    chat_template: str | None = None,
    cpu_extra_buffers: str | None = None,
    progress: bool | None = None,
) -> LLMModel:
    """Admit, hash and load a single-file GGUF text model; returns a new lease.

    ``cpu_extra_buffers`` (``auto``/``on``/``off``; default ``$ANER_NB_CPU_EXTRA_BUFFERS``
    or ``auto``) decides whether quantized weights may use llama.cpp's AMX/repack
    buffer types; ``auto`` trusts them only after a probe child survived them
    (see ``cpu_guard``). ``flash_attention`` defaults to ``$ANER_NB_FLASH_ATTENTION``
    or ``auto``. ``progress`` shows a tqdm bar for the hash passes
    (``None``: on a terminal only).
    """
    t_start = time.perf_counter_ns()
    settings = LoadSettings(
        context=context, device=device, kv_cache_type=kv_cache_type,
        flash_attention=choice_or_env(flash_attention, FLASH_ATTENTION_ENV, FLASH_ATTENTION, "auto"),
        chat_template=chat_template,
        cpu_extra_buffers=choice_or_env(cpu_extra_buffers, cpu_guard.ENV_VAR, CPU_EXTRA_BUFFERS, "auto"),
    )
    facts = inspect_model(path)
    if settings.context > facts.context_length:
        raise ConfigurationError(
            f"context={settings.context} is above the model's declared context of {facts.context_length} "
            f"tokens; use 1..{facts.context_length}"
        )
    template = resolve_template(
        settings.chat_template, facts.chat_template,
        bos_token=facts.bos_token or "", eos_token=facts.eos_token or "", model_name=facts.name,
    )
    # Before this process touches the engine: a build that cannot run here fails a child, not us.
    extra = cpu_guard.resolve_extra_buffers(settings.cpu_extra_buffers)
    device_name, n_gpu_layers = resolve_device(settings.device)

    first: dict[str, Any] = {}

    def hash_first_pass() -> None:
        t0 = time.perf_counter_ns()
        try:
            first["digest"] = sha256_file(facts.path, progress=progress)
        except BaseException as exc:  # surfaced on the caller's thread
            first["error"] = exc
        first["ns"] = time.perf_counter_ns() - t0

    hasher = threading.Thread(target=hash_first_pass, name="aner-sha256", daemon=True)
    hasher.start()
    t0 = time.perf_counter_ns()
    try:
        native = _engine.NativeModel(facts.path, n_gpu_layers=n_gpu_layers, extra_buffers=extra.use)
    finally:
        hasher.join()
    load_ns = time.perf_counter_ns() - t0
    try:
        if "error" in first:
            raise first["error"]
        t1 = time.perf_counter_ns()
        second = sha256_file(facts.path, progress=progress)
        verify_ns = time.perf_counter_ns() - t1
        if second != first["digest"]:
            raise ArtifactChangedError(
                f"{os.path.basename(facts.path)} changed while loading: sha256 {first['digest'][:16]}... "
                f"before, {second[:16]}... after; the loaded weights were discarded"
            )
    except BaseException:
        native.free()
        raise
    summary = LoadSummary(
        fingerprint=second,
        file_bytes=facts.file_size,
        hash_duration=first["ns"],
        load_duration=load_ns,
        verify_duration=verify_ns,
        total_duration=time.perf_counter_ns() - t_start,
        cpu_extra_buffers="on" if extra.use else "off",
        cpu_extra_buffers_reason=extra.reason + (" (cached verdict)" if extra.cached else ""),
    )
    weights = SharedWeights(native, facts, template, settings, device_name, summary)
    try:
        return LLMModel(weights)
    except BaseException:
        native.free()
        raise
