"""``load()``: admission, device choice, hashing, the native load and its warm-up.

Order matters: the GGUF header is inspected and every setting validated
before llama.cpp parses the file; the first SHA-256 pass runs on a thread
while llama.cpp maps the weights (both release the GIL), and the second pass
runs once the weights are resident, so a file that changed while loading is
caught (``ArtifactChangedError``) without doubling the load time. Then one
short warm-up decode pays the page-in and backend start-up that the first
request would otherwise report as its prefill. Each phase is timed in the
``LoadSummary``; each long one can show a progress bar (``progress=``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from . import _engine, cpu_guard
from .catalog import resolve_model
from .artifact import ModelFacts, inspect_model, sha256_file
from .chat import ChatTemplate, resolve_template
from .errors import ArtifactChangedError, ConfigurationError, DeviceUnavailableError, EngineError
from .lease import LLMModel
from .memory import kv_row_bytes
from .profiles import CPU_EXTRA_BUFFERS, FLASH_ATTENTION, LoadSettings, Profile, choice_or_env, parse_device
from .progress import progress_bar
from .requests import context_params
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
    warmup: bool = True,
) -> LLMModel:
    """Admit, hash and load a single-file GGUF text model; returns a new lease.

    ``path`` is a file, or the name of a model :func:`~aner_nb.llm.models` lists
    (an exact name, or a unique part of one; see :mod:`aner_nb.llm.catalog`).

    ``cpu_extra_buffers`` (``auto``/``on``/``off``; default ``$ANER_NB_CPU_EXTRA_BUFFERS``
    or ``auto``) decides whether quantized weights may use llama.cpp's AMX/repack
    buffer types; ``auto`` trusts them only after a probe child survived them
    (see ``cpu_guard``). ``flash_attention`` defaults to ``$ANER_NB_FLASH_ATTENTION``
    or ``auto``.

    ``progress`` shows ``tqdm.auto`` bars for the first hash pass, the native load
    and the second hash pass: ``True`` always, ``False`` never, ``None`` (default)
    when interactive: a widget bar in Jupyter, a text bar on a terminal, none in a
    script whose stderr is not a terminal (see :mod:`aner_nb.llm.progress`).

    ``warmup`` (default True) decodes one token on a throwaway context of this
    load's settings once the weights are verified, as llama.cpp's own tools do:
    the weights' pages come in and the backend initialises there, so the first
    request's timings describe the request. ``load_summary().warmup_duration``
    times it (``-1`` with ``warmup=False``).
    """
    t_start = time.perf_counter_ns()
    settings = LoadSettings(
        context=context, device=device, kv_cache_type=kv_cache_type,
        flash_attention=choice_or_env(flash_attention, FLASH_ATTENTION_ENV, FLASH_ATTENTION, "auto"),
        chat_template=chat_template,
        cpu_extra_buffers=choice_or_env(cpu_extra_buffers, cpu_guard.ENV_VAR, CPU_EXTRA_BUFFERS, "auto"),
    )
    if not isinstance(warmup, bool):
        raise ConfigurationError(f"warmup must be True or False, got {warmup!r}")
    facts, template = _admit(path, settings)
    # Before this process touches the engine: a build that cannot run here fails a child, not us.
    extra = cpu_guard.resolve_extra_buffers(settings.cpu_extra_buffers)
    device_name, n_gpu_layers = resolve_device(settings.device)
    native, first = _hash_while_loading(facts.path, facts.file_size, n_gpu_layers, extra.use, progress)
    try:
        summary = _verify(facts, first, extra, progress, t_start)
        weights = SharedWeights(native, facts, template, settings, device_name, summary)
        if warmup:
            warm_ns = _warm_up(native, context_params(weights, Profile()))
            weights.summary = replace(summary, warmup_duration=warm_ns, total_duration=time.perf_counter_ns() - t_start)
        return LLMModel(weights)
    except BaseException:
        native.free()
        raise


def _admit(path: "str | os.PathLike[str]", settings: LoadSettings) -> tuple[ModelFacts, ChatTemplate]:
    """The model's facts and its checked template, before llama.cpp reads the file."""
    path = resolve_model(path)  # a name from llm.models() ("SmolLM2", "qwen2.5:0.5b") becomes its file
    facts = inspect_model(path)
    if settings.context > facts.context_length:
        raise ConfigurationError(
            f"context={settings.context} is above the model's declared context of {facts.context_length} "
            f"tokens; use 1..{facts.context_length}",
            param="context",
        )
    _check_kv_rows(facts.head_dim_k, facts.head_dim_v, settings.kv_cache_type)
    template = resolve_template(
        settings.chat_template, facts.chat_template,
        bos_token=facts.bos_token or "", eos_token=facts.eos_token or "", model_name=facts.name,
        architecture=facts.architecture,
    )
    # An embedded template is untrusted code: render one plain turn (bounded in time and size) before
    # llama.cpp reads the file, so a hostile or broken one is refused here, not at the first request.
    template.render([{"role": "user", "content": "Hello"}])
    return facts, template


def _verify(
    facts: ModelFacts, first: _FirstPass, extra: cpu_guard.ExtraBuffers, progress: bool | None, t_start: int
) -> LoadSummary:
    """Hash the file a second time (it must not have changed while loading); the load's summary."""
    t1 = time.perf_counter_ns()
    second = sha256_file(facts.path, progress=progress)
    verify_ns = time.perf_counter_ns() - t1
    if second != first.digest:
        raise ArtifactChangedError(
            f"{os.path.basename(facts.path)} changed while loading: sha256 {first.digest[:16]}... "
            f"before, {second[:16]}... after; the loaded weights were discarded"
        )
    return LoadSummary(
        fingerprint=second,
        file_bytes=facts.file_size,
        hash_duration=first.hash_ns,
        load_duration=first.load_ns,
        verify_duration=verify_ns,
        warmup_duration=-1,
        total_duration=time.perf_counter_ns() - t_start,
        cpu_extra_buffers="on" if extra.use else "off",
        cpu_extra_buffers_reason=extra.reason + (" (cached verdict)" if extra.cached else ""),
    )


@dataclass(frozen=True)
class _FirstPass:
    digest: str
    hash_ns: int
    load_ns: int


def _hash_while_loading(
    path: str, size: int, n_gpu_layers: int, extra_buffers: bool, progress: bool | None
) -> tuple[_engine.NativeModel, _FirstPass]:
    """The native load on this thread while the first SHA-256 pass runs on another (both release the GIL).

    Both bars are opened here, hash first, so a notebook shows them in a fixed order. Ctrl-C
    during the load arrives in the progress callback: it aborts llama.cpp's load and is raised
    once the engine has returned, without waiting for the hash pass.
    """
    name = os.path.basename(path)
    first: dict[str, Any] = {}
    interrupted: list[BaseException] = []
    with progress_bar(progress, total=size, desc=f"sha256 {name}", unit="B", unit_scale=True,
                      unit_divisor=1024) as hash_bar, \
            progress_bar(progress, total=100, desc=f"load {name}", bar_format=_LOAD_BAR) as load_bar:

        def hash_first_pass() -> None:
            t0 = time.perf_counter_ns()
            try:
                first["digest"] = sha256_file(path, progress=hash_bar)
            except BaseException as exc:  # surfaced on the caller's thread
                first["error"] = exc
            first["ns"] = time.perf_counter_ns() - t0

        def on_progress(fraction: float) -> bool:
            try:
                load_bar.update(max(0, round(fraction * 100) - load_bar.n))
                return True
            except BaseException as exc:  # a KeyboardInterrupt: stop llama.cpp, raise it below
                interrupted.append(exc)
                return False

        hasher = threading.Thread(target=hash_first_pass, name="aner-sha256", daemon=True)
        hasher.start()
        t0 = time.perf_counter_ns()
        try:
            native = _engine.NativeModel(path, n_gpu_layers=n_gpu_layers, extra_buffers=extra_buffers,
                                         progress=on_progress)
        except EngineError:
            if interrupted:
                raise interrupted[0] from None
            raise
        load_ns = time.perf_counter_ns() - t0
        try:
            hasher.join()
            if "error" in first:
                raise first["error"]
        except BaseException:
            native.free()
            raise
    return native, _FirstPass(first["digest"], first["ns"], load_ns)


# The load bar counts percent: no rate or count, just how far and how long.
_LOAD_BAR = "{l_bar}{bar}| [{elapsed}<{remaining}]"


def _warm_up(native: _engine.NativeModel, params: _engine.ContextParams) -> int:
    """Decode one token (BOS, else EOS, else id 0) on a throwaway context of ``params``; returns the ns it took.

    Reading the logits waits for an asynchronous backend to finish. The context and
    batch are freed before returning, so no lease ever sees this KV.
    """
    t0 = time.perf_counter_ns()
    ctx = _engine.NativeContext(native, params)
    batch = _engine.Batch(1)
    try:
        token = next((t for t in (native.bos, native.eos) if t >= 0), 0)
        batch.add(token, 0, logits=True)
        ctx.decode(batch)
        ctx.greedy(0)
    finally:
        batch.free()
        ctx.free()
    return time.perf_counter_ns() - t0


def _check_kv_rows(head_dim_k: int, head_dim_v: int, kv_cache_type: str) -> None:
    """A quantized KV cache stores each head's row in whole blocks (32 elements): refuse heads that are not."""
    for which, dim in (("K", head_dim_k), ("V", head_dim_v)):
        try:
            kv_row_bytes(dim, kv_cache_type)
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"kv_cache_type={kv_cache_type!r} cannot store this model's {which} heads: {exc}; "
                "use kv_cache_type='f16'",
                param="kv_cache_type",
            ) from None
