"""The only module that imports ``llama_cpp``: thin, typed owners of native handles.

Each class here owns exactly one kind of native object (model, LoRA adapter, context,
batch, sampler chain) and frees it exactly once, either explicitly or from a
``weakref.finalize``. Policy (what to evaluate, what to keep) lives elsewhere;
this module only translates between Python values and the C API of the pinned
llama-cpp-python 0.3.36.

Tests can arm faults at these calls (``faults.inject``, ``faults.Fault``): a failed
or refused decode, a tokenizer or free failure, a file changed around the load.
The seam lives in ``faults.py``; this module mirrors the armed injection in
``_faults`` (None by default), so each call pays one global lookup. llama.cpp's
log lines are forwarded, captured and parsed by ``engine_log.py``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from . import engine_log, faults
from .engine_log import KV_LOG_RESOLUTION, KVBuffer, kv_buffers
from .errors import ConfigurationError, EngineError, InvalidRequestError, NativeUnavailableError
from .faults import NO_FAULT as _NO_FAULT, Injection
from .reuse import ReuseShape

__all__ = [
    "native_available",
    "supports_gpu_offload",
    "accelerator_kind",
    "system_info",
    "engine_build",
    "build_flags",
    "default_threads",
    "release_compute_threads",
    "pairs_batch_columns",
    "ContextParams",
    "NativeModel",
    "single_device",
    "NativeContext",
    "KVBuffer",
    "KV_LOG_RESOLUTION",
    "kv_buffers",
    "NativeAdapter",
    "Batch",
    "Sampler",
    "SamplerChain",
    "GrammarError",
    "check_grammar",
    "json_schema_grammar",
    "DECODE_OK",
    "DECODE_NO_KV_SLOT",
]

log = logging.getLogger("aner_nb.engine")

DECODE_OK = 0
DECODE_NO_KV_SLOT = 1  # llama_decode: no KV slot for this batch; a smaller one may fit

_init_lock = threading.Lock()
_lib: Any = None
_lib_error: BaseException | None = None
_log_callback: Any = None  # must outlive every native call that may log


def _llama() -> Any:
    """Import llama_cpp once, initialise the backend and route native logs to ``logging``."""
    global _lib, _lib_error, _log_callback
    if _lib is not None:
        return _lib
    with _init_lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise NativeUnavailableError(f"llama-cpp-python is not usable: {_lib_error}") from _lib_error
        try:
            import llama_cpp as lib  # noqa: PLC0415 - imported lazily so `import aner_nb` stays cheap

            lib.llama_backend_init()
        except Exception as exc:  # ImportError, OSError from the shared library
            _lib_error = exc
            raise NativeUnavailableError(f"llama-cpp-python is not usable: {exc}") from exc
        _log_callback = lib.llama_log_callback(engine_log.forward)
        lib.llama_log_set(_log_callback, ctypes.c_void_p(0))
        _lib = lib
        return lib


def native_available() -> bool:
    """True when llama-cpp-python imports and its shared library initialises."""
    try:
        _llama()
    except NativeUnavailableError:
        return False
    return True


def supports_gpu_offload() -> bool:
    return bool(_llama().llama_supports_gpu_offload())


def system_info() -> str:
    return _llama().llama_print_system_info().decode("utf-8", "replace")


def engine_build() -> str:
    """This engine's build: llama-cpp-python's version and ggml's version and commit.

    Saved KV state is only valid on the build that wrote it (the state format and
    kernels change between releases), so ``kv_identity`` stamps files with it.
    """
    global _build
    if _build is not None:
        return _build
    lib = _llama()
    parts = [f"llama-cpp-python {getattr(lib, '__version__', '?')}"]
    native = getattr(getattr(lib, "llama_cpp", None), "_lib", None)
    for name in ("ggml_version", "ggml_commit"):
        try:
            fn = getattr(native, name)
            fn.restype = ctypes.c_char_p
            fn.argtypes = []
            parts.append(f"{name.removeprefix('ggml_')} {fn().decode('utf-8', 'replace')}")
        except (AttributeError, TypeError, OSError):
            parts.append(f"{name.removeprefix('ggml_')} ?")
    _build = "; ".join(parts)
    return _build


_build: str | None = None


def accelerator_kind() -> str | None:
    """``"cuda"``, ``"metal"``, another backend name in lower case, or None for a CPU-only build."""
    if not supports_gpu_offload():
        return None
    info = system_info().upper()
    for name in ("CUDA", "METAL", "VULKAN", "HIP", "SYCL"):
        if f"{name} :" in info or f"{name}:" in info or name in info:
            return name.lower()
    return "gpu"


# Weight types ggml-cpu multiplies with llamafile's tinyBLAS "Q0" kernels on x86.
_TINYBLAS_Q0_TYPES = frozenset({"Q8_0", "Q4_0", "Q5_0", "IQ4_NL"})


def pairs_batch_columns(weight_type: str | None, info: str | None = None) -> bool:
    """Whether this CPU build multiplies ``weight_type`` weights two batch columns at a time.

    ggml-cpu hands matmuls of two or more batch columns (logits rows, for the
    output layer) to llamafile's tinyBLAS. On x86 with 16 vector registers
    (AVX2, no AVX-512) its Q0 kernels tile 4 weight rows by 2 columns; with an
    odd column count >= 3 the last column gets a pass of its own over the
    whole weight matrix. For a vocabulary-sized output matrix (demo model: 262k
    x 640 Q8_0, 178 MB) that extra pass costs about a one-row decode: 3
    logits rows took 75.6 ms per step, 4 rows 56.1 ms. ``info`` defaults to
    llama.cpp's system info string of this build.
    """
    if weight_type not in _TINYBLAS_Q0_TYPES:
        return False
    on = build_flags(info)
    return {"AVX2", "LLAMAFILE"} <= on and not any(flag.startswith("AVX512") for flag in on)


def build_flags(info: str | None = None) -> frozenset[str]:
    """The flags set to 1 in llama.cpp's system info string (``info``, default this build's)."""
    # "CPU : SSE3 = 1 | AVX2 = 1 | ... | LLAMAFILE = 1 |": a backend name prefixes its first flag.
    parts = (part.partition("=") for part in (info or system_info()).split("|"))
    return frozenset(key.rpartition(":")[2].strip() for key, _, value in parts if value.strip() == "1")


THREADS_ENV = "ANER_NB_THREADS"


def default_threads() -> tuple[int, int]:
    """The engine default used when a profile says ``threads=0``: ``(decode, prefill)``.

    llama.cpp's own tools' rule: physical cores for one-token decode (a
    second hyperthread on a core adds nothing to a memory-bound matrix-vector
    product), logical CPUs for multi-token batches (``n_threads_batch``).
    ``$ANER_NB_THREADS`` (``N`` or ``DECODE,PREFILL``) replaces the rule, e.g.
    to re-run a notebook at another thread count.
    """
    override = os.environ.get(THREADS_ENV, "").strip()
    if override:
        parts = override.split(",")
        if len(parts) in (1, 2) and all(p.strip().isdigit() and 1 <= int(p) <= 1024 for p in parts):
            values = [int(p) for p in parts]
            return values[0], values[-1]
        raise ConfigurationError(
            f"${THREADS_ENV} must be N or DECODE,PREFILL with integers 1..1024, got {override!r}"
        )
    import psutil  # noqa: PLC0415 - only this rule needs it

    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or logical
    return max(min(physical, logical), 1), logical


# Engine fact: a llama.cpp CPU build with OpenMP (the default where the compiler has it) runs each graph
# on an OpenMP team of the thread that called llama_decode, and the runtime keeps that team's workers for
# the thread's next graph. libgomp counts the workers of every thread's team, and while they outnumber
# the CPUs it stops each worker spinning for new work almost at once (its "throttled" spin count), so
# every graph start waits for a woken thread. On 2 vCPUs a context decoded on a scheduler thread, while
# the notebook's main thread kept the team of an earlier request, ran at 0.75-0.85x of the same context
# on the main thread; freeing the idle team restored it (benchmarks/RESULTS.md, "OpenMP teams").
_OPENMP_RUNTIMES = ("libgomp.so.1", "libomp.so.5", "libomp.so", "libiomp5.so", "libomp.dylib", "libiomp5md.dll")
_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_hard (free the threads and their state)
_openmp_pause: Any = None


def _openmp_pause_fn() -> Any:
    """``omp_pause_resource_all`` of the OpenMP runtime the engine already loaded, or False (none, or too old)."""
    global _openmp_pause
    if _openmp_pause is None:
        _llama()  # the runtime is loaded with the engine's CPU backend, if the build uses one
        found: Any = False
        no_load = getattr(os, "RTLD_NOLOAD", 0)
        for name in _OPENMP_RUNTIMES if no_load else ():
            try:  # RTLD_NOLOAD: bind to a runtime already in the process, never load one
                lib = ctypes.CDLL(name, mode=no_load | getattr(os, "RTLD_LAZY", 1))
            except OSError:
                continue
            fn = getattr(lib, "omp_pause_resource_all", None)  # OpenMP 5.0 (libgomp of GCC 9+, LLVM libomp)
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                found = fn
                break
        _openmp_pause = found
    return _openmp_pause


def release_compute_threads() -> bool:
    """Free the calling thread's idle OpenMP workers (see the engine fact above); True when a runtime did.

    Called when a thread stops decoding for now: it frees a context (a load's
    warm-up, a row-cost probe, embeddings: :meth:`NativeContext.free`), a
    request on a kept context ends, a scheduler goes idle. The thread's next
    decode starts a new team, once, instead of every other thread's decodes
    paying for an idle one. A no-op without an OpenMP runtime, and refused by
    the runtime inside a parallel region.
    """
    fn = _openmp_pause_fn()
    return bool(fn) and fn(_OMP_PAUSE_HARD) == 0


_KV_TYPES = {"f16": "GGML_TYPE_F16", "q8_0": "GGML_TYPE_Q8_0", "q4_0": "GGML_TYPE_Q4_0"}
_FLASH = {"auto": "LLAMA_FLASH_ATTN_TYPE_AUTO", "on": "LLAMA_FLASH_ATTN_TYPE_ENABLED", "off": "LLAMA_FLASH_ATTN_TYPE_DISABLED"}
_POOLING = {"unspecified": "LLAMA_POOLING_TYPE_UNSPECIFIED", "none": "LLAMA_POOLING_TYPE_NONE",
            "mean": "LLAMA_POOLING_TYPE_MEAN", "cls": "LLAMA_POOLING_TYPE_CLS", "last": "LLAMA_POOLING_TYPE_LAST"}


@dataclass(frozen=True)
class ContextParams:
    """Everything a context is created with; set explicitly, never left to library defaults."""

    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int = 1
    n_threads: int = 1
    n_threads_batch: int = 1
    kv_cache_type: str = "f16"
    flash_attention: str = "auto"
    # Sliding-window models keep only the window in their SWA cache unless swa_full
    # is set; a partial seq_rm below the window then fails (llama_memory_seq_rm -> False).
    swa_full: bool = False
    kv_unified: bool = True
    offload: bool = False  # KV and host ops on the accelerator (GPU devices only)
    # The LoRA adapter every context created with these params applies (one per context, scale 1).
    adapter: "NativeAdapter | None" = field(default=None, repr=False)
    # An embedding context (llama.cpp's embeddings=True) pools each sequence's hidden states this way.
    embeddings: bool = False
    pooling: str = "unspecified"
    # Not a llama.cpp parameter: the context serves a prefix cache, with the model's reuse shape (reuse.py);
    # every prefill then evaluates a prompt's tail as a llama_decode call of its own (runner.prefill_chunks).
    prefix_reuse: ReuseShape | None = None
    # Not a llama.cpp parameter: a one-sequence context whose saved states hold every cell of sequence 0,
    # also those its sliding window no longer sees (NativeContext.seq_state_bytes).
    saves_all_cells: bool = False


# -- test seam (faults.py): the armed Injection, mirrored here so a disarmed seam costs one global lookup --
_faults: Injection | None = None


def _mirror_faults(injection: Injection | None) -> None:
    global _faults
    _faults = injection


faults.mirror(_mirror_faults)


def _fault(point: str, subject: Any, *args: Any) -> Any:
    """The armed fault's result for this call, or ``_NO_FAULT`` to make the engine call as usual."""
    injection = _faults
    return _NO_FAULT if injection is None else injection.fire(point, subject, *args)


class _Owner:
    """Frees one native pointer exactly once, explicitly or when garbage collected."""

    def __init__(self, ptr: Any, free_fn: Any, what: str) -> None:
        self._ptr = ptr
        self._what = what
        self._finalizer = weakref.finalize(self, _free_once, free_fn, ptr, what)
        self._finalizer.atexit = True
        injection = _faults
        if injection is not None:
            injection.track(self)

    @property
    def ptr(self) -> Any:
        if not self._finalizer.alive:
            raise EngineError(f"{self._what} was already freed")
        return self._ptr

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def free(self) -> bool:
        """Free now; returns True if this call released the handle."""
        if _faults is not None and self._finalizer.alive:
            _fault("free", self)
        return self._finalizer() is not None


def _free_once(free_fn: Any, ptr: Any, what: str) -> bool:
    free_fn(ptr)
    log.debug("freed %s", what)
    return True


def single_device(n_gpu_layers: int, index: int = 0) -> tuple[str, int]:
    """``(split_mode, main_gpu)`` a model is loaded with: one device, never a split across GPUs.

    llama.cpp's default (``LLAMA_SPLIT_MODE_LAYER``) spreads the layers over every visible
    GPU; the toolkit asks for one accelerator explicitly (``main_gpu=index``), and on the
    CPU (``n_gpu_layers == 0``) for none at all (``main_gpu=-1`` empties the device list).
    """
    return "LLAMA_SPLIT_MODE_NONE", (index if n_gpu_layers != 0 else -1)


class NativeModel(_Owner):
    """A loaded ``llama_model`` plus its vocabulary; contexts are freed before it."""

    def __init__(
        self,
        path: str,
        *,
        n_gpu_layers: int = 0,
        use_mmap: bool = True,
        extra_buffers: bool = True,
        progress: "Callable[[float], bool] | None" = None,
    ) -> None:
        """Load the weights; ``progress(fraction)`` is called on this thread as they load
        (0.0..1.0) and aborts the load (an EngineError) by returning False."""
        lib = _llama()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        # CPU "extra" buffer types repack quantized weights for AMX tiles or wider SIMD at load;
        # their kernels run at the first decode. Off keeps plain CPU buffers (cpu_guard decides).
        params.use_extra_bufts = bool(extra_buffers)
        params.load_mode = lib.LLAMA_LOAD_MODE_MMAP if use_mmap else lib.LLAMA_LOAD_MODE_NONE
        params.check_tensors = False
        split_mode, main_gpu = single_device(n_gpu_layers)
        params.split_mode, params.main_gpu = getattr(lib, split_mode), main_gpu
        placement = (int(params.split_mode), int(params.main_gpu))  # as llama.cpp was asked
        callback = None
        if progress is not None:  # the ctypes callback must outlive the call that uses it
            callback = lib.llama_progress_callback(lambda value, _user_data: bool(progress(float(value))))
            params.progress_callback = callback
        if _faults is not None:
            _fault("model_load", path)
        ptr = lib.llama_model_load_from_file(os.fsencode(path), params)
        del callback
        if not ptr:
            raise EngineError(f"llama.cpp failed to load {os.path.basename(path)!r} (see the aner_nb.engine log)")
        self._lib = lib
        self.placement = placement
        self._contexts: "weakref.WeakSet[NativeContext]" = weakref.WeakSet()
        self._adapters: "weakref.WeakSet[NativeAdapter]" = weakref.WeakSet()
        self._ctx_lock = threading.Lock()
        super().__init__(ptr, lib.llama_model_free, f"model {os.path.basename(path)}")
        self.free_calls = 0  # counts releases that actually freed the weights (tests use it)
        self.vocab = lib.llama_model_get_vocab(ptr)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        # Token attributes never change after load; a prompt's check asks for each of its tokens (a ctypes
        # call each), so answers are memoised here, at most one per vocabulary entry.
        self._parsed_special: dict[int, bool] = {}
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(ptr))
        self.n_swa = int(lib.llama_model_n_swa(ptr))
        self.size_bytes = int(lib.llama_model_size(ptr))
        self.n_params = int(lib.llama_model_n_params(ptr))
        self.bos = int(lib.llama_vocab_bos(self.vocab))
        self.eos = int(lib.llama_vocab_eos(self.vocab))
        self.n_embd = int(lib.llama_model_n_embd_out(ptr))  # the width of a pooled embedding
        if _faults is not None:
            try:
                _fault("model_loaded", self)
            except BaseException:
                self.free()
                raise

    def free(self) -> bool:
        with self._ctx_lock:
            contexts = list(self._contexts)
            adapters = list(self._adapters)
        for ctx in contexts:  # contexts reference the model and its adapters: free them first
            ctx.free()
        # llama_model_free also deletes the adapters still attached to the model, so a later
        # llama_adapter_lora_free would be a double free: release them here, before the model.
        for adapter in adapters:
            adapter.free()
        released = super().free()
        if released:
            self.free_calls += 1
        return released

    def _register(self, ctx: "NativeContext") -> None:
        with self._ctx_lock:
            self._contexts.add(ctx)

    def _register_adapter(self, adapter: "NativeAdapter") -> None:
        with self._ctx_lock:
            self._adapters.add(adapter)

    def live_adapters(self) -> int:
        with self._ctx_lock:
            return sum(1 for a in self._adapters if a.alive)

    def live_contexts(self) -> int:
        with self._ctx_lock:
            return sum(1 for c in self._contexts if c.alive)

    def contexts(self) -> "list[NativeContext]":
        """The live contexts on this model (every lease's, session's and batching lease's)."""
        with self._ctx_lock:
            return [c for c in self._contexts if c.alive]

    # -- vocabulary -------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Text to token ids. Chat prompts carry their own BOS, so add_special is off by default."""
        if _faults is not None:
            _fault("tokenize", self, text)
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate (a JSON "\ud800", bytes decoded with surrogateescape)
            raise InvalidRequestError(
                f"the text is not valid Unicode: it holds a lone surrogate ({text[exc.start]!r}); "
                "only text that encodes as UTF-8 can be tokenized") from None
        lib, vocab = self._lib, self.vocab
        capacity = len(data) + 8
        buf = (lib.llama_token * capacity)()
        n = lib.llama_tokenize(vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:  # negative: the number of tokens that would have been returned
            capacity = -n
            buf = (lib.llama_token * capacity)()
            n = lib.llama_tokenize(vocab, data, len(data), buf, capacity, add_special, parse_special)
            if n < 0:
                raise EngineError(f"tokenization failed for {len(data)} bytes")
        return list(buf[:n])

    def parsed_special(self, token: int) -> bool:
        """Whether text becomes ``token`` only when tokenized with ``parse_special``: llama.cpp's
        tokenizer matches control and unknown tokens (a template's turn markers) only then."""
        known = self._parsed_special.get(token)
        if known is None:
            lib = self._lib
            attr = lib.llama_vocab_get_attr(self.vocab, token)
            known = self._parsed_special[token] = bool(attr & (lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_UNKNOWN))
        return known

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token's piece (may be an incomplete UTF-8 sequence)."""
        if _faults is not None:
            _fault("token_bytes", self, token)
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        return b"".join(self.token_bytes(t, special=special) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self.vocab, token))

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self._lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, 4096)
        return None if n < 0 else buf.value.decode("utf-8", "replace")


def greedy_of(logits: np.ndarray) -> int:
    """The greedy choice of a logits row: its first maximum, the same tie-break as llama.cpp's greedy sampler."""
    return int(np.argmax(logits))


class NativeContext(_Owner):
    """One ``llama_context`` on a model: KV memory, decode, logits."""

    def __init__(self, model: NativeModel, params: ContextParams) -> None:
        lib = _llama()
        cp = lib.llama_context_default_params()
        cp.n_ctx = params.n_ctx
        cp.n_batch = params.n_batch
        cp.n_ubatch = params.n_ubatch
        if params.saves_all_cells and (params.n_seq_max != 1 or not params.kv_unified):
            raise EngineError("saves_all_cells needs one sequence in one unified KV stream")
        cp.n_seq_max = params.n_seq_max
        cp.n_threads = params.n_threads
        cp.n_threads_batch = params.n_threads_batch
        cp.type_k = getattr(lib, _KV_TYPES[params.kv_cache_type])
        cp.type_v = getattr(lib, _KV_TYPES[params.kv_cache_type])
        cp.flash_attn_type = getattr(lib, _FLASH[params.flash_attention])
        cp.swa_full = params.swa_full
        cp.kv_unified = params.kv_unified
        cp.offload_kqv = params.offload
        cp.op_offload = params.offload
        cp.no_perf = False
        cp.embeddings = params.embeddings
        cp.pooling_type = getattr(lib, _POOLING[params.pooling])
        if _faults is not None:
            _fault("context_init", model)
        with engine_log.capturing() as creation_log:
            ptr = lib.llama_init_from_model(model.ptr, cp)
        if not ptr:
            raise EngineError(
                f"llama.cpp could not create a context (n_ctx={params.n_ctx}, kv={params.kv_cache_type}, "
                f"flash_attention={params.flash_attention}); see the aner_nb.engine log"
            )
        self._lib = lib
        self.model = model  # keeps the Python owner alive; the model frees us first anyway
        self.params = params
        self.adapter = params.adapter  # likewise kept alive while this context may decode with it
        super().__init__(ptr, lib.llama_free, "context")
        self._mem = lib.llama_get_memory(ptr)
        self.n_ctx = int(lib.llama_n_ctx(ptr))
        self.n_vocab = model.n_vocab
        self.decode_count = 0  # llama_decode calls on this context (tests check "touched no KV")
        self.kv_buffers = kv_buffers(creation_log)  # what llama.cpp allocated for KV, as it reported it
        model._register(self)
        if params.adapter is not None:
            try:
                params.adapter._apply(self)
            except BaseException:
                self.free()
                raise

    def free(self) -> bool:
        """Free now (True if this call released the context), then this thread's idle OpenMP workers.

        A thread that frees a context is done decoding with it (a warm-up, a
        probe, an embedding batch, an evicted entry), so its team goes too
        (:func:`release_compute_threads`); contexts that outlive a request are
        released for at the request's end or the scheduler's idle instead.
        """
        released = super().free()
        if released:
            release_compute_threads()
        return released

    def decode(self, batch: "Batch") -> int:
        """Run one ``llama_decode``; returns 0, or 1 when no KV slot fits; raises on errors."""
        self.decode_count += 1
        injected = _NO_FAULT if _faults is None else _fault("decode", self, batch)
        rc = int(self._lib.llama_decode(self.ptr, batch.native) if injected is _NO_FAULT else injected)
        if rc < 0 or rc > 1:
            raise EngineError(f"llama_decode failed with code {rc} for a batch of {batch.n_tokens} tokens")
        return rc

    def logits(self, i: int) -> np.ndarray:
        """A zero-copy float32 view of output row ``i`` (valid until the next decode)."""
        ptr = self._lib.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise EngineError(f"no logits for batch row {i}: the row was not marked for output")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def greedy(self, i: int) -> int:
        return greedy_of(self.logits(i))

    def engine_settings(self) -> dict[str, int]:
        """What llama.cpp itself reports for this context (threads, batch sizes, cells)."""
        lib, ptr = self._lib, self.ptr
        return {
            "n_threads": int(lib.llama_n_threads(ptr)),
            "n_threads_batch": int(lib.llama_n_threads_batch(ptr)),
            "n_batch": int(lib.llama_n_batch(ptr)),
            "n_ubatch": int(lib.llama_n_ubatch(ptr)),
            "n_ctx": int(lib.llama_n_ctx(ptr)),
        }

    # -- KV memory: positions are per sequence; p1 < 0 means "to the end" ----
    def clear(self) -> None:
        self._lib.llama_memory_clear(self._mem, False)

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq``; False when a partial removal is impossible (SWA)."""
        if _faults is not None:
            injected = _fault("seq_rm", self, seq, p0, p1)
            if injected is not _NO_FAULT:
                return bool(injected)
        return bool(self._lib.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def trim(self, seq: int, keep: int) -> bool:
        """Keep exactly positions 0..keep-1 of ``seq``; False if they are not all still there.

        llama_memory_seq_rm can report success yet leave a sliding-window cache
        without the cells the kept positions need (a window-sized SWA cache has
        already dropped old positions), so the surviving range is checked.
        """
        if not self.seq_rm(seq, keep, -1):
            return False
        if keep == 0:
            return self.seq_pos_max(seq) == -1
        return self.seq_pos_min(seq) == 0 and self.seq_pos_max(seq) == keep - 1

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._lib.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        """Largest position stored for ``seq``; -1 when the sequence is empty."""
        return int(self._lib.llama_memory_seq_pos_max(self._mem, seq))

    def seq_pos_min(self, seq: int) -> int:
        return int(self._lib.llama_memory_seq_pos_min(self._mem, seq))

    # -- per-sequence state (llama_state_seq_*): KV of one sequence as bytes -------
    # Engine fact (llama-kv-cache.cpp): a sequence's state leaves out the cells its sliding window no
    # longer sees, and a load puts the cells it has into the first free cells, so a sliding-window
    # model's prefix comes back in other cells than it was evaluated in (the softmax then sums its scores
    # in other lanes) and cannot be cut below the window. A ``saves_all_cells`` context asks llama.cpp
    # for the state of every sequence instead (seq_id -1, no window filter): on its one sequence that is
    # sequence 0 with every cell, in the same per-cell format; loaded into the emptied sequence, cell i
    # of the saved context lands in cell i again (free cells are taken in order) and the cache's search
    # head ends after them, as in the context that was saved. (The whole-context API, llama_state_*,
    # would also clear every KV buffer of the context first: a memset that grows with n_ctx.)
    def _state_seq(self, seq: int) -> int:
        """The sequence id llama.cpp serialises for ``seq``: -1 (every cell) on a ``saves_all_cells`` context."""
        if not self.params.saves_all_cells:
            return seq
        if seq != 0:
            raise EngineError(f"a saves_all_cells context holds sequence 0 only, not {seq}")
        return -1

    def seq_state_bytes(self, seq: int) -> bytearray:
        """Sequence ``seq``'s serialised state (its KV cells, and the SWA cells it keeps).

        A sliding-window sequence's state holds only the last window of its SWA
        layers unless the context ``saves_all_cells``; callers must not treat it
        as the whole prefix (see ``kv_identity``). Raises ``EngineError`` when
        llama.cpp reports no state or a short copy.
        """
        out = bytearray(self.seq_state_size(seq))  # llama.cpp copies straight into it: one copy of the KV, not two
        written = self.seq_state_copy(seq, memoryview(out))
        del out[written:]
        return out

    def seq_state_size(self, seq: int) -> int:
        """The bytes :meth:`seq_state_copy` needs for sequence ``seq`` (``EngineError`` when there is no state)."""
        size = int(self._lib.llama_state_seq_get_size(self.ptr, self._state_seq(seq)))
        if size <= 0:
            raise EngineError(f"llama.cpp reported no state for sequence {seq}")
        return size

    def seq_state_copy(self, seq: int, into: memoryview) -> int:
        """Copy sequence ``seq``'s state into the writable buffer ``into``; the bytes written.

        ``EngineError`` when llama.cpp copies nothing or reports more than ``into`` holds.
        """
        which = self._state_seq(seq)
        size = len(into)
        view = (ctypes.c_uint8 * size).from_buffer(into)
        try:
            written = int(self._lib.llama_state_seq_get_data(self.ptr, view, size, which))
        finally:
            del view  # release the export: the caller may resize or release the buffer
        if written <= 0 or written > size:
            raise EngineError(f"llama_state_seq_get_data copied {written} of {size} bytes for sequence {seq}")
        return written

    def seq_state_load(self, seq: int, data: bytes) -> int:
        """Load ``data`` (from ``seq_state_bytes`` on a context of the same identity) into ``seq``.

        Returns the number of bytes llama.cpp read; raises ``EngineError`` when it
        refuses the data (it returns 0: wrong layout, too many cells). The caller
        clears ``seq`` first and checks the identity before native code sees the
        bytes (``kv_identity.unpack``); on failure the sequence is cleared again.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
            raise EngineError(f"no state bytes to load into sequence {seq}")
        # llama.cpp only reads the buffer (const uint8_t *): point at the caller's storage (read-only views
        # included, through numpy's buffer protocol), no copy of a 40 MB state
        raw = np.frombuffer(data, dtype=np.uint8)
        buf = raw.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        with engine_log.capturing() as lines:
            read = int(self._lib.llama_state_seq_set_data(self.ptr, buf, raw.size, seq))
        if read <= 0 or read > raw.size:
            self._lib.llama_memory_seq_rm(self._mem, seq, -1, -1)
            why = f": {lines[-1].strip()}" if lines else ""
            raise EngineError(f"llama.cpp refused {raw.size} state bytes for sequence {seq} (read {read}){why}")
        return read

    # -- embedding contexts (ContextParams.embeddings) --------------------------
    def pooled_embedding(self, seq: int) -> np.ndarray:
        """A copy of sequence ``seq``'s pooled embedding from the last decode (``llama_get_embeddings_seq``)."""
        ptr = self._lib.llama_get_embeddings_seq(self.ptr, seq)
        if not ptr:
            raise EngineError(f"no pooled embedding for sequence {seq}: not an embedding context, or not decoded")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_embd,)).copy()


class NativeAdapter(_Owner):
    """A LoRA adapter loaded onto one model (``llama_adapter_lora_init``).

    Lifetime order: the contexts that apply it are freed first, then the
    adapter, then the model (``NativeModel.free`` enforces the same order).
    Contexts apply it at creation through ``ContextParams.adapter``.
    """

    def __init__(self, model: NativeModel, path: str, *, scale: float = 1.0) -> None:
        lib = _llama()
        ptr = lib.llama_adapter_lora_init(model.ptr, os.fsencode(path))
        if not ptr:
            raise EngineError(
                f"llama.cpp failed to load the LoRA adapter {os.path.basename(path)!r} (see the aner_nb.engine log)"
            )
        self._lib = lib
        self.model = model  # the model must outlive the adapter
        self.scale = float(scale)
        self._contexts: "weakref.WeakSet[NativeContext]" = weakref.WeakSet()
        self._lock = threading.Lock()
        super().__init__(ptr, lib.llama_adapter_lora_free, f"adapter {os.path.basename(path)}")
        self.free_calls = 0  # counts releases that actually freed the adapter (tests use it)
        model._register_adapter(self)

    def _apply(self, ctx: "NativeContext") -> None:
        """Set this adapter (alone) on a fresh context of the same model."""
        if ctx.model is not self.model:
            raise EngineError("a LoRA adapter can only be applied to contexts of the model it was loaded on")
        adapters = (self._lib.llama_adapter_lora_p_ctypes * 1)(self.ptr)
        scales = (ctypes.c_float * 1)(self.scale)
        rc = int(self._lib.llama_set_adapters_lora(ctx.ptr, adapters, 1, scales))
        if rc != 0:
            raise EngineError(f"llama_set_adapters_lora failed with code {rc}")
        with self._lock:
            self._contexts.add(ctx)

    def free(self) -> bool:
        with self._lock:
            contexts = list(self._contexts)
        for ctx in contexts:  # a context keeps a raw pointer to the adapter: free it first
            ctx.free()
        released = super().free()
        if released:
            self.free_calls += 1
        return released

    def live_contexts(self) -> int:
        with self._lock:
            return sum(1 for c in self._contexts if c.alive)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self._lib.llama_adapter_meta_val_str(self.ptr, key.encode(), buf, 4096)
        return None if n < 0 else buf.value.decode("utf-8", "replace")


class Batch(_Owner):
    """A reusable ``llama_batch`` of up to ``capacity`` token rows."""

    def __init__(self, capacity: int, n_seq_max: int = 1) -> None:
        lib = _llama()
        batch = lib.llama_batch_init(capacity, 0, n_seq_max)
        self._lib = lib
        self.native = batch
        self.capacity = capacity
        super().__init__(batch, lib.llama_batch_free, "batch")
        # Zero-copy numpy views over the C arrays, so filling a prefill chunk is vectorised.
        self._token = np.ctypeslib.as_array(batch.token, shape=(capacity,))
        self._pos = np.ctypeslib.as_array(batch.pos, shape=(capacity,))
        self._n_seq = np.ctypeslib.as_array(batch.n_seq_id, shape=(capacity,))
        self._logits = np.ctypeslib.as_array(batch.logits, shape=(capacity,))
        self._seq_rows = [batch.seq_id[i] for i in range(capacity)]
        self.native.n_tokens = 0

    @property
    def n_tokens(self) -> int:
        return int(self.native.n_tokens)

    def clear(self) -> None:
        self.native.n_tokens = 0

    def add(self, token: int, pos: int, seq: int = 0, logits: bool = False) -> int:
        """Append one row; returns its index (the logits index when ``logits``)."""
        i = self.native.n_tokens
        if i >= self.capacity:
            raise EngineError(f"batch capacity {self.capacity} exceeded")
        self._token[i] = token
        self._pos[i] = pos
        self._n_seq[i] = 1
        self._seq_rows[i][0] = seq
        self._logits[i] = 1 if logits else 0
        self.native.n_tokens = i + 1
        return i

    def mark_output(self, i: int) -> None:
        """Request logits for row ``i`` as well (it was added without)."""
        if not 0 <= i < self.native.n_tokens:
            raise EngineError(f"batch row {i} does not exist ({self.native.n_tokens} rows)")
        self._logits[i] = 1

    def add_run(
        self, tokens: Sequence[int], start_pos: int, seq: int = 0, logits_last: bool = False, all_outputs: bool = False
    ) -> int:
        """Append consecutive tokens of one sequence; returns the index of the last row.

        ``all_outputs`` marks every row as an output (an embedding context pools all of them)."""
        n = len(tokens)
        i = self.native.n_tokens
        if i + n > self.capacity:
            raise EngineError(f"batch capacity {self.capacity} exceeded by {i + n - self.capacity} rows")
        self._token[i : i + n] = tokens
        self._pos[i : i + n] = np.arange(start_pos, start_pos + n, dtype=self._pos.dtype)
        self._n_seq[i : i + n] = 1
        for row in range(i, i + n):
            self._seq_rows[row][0] = seq
        self._logits[i : i + n] = 1 if all_outputs else 0
        if logits_last and n:
            self._logits[i + n - 1] = 1
        self.native.n_tokens = i + n
        return i + n - 1


@dataclass(frozen=True)
class SamplerChain:
    """What one request's llama.cpp sampler chain applies, in llama.cpp's own order.

    ``logit_bias`` is added to the logits first; ``grammar`` (GBNF, root rule ``root``) comes next so every later stage
    sees only tokens the grammar allows; then the penalties over the last
    ``penalty_last_n`` tokens (the prompt's tail included, as llama.cpp's
    server does); then either greedy (``temperature == 0``: the first maximum)
    or top-k, top-p, min-p, temperature and a seeded draw.
    """

    temperature: float
    seed: int
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    grammar: str | None = None
    penalty_last_n: int = 0
    penalty_repeat: float = 1.0
    penalty_freq: float = 0.0
    penalty_present: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits first


class Sampler(_Owner):
    """A llama.cpp sampler chain built from a :class:`SamplerChain`.

    Plain greedy decoding does not use a sampler: ``NativeContext.greedy``
    takes the argmax of the logits row directly, which is what llama.cpp's
    greedy sampler does.
    """

    def __init__(self, model: "NativeModel", spec: SamplerChain, history: Sequence[int] = ()) -> None:
        lib = _llama()
        if _faults is not None:
            _fault("sampler_init", model, spec)
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        self._lib = lib
        self._grammar = spec.grammar is not None
        self._candidates: tuple[Any, np.ndarray, np.ndarray] | None = None
        super().__init__(chain, lib.llama_sampler_free, "sampler")  # frees every stage added below
        try:
            self._build(model, spec, history)
        except BaseException:
            self.free()
            raise

    def _build(self, model: "NativeModel", spec: SamplerChain, history: Sequence[int]) -> None:
        lib = self._lib
        if spec.logit_bias:  # first, as llama.cpp's common sampler: every later stage sees the biased logits
            biases = (lib.llama_logit_bias * len(spec.logit_bias))(
                *(lib.llama_logit_bias(int(token), float(bias)) for token, bias in spec.logit_bias)
            )
            self._add(lib.llama_sampler_init_logit_bias(model.n_vocab, len(spec.logit_bias), biases))
        if spec.grammar is not None:
            self._add(_grammar_sampler(lib, model, spec.grammar))
        if spec.penalty_last_n:
            penalties = lib.llama_sampler_init_penalties(
                model.n_vocab, spec.penalty_last_n, spec.penalty_repeat, spec.penalty_freq, spec.penalty_present
            )
            self._add(penalties)
            for token in history[-spec.penalty_last_n:]:
                lib.llama_sampler_accept(penalties, int(token))  # the prompt's tail counts as seen
        if spec.temperature == 0.0:
            self._add(lib.llama_sampler_init_greedy())
            return
        if spec.top_k:
            self._add(lib.llama_sampler_init_top_k(spec.top_k))
        if spec.top_p < 1.0:
            self._add(lib.llama_sampler_init_top_p(spec.top_p, 1))
        if spec.min_p > 0.0:
            self._add(lib.llama_sampler_init_min_p(spec.min_p, 1))
        self._add(lib.llama_sampler_init_temp(spec.temperature))
        self._add(lib.llama_sampler_init_dist(spec.seed))

    def _add(self, stage: Any) -> None:
        self._lib.llama_sampler_chain_add(self.ptr, stage)  # the chain owns the stage from here

    def sample(self, ctx: NativeContext, i: int) -> int:
        """Sample from output row ``i`` and record the token in every stage's state (grammar, penalties).

        With a grammar, the chain is applied and the choice checked before it is recorded
        (:meth:`sample_row`): ``llama_sampler_sample`` would record whatever it drew.
        """
        if self._grammar:
            return self.sample_row(ctx.logits(i))
        return int(self._lib.llama_sampler_sample(self.ptr, ctx.ptr, i))

    def sample_row(self, logits: np.ndarray) -> int:
        """:meth:`sample` from a logits row kept outside any context (a stored prompt's last row).

        What ``llama_sampler_sample`` does with a context's row, through the public
        API: one candidate per vocabulary entry in token order, the chain applied,
        the selected token recorded in every stage.
        """
        lib = self._lib
        n = int(logits.shape[0])
        if self._candidates is None or len(self._candidates[0]) != n:  # one buffer per sampler, refilled per token
            data = (lib.llama_token_data * n)()
            self._candidates = (data, np.ctypeslib.as_array(data), np.arange(n, dtype=np.int32))
        data, view, ids = self._candidates
        view["id"], view["logit"], view["p"] = ids, logits, 0.0  # fields id, logit, p; the chain reorders them
        cur = lib.llama_token_data_array(data, n, -1, False)
        lib.llama_sampler_apply(self.ptr, ctypes.byref(cur))
        if not 0 <= cur.selected < cur.size:
            raise EngineError(f"the sampler chain selected no token (selected {cur.selected} of {cur.size})")
        chosen = cur.data[cur.selected]
        if self._grammar and chosen.logit == -np.inf:
            # Engine fact (llama-grammar.cpp): the grammar stage sets every token it does not allow to -inf,
            # and recording an end-of-generation token while the grammar is unfinished aborts the process
            # (GGML_ABORT in llama_grammar_accept_impl). A choice at -inf means the grammar allows nothing here.
            raise InvalidRequestError(
                "the grammar allows no token at this point of the output: no token of this model's vocabulary "
                "continues it, so it can never be completed (a literal no token can spell, such as NUL)",
                param="grammar")
        token = int(chosen.id)
        lib.llama_sampler_accept(self.ptr, token)
        return token


# llama.cpp parses a grammar by recursion (about 460 bytes of stack per ( ) level and 130 per rule in a
# chain of leftmost references, measured); aner_nb.llm.constraints bounds both, and the parse runs on a
# thread of this stack size so the bound holds whatever thread (and stack size) the caller has.
GRAMMAR_STACK_BYTES = 16 * 2**20
_stack_size_lock = threading.Lock()


def _on_big_stack(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a fresh thread with GRAMMAR_STACK_BYTES of stack; its result or exception."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            out.append((False, exc))

    with _stack_size_lock:  # threading.stack_size is process-wide: set it only for this thread's start
        previous = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="aner-grammar-parse", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _grammar_sampler(lib: Any, model: "NativeModel", grammar: str) -> Any:
    text = grammar.encode("utf-8")
    stage = _on_big_stack(lambda: lib.llama_sampler_init_grammar(model.vocab, text, b"root"))
    if not stage:  # llama.cpp logs the parse error and returns NULL
        raise GrammarError("llama.cpp could not parse the grammar (GBNF with a 'root' rule is required)")
    return stage


class GrammarError(ValueError):
    """A GBNF grammar llama.cpp cannot parse, or a JSON schema its converter cannot express."""


def check_grammar(model: "NativeModel", grammar: str) -> None:
    """Parse ``grammar`` with llama.cpp's grammar sampler once (then free it); GrammarError if it cannot."""
    lib = _llama()
    lib.llama_sampler_free(_grammar_sampler(lib, model, grammar))


def json_schema_grammar(schema_json: str) -> str:
    """GBNF for a JSON schema, by llama-cpp-python's converter (the one llama.cpp's server uses, ported)."""
    _llama()
    from llama_cpp.llama_grammar import json_schema_to_gbnf  # noqa: PLC0415 - the engine package is lazy

    try:
        return json_schema_to_gbnf(schema_json)
    # AttributeError/IndexError: a sub-schema that is not an object ("items": 5), found by fuzz/fuzz_grammar.py
    except (ValueError, AssertionError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
        raise GrammarError(f"the JSON schema cannot be turned into a grammar: {exc}") from exc
