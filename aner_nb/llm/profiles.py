"""Frozen settings for loads, profiles and requests, and their validation.

Everything a user can pass is checked here, once, at configuration time, with
a message naming the value and the allowed range. Validated objects are
immutable, so a lease's profile can be shared and compared safely. Request
options are declared in :mod:`aner_nb.llm.options`, which builds
:class:`RequestSettings` (re-exported here).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

from .draft_policy import MAX_SPECULATIVE_TOKENS
from .errors import ConfigurationError
from .memory import KV_CACHE_TYPES
from .options import MAX_CONTEXT, MAX_REPEAT_PENALTY, MAX_SEED, MAX_STOP_STRINGS, MAX_TOKENS, MAX_VOCAB, int_in
from .options import RequestSettings  # declared with the request options (options.py), re-exported here

__all__ = [
    "int_in",
    "MAX_CONTEXT",
    "MAX_TOKENS",
    "MAX_SEED",
    "DEVICES",
    "FLASH_ATTENTION",
    "CPU_EXTRA_BUFFERS",
    "choice_or_env",
    "LoadSettings",
    "OptimizerSettings",
    "BatchingSettings",
    "MAX_SEQUENCES",
    "MAX_TIER_BYTES",
    "DEFAULT_DISK_BYTES",
    "check_tier_settings",
    "QUEUE_LIMIT",
    "STREAM_BUFFER",
    "Profile",
    "RequestSettings",
    "parse_device",
]

FLASH_ATTENTION = ("auto", "on", "off")
CPU_EXTRA_BUFFERS = ("auto", "on", "off")


def choice_or_env(value: str | None, env: str, allowed: tuple[str, ...], default: str) -> str:
    """``value`` when given (its setting checks it), else ``$env`` (checked here), else ``default``."""
    if value is not None:
        return value
    from_env = os.environ.get(env) or default
    if from_env not in allowed:
        raise ConfigurationError(f"${env} must be one of {', '.join(allowed)}, got {from_env!r}")
    return from_env
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "metal", "mps")
_CUDA = re.compile(r"^cuda(?::(\d+))?$")
_SHA256 = re.compile(r"[0-9a-f]{64}")  # fullmatch: no trailing newline


def parse_device(device: Any) -> tuple[str, int]:
    """Normalise a device name to (kind, index): ``("auto"|"cpu"|"cuda"|"metal", index)``."""
    if not isinstance(device, str):
        raise ConfigurationError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    name = device.strip().lower()
    if name in ("auto", "cpu"):
        return name, 0
    if name in ("metal", "mps"):
        return "metal", 0
    match = _CUDA.match(name)
    if match:
        return "cuda", int(match.group(1) or 0)
    raise ConfigurationError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")


@dataclass(frozen=True)
class LoadSettings:
    """How a model file is loaded: context size, device, KV type, flash attention, template."""

    context: int = 4096
    device: str = "auto"
    kv_cache_type: str = "f16"
    flash_attention: str = "auto"
    chat_template: str | None = None
    cpu_extra_buffers: str = "auto"  # AMX/repack weight buffers: auto probes once per CPU and build

    def __post_init__(self) -> None:
        int_in("context", self.context, 1, MAX_CONTEXT)
        if self.cpu_extra_buffers not in CPU_EXTRA_BUFFERS:
            raise ConfigurationError(
                f"cpu_extra_buffers must be one of {', '.join(CPU_EXTRA_BUFFERS)}, got {self.cpu_extra_buffers!r}"
            )
        parse_device(self.device)
        if self.kv_cache_type not in KV_CACHE_TYPES:
            raise ConfigurationError(
                f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}, got {self.kv_cache_type!r}"
            )
        if self.flash_attention not in FLASH_ATTENTION:
            raise ConfigurationError(
                f"flash_attention must be one of {', '.join(FLASH_ATTENTION)}, got {self.flash_attention!r}"
            )
        # llama.cpp stores a quantized V cache only through the flash-attention kernel.
        if self.kv_cache_type != "f16" and self.flash_attention == "off":
            raise ConfigurationError(
                f"kv_cache_type={self.kv_cache_type!r} quantizes the V cache, which needs flash attention; "
                "use flash_attention='on' or 'auto', or kv_cache_type='f16'"
            )
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
            raise ConfigurationError(
                f"chat_template must be a built-in name or a Jinja string, got {self.chat_template!r}"
            )


MAX_TIER_BYTES = 1 << 44  # 16 TiB: a bound, not a recommendation
DEFAULT_DISK_BYTES = 4 << 30  # a prefix_cache_dir holds at most 4 GiB unless prefix_cache_disk_bytes says otherwise


def check_tier_settings(settings: Any) -> None:
    """Validate (and normalise the directory of) a profile's ``prefix_cache_ram_bytes`` / ``_dir`` / ``_disk_bytes``."""
    int_in("prefix_cache_ram_bytes", settings.prefix_cache_ram_bytes, 0, MAX_TIER_BYTES)
    int_in("prefix_cache_disk_bytes", settings.prefix_cache_disk_bytes, 1, MAX_TIER_BYTES)
    directory = settings.prefix_cache_dir
    if directory is not None:
        if isinstance(directory, os.PathLike):
            directory = os.fspath(directory)
        if not isinstance(directory, str) or not directory or "\x00" in directory:
            raise ConfigurationError(
                f"prefix_cache_dir must be None or a directory path, got {settings.prefix_cache_dir!r}",
                param="prefix_cache_dir",
            )
        object.__setattr__(settings, "prefix_cache_dir", os.path.abspath(os.path.expanduser(directory)))
    tiers = settings.prefix_cache_ram_bytes > 0 or settings.prefix_cache_dir is not None
    if tiers and settings.prefix_cache_entries == 0:
        raise ConfigurationError(
            "prefix_cache_ram_bytes / prefix_cache_dir keep prefixes evicted from the prefix cache, which is off "
            "(prefix_cache_entries=0); set prefix_cache_entries >= 1 as well",
            param="prefix_cache_dir" if settings.prefix_cache_dir is not None else "prefix_cache_ram_bytes",
        )


@dataclass(frozen=True)
class OptimizerSettings:
    """Engine knobs of a latency profile. ``0`` threads means the engine default."""

    threads: int = 0
    prefill_threads: int = 0
    batch_tokens: int = 512
    micro_batch_tokens: int = 128
    prefix_cache_entries: int = 0
    prefix_cache_tokens: int = 2048
    speculative_tokens: int = 0
    # Tiers behind live KV for retained prefixes (off by default; see prefix_tiers.py).
    prefix_cache_ram_bytes: int = 0
    prefix_cache_dir: str | None = None
    prefix_cache_disk_bytes: int = DEFAULT_DISK_BYTES

    def __post_init__(self) -> None:
        check_tier_settings(self)
        int_in("threads", self.threads, 0, 256)
        int_in("prefill_threads", self.prefill_threads, 0, 256)
        int_in("batch_tokens", self.batch_tokens, 1, MAX_CONTEXT)
        int_in("micro_batch_tokens", self.micro_batch_tokens, 1, MAX_CONTEXT)
        if self.micro_batch_tokens > self.batch_tokens:
            raise ConfigurationError(
                f"micro_batch_tokens ({self.micro_batch_tokens}) must be <= batch_tokens ({self.batch_tokens})"
            )
        int_in("prefix_cache_entries", self.prefix_cache_entries, 0, 16)
        int_in("prefix_cache_tokens", self.prefix_cache_tokens, 1, MAX_CONTEXT)
        int_in("speculative_tokens", self.speculative_tokens, 0, MAX_SPECULATIVE_TOKENS)

    @property
    def draft_tokens(self) -> int:
        """The proposals a decode step may verify: ``speculative_tokens``, or 0 (plain decoding) when
        ``speculative_tokens >= batch_tokens``, since a verification batch holds the pending token
        plus every proposal and could not fit; the seed rule is to fall back, not to refuse."""
        return self.speculative_tokens if self.speculative_tokens < self.batch_tokens else 0

    @property
    def is_latency_profile(self) -> bool:
        return self.prefix_cache_entries > 0 or self.speculative_tokens > 0


MAX_SEQUENCES = 64
QUEUE_LIMIT = 8
STREAM_BUFFER = 16


@dataclass(frozen=True)
class BatchingSettings:
    """A throughput profile: concurrent sequences, waiting-queue bound, stream buffer (pieces).

    A batching lease's shared prefixes are its profile's ``optimizer.prefix_cache_entries`` and
    ``optimizer.prefix_cache_tokens`` (the latency profile's names and bounds), not copies here.
    """

    max_sequences: int
    queue_limit: int = QUEUE_LIMIT
    stream_buffer: int = STREAM_BUFFER

    def __post_init__(self) -> None:
        int_in("max_sequences", self.max_sequences, 1, MAX_SEQUENCES)
        int_in("queue_limit", self.queue_limit, 1, 1024)
        int_in("stream_buffer", self.stream_buffer, 1, 65536)


@dataclass(frozen=True)
class Profile:
    """What a lease is: its optimizer settings, idle-context retention, adapter identity and, for a
    throughput lease, its batching settings.

    Leases derived with builders get a new Profile; the source lease keeps its own.
    """

    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    max_idle_contexts: int = 1
    adapter: str | None = None  # SHA-256 of the LoRA adapter this profile applies, if any
    batching: BatchingSettings | None = None  # a throughput (batching) profile's settings; None for the others

    def __post_init__(self) -> None:
        int_in("max_idle", self.max_idle_contexts, 0, 4)
        if self.batching is not None and not isinstance(self.batching, BatchingSettings):
            raise ConfigurationError(
                f"batching must be None or a BatchingSettings, got {type(self.batching).__name__}", param="batching"
            )
        if self.adapter is not None and not (isinstance(self.adapter, str) and _SHA256.fullmatch(self.adapter)):
            raise ConfigurationError(
                f"adapter must be None or a lowercase SHA-256 hex digest, got {self.adapter!r}", param="adapter"
            )

    @property
    def kind(self) -> str:
        """``throughput`` (a batching lease), ``latency`` (prefix cache or speculation) or ``ordinary``."""
        if self.batching is not None:
            return "throughput"
        return "latency" if self.optimizer.is_latency_profile else "ordinary"

    @property
    def max_sequences(self) -> int:
        """A throughput profile's concurrent sequences; 0 for the others."""
        return self.batching.max_sequences if self.batching is not None else 0

    def with_(self, **changes: Any) -> "Profile":
        return replace(self, **changes)
