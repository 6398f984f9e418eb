"""Frozen settings for loads, profiles and requests, and their validation.

Everything a user can pass is checked here, once, at configuration time, with
a message naming the value and the allowed range. Validated objects are
immutable, so a lease's profile can be shared and compared safely.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from .errors import ConfigurationError, InvalidRequestError, LLMError
from .memory import KV_CACHE_TYPES

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
    "Profile",
    "RequestSettings",
    "parse_device",
]

MAX_CONTEXT = 65536
MAX_TOKENS = 65536
MAX_SEED = 2**32 - 1
MAX_STOP_STRINGS = 16
MAX_VOCAB = 1 << 24  # top_k's static bound; the model's own vocabulary size is checked when a request is prepared
MAX_REPEAT_PENALTY = 10.0
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


def int_in(name: str, value: Any, low: int, high: int, error: type[LLMError] = ConfigurationError) -> int:
    """``value`` if it is an int (not a bool) in ``low..high``, else ``error`` naming the field and range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an integer in {low}..{high}, got {value!r}", param=name)
    if not low <= value <= high:
        raise error(f"{name} must be in {low}..{high}, got {value}", param=name)
    return value


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

    def __post_init__(self) -> None:
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
        int_in("speculative_tokens", self.speculative_tokens, 0, 16)

    @property
    def draft_tokens(self) -> int:
        """The proposals a decode step may verify: ``speculative_tokens``, or 0 (plain decoding) when
        ``speculative_tokens >= batch_tokens``, since a verification batch holds the pending token
        plus every proposal and could not fit; the seed rule is to fall back, not to refuse."""
        return self.speculative_tokens if self.speculative_tokens < self.batch_tokens else 0

    @property
    def is_latency_profile(self) -> bool:
        return self.prefix_cache_entries > 0 or self.speculative_tokens > 0


@dataclass(frozen=True)
class Profile:
    """What a lease is: its optimizer settings, idle-context retention and adapter identity.

    Leases derived with builders get a new Profile; the source lease keeps its own.
    """

    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    max_idle_contexts: int = 1
    adapter: str | None = None  # SHA-256 of the LoRA adapter this profile applies, if any
    max_sequences: int = 0  # a throughput (batching) profile's concurrent sequences; 0 for the others

    def __post_init__(self) -> None:
        int_in("max_idle", self.max_idle_contexts, 0, 4)
        int_in("max_sequences", self.max_sequences, 0, 64)
        if self.adapter is not None and not (isinstance(self.adapter, str) and _SHA256.fullmatch(self.adapter)):
            raise ConfigurationError(
                f"adapter must be None or a lowercase SHA-256 hex digest, got {self.adapter!r}", param="adapter"
            )

    @property
    def kind(self) -> str:
        """``throughput`` (a batching lease), ``latency`` (prefix cache or speculation) or ``ordinary``."""
        if self.max_sequences:
            return "throughput"
        return "latency" if self.optimizer.is_latency_profile else "ordinary"

    def with_(self, **changes: Any) -> "Profile":
        return replace(self, **changes)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise InvalidRequestError(
            f"stop must be None, a string or a list of strings, got {type(stop).__name__}", param="stop"
        )
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise InvalidRequestError(f"stop[{i}] must be a non-empty string, got {s!r}", param=f"stop[{i}]")
    return tuple(stop)


def _number_in(name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> float:
    """``value`` as a float if it is a finite number in its range (``(low, high]`` when ``open_low``)."""
    span = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
    finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not finite or value < low or value > high or (open_low and value == low):
        raise InvalidRequestError(f"{name} must be a finite number in {span}, got {value!r}", param=name)
    return float(value)


@dataclass(frozen=True)
class RequestSettings:
    """Per-request sampling settings, validated on construction.

    Defaults change nothing: ``temperature=0`` is plain greedy (the argmax of
    the logits), ``top_k=0``, ``top_p=1``, ``min_p=0`` and neutral penalties
    leave the distribution as the model gives it. ``grammar`` (GBNF) or
    ``json_schema`` constrain the output; at most one of them.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: str | None = None
    json_schema: Any = None

    def __post_init__(self) -> None:
        int_in("max_tokens", self.max_tokens, 0, MAX_TOKENS, InvalidRequestError)
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen
        set_("temperature", _number_in("temperature", self.temperature, 0.0, 2.0))
        int_in("seed", self.seed, 0, MAX_SEED, InvalidRequestError)
        set_("stop", _stop_strings(self.stop))
        int_in("top_k", self.top_k, 0, MAX_VOCAB, InvalidRequestError)
        set_("top_p", _number_in("top_p", self.top_p, 0.0, 1.0))
        set_("min_p", _number_in("min_p", self.min_p, 0.0, 1.0))
        set_("repeat_penalty", _number_in("repeat_penalty", self.repeat_penalty, 0.0, MAX_REPEAT_PENALTY, open_low=True))
        int_in("repeat_last_n", self.repeat_last_n, 0, MAX_CONTEXT, InvalidRequestError)
        set_("presence_penalty", _number_in("presence_penalty", self.presence_penalty, -2.0, 2.0))
        set_("frequency_penalty", _number_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise InvalidRequestError(f"grammar must be a non-empty GBNF string or None, got {self.grammar!r}", param="grammar")
        if self.json_schema is not None and not isinstance(self.json_schema, Mapping):
            raise InvalidRequestError(
                f"json_schema must be a JSON schema object (a dict) or None, got {type(self.json_schema).__name__}",
                param="json_schema",
            )
        if self.grammar is not None and self.json_schema is not None:
            raise InvalidRequestError("grammar and json_schema cannot be combined; pass one of them", param="grammar")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a repetition, presence or frequency penalty changes the logits."""
        return (
            (self.repeat_penalty != 1.0 and self.repeat_last_n > 0)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def constrained(self) -> bool:
        return self.grammar is not None or self.json_schema is not None

    @property
    def plain_argmax(self) -> bool:
        """Greedy with nothing that changes the logits: the argmax of the raw row, no sampler at all."""
        return self.greedy and not self.penalized and not self.constrained
