"""Timings of one request, assembled from typed parts.

Each producer measures its own fields and hands back a frozen *part*: the
lease's configuration (:class:`ProfileTimings`), the context pool or session
(:class:`PoolTimings`, :class:`PrefixCacheTimings`), the batching queue and
scheduler (:class:`QueueTimings`, :class:`BatchTimings`), the decode loop
(:class:`RunTimings`) and prompt-lookup verification
(:class:`SpeculativeTimings`). :meth:`Timings.assemble` refuses a field that
two parts set, so no producer can silently overwrite another's measurement;
a field no part sets stays ``-1`` (not measured, never a made-up ``0``).

Every :class:`Timings` field carries display metadata (``label``, ``unit``,
``part``), so tables and dashboards iterate the fields instead of listing
columns by hand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator

__all__ = [
    "NOT_MEASURED",
    "UNITS",
    "Timings",
    "TimingsPart",
    "ProfileTimings",
    "PoolTimings",
    "PrefixCacheTimings",
    "QueueTimings",
    "RunTimings",
    "SpeculativeTimings",
    "BatchTimings",
    "PrefixTierTimings",
    "timing_fields",
]

NOT_MEASURED = -1
# ns: a duration in nanoseconds; tokens / count: how many; flag: 0 or 1; setting: a configured value.
UNITS = ("ns", "tokens", "count", "flag", "setting")


def _f(label: str, unit: str, part: str) -> Any:
    assert unit in UNITS, unit
    return field(default=NOT_MEASURED, metadata={"label": label, "unit": unit, "part": part})


@dataclass(frozen=True)
class Timings:
    """Where the time of one request went, and what the engine did.

    Durations are nanoseconds from a monotonic clock. ``first_token_duration``
    and ``total_duration`` run from the call, so time spent waiting in a queue
    is included (``queue_duration`` reports it alone); ``decode_duration`` runs
    from the first sampled token to the last one, and is -1 when only one token
    was sampled (nothing was decoded after the first). Flags such as
    ``prefix_cache_hit`` are 0/1, or -1 where the profile has no such feature.
    ``prefix_cache_capacity`` is the profile's configured number of entries;
    ``prefix_cache_entries`` the entries the pool held when the request began.
    """

    queue_duration: int = _f("queue", "ns", "queue")
    context_clear_duration: int = _f("context clear", "ns", "pool")
    prompt_eval_duration: int = _f("prefill", "ns", "run")
    first_token_duration: int = _f("first token", "ns", "run")
    decode_duration: int = _f("decode", "ns", "run")
    total_duration: int = _f("total", "ns", "run")
    prompt_tokens: int = _f("prompt tokens", "tokens", "run")
    cached_input_tokens: int = _f("cached input tokens", "tokens", "pool")
    evaluated_prompt_tokens: int = _f("evaluated prompt tokens", "tokens", "run")
    generated_tokens: int = _f("generated tokens", "tokens", "run")
    decode_calls: int = _f("decode calls", "count", "run")
    context_pool_reused: int = _f("context reused", "flag", "pool")
    prefix_cache_hit: int = _f("prefix cache hit", "flag", "prefix_cache")
    prefix_cache_entries: int = _f("prefix cache entries held", "count", "prefix_cache")
    prefix_cache_retained_tokens: int = _f("prefix cache retained tokens", "tokens", "prefix_cache")
    prefix_cache_capacity: int = _f("prefix cache capacity", "setting", "profile")
    threads: int = _f("decode threads", "setting", "profile")
    prefill_threads: int = _f("batch threads", "setting", "profile")
    batch_tokens: int = _f("batch tokens", "setting", "profile")
    micro_batch_tokens: int = _f("micro-batch tokens", "setting", "profile")
    speculative_tokens: int = _f("speculative tokens", "setting", "profile")
    speculative_proposed_tokens: int = _f("proposed tokens", "tokens", "speculative")
    speculative_accepted_tokens: int = _f("accepted tokens", "tokens", "speculative")
    speculative_verification_steps: int = _f("verification steps", "count", "speculative")
    batch_max_sequences: int = _f("max sequences", "setting", "batch")
    batch_peak_sequences: int = _f("peak sequences", "count", "batch")
    scheduler_steps: int = _f("scheduler steps", "count", "batch")
    batch_decoded_tokens: int = _f("batch decoded tokens", "tokens", "batch")  # rows of its steps, all sequences'
    # Prefix tiers behind live KV (-1 where the profile has none): which tier served the prefix
    # (prefix_tiers.TIER_CODES: 0 none, 1 live KV, 2 host RAM, 3 disk), what was restored and what it cost.
    prefix_cache_tier: int = _f("prefix tier (0 none, 1 live, 2 RAM, 3 disk)", "setting", "prefix_tier")
    prefix_restored_tokens: int = _f("restored prefix tokens", "tokens", "prefix_tier")
    prefix_tier_bytes_read: int = _f("tier bytes read", "count", "prefix_tier")
    prefix_tier_bytes_written: int = _f("tier bytes written", "count", "prefix_tier")
    prefix_restore_duration: int = _f("prefix restore", "ns", "prefix_tier")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Timings.{f.name} must be an int, got {value!r}")
            if value < NOT_MEASURED:
                raise ValueError(f"Timings.{f.name} must be >= -1, got {value}")

    @classmethod
    def assemble(cls, *parts: "TimingsPart") -> "Timings":
        """One Timings from the parts of its producers; a field set by two parts is an error."""
        values: dict[str, int] = {}
        owner: dict[str, type] = {}
        for part in parts:
            if not isinstance(part, TimingsPart):
                raise TypeError(f"Timings.assemble takes timings parts, got {type(part).__name__}")
            for name, value in part.values().items():
                if name in owner:
                    raise ValueError(
                        f"Timings.{name} is set by both {owner[name].__name__} and {type(part).__name__}; "
                        "each field has exactly one producer"
                    )
                owner[name] = type(part)
                values[name] = value
        return cls(**values)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def replace(self, **changes: int) -> "Timings":
        return dataclasses.replace(self, **changes)


def timing_fields(*, part: str | None = None, unit: str | None = None) -> Iterator[dataclasses.Field]:
    """The fields of :class:`Timings` in declaration order, optionally only one part's or one unit's."""
    for f in dataclasses.fields(Timings):
        if (part is None or f.metadata["part"] == part) and (unit is None or f.metadata["unit"] == unit):
            yield f


class TimingsPart:
    """Base of the frozen parts a producer hands to :meth:`Timings.assemble`."""

    def values(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class ProfileTimings(TimingsPart):
    """The configuration the request ran with (the lease's resolved engine settings)."""

    threads: int
    prefill_threads: int
    batch_tokens: int
    micro_batch_tokens: int
    speculative_tokens: int
    prefix_cache_capacity: int


@dataclass(frozen=True)
class PoolTimings(TimingsPart):
    """How the request got its context: cleared, reused, and how many prompt tokens were already in it."""

    cached_input_tokens: int
    context_clear_duration: int = NOT_MEASURED
    context_pool_reused: int = NOT_MEASURED


@dataclass(frozen=True)
class PrefixCacheTimings(TimingsPart):
    """What the prefix pool held when the request began, and whether it matched."""

    prefix_cache_hit: int
    prefix_cache_entries: int
    prefix_cache_retained_tokens: int


@dataclass(frozen=True)
class QueueTimings(TimingsPart):
    """Time between submission and admission to a batching sequence."""

    queue_duration: int


@dataclass(frozen=True)
class RunTimings(TimingsPart):
    """Prefill and decode of one request, measured by its sequence output."""

    prompt_tokens: int
    evaluated_prompt_tokens: int
    generated_tokens: int
    decode_calls: int
    prompt_eval_duration: int
    first_token_duration: int
    decode_duration: int
    total_duration: int


@dataclass(frozen=True)
class SpeculativeTimings(TimingsPart):
    """Prompt-lookup verification counts."""

    speculative_proposed_tokens: int
    speculative_accepted_tokens: int
    speculative_verification_steps: int


@dataclass(frozen=True)
class BatchTimings(TimingsPart):
    """What sharing the batching scheduler looked like for this request."""

    batch_max_sequences: int
    batch_peak_sequences: int
    scheduler_steps: int
    batch_decoded_tokens: int


@dataclass(frozen=True)
class PrefixTierTimings(TimingsPart):
    """Which prefix tier served the request (``prefix_tiers.TIER_CODES``), what it restored and moved.

    ``prefix_tier_bytes_written`` counts what this request's lookup wrote (an
    evicted entry demoted to RAM or disk); the write-through of its own prefix
    happens after its response and is counted in the tiers' metrics.
    """

    prefix_cache_tier: int
    prefix_restored_tokens: int = 0
    prefix_tier_bytes_read: int = 0
    prefix_tier_bytes_written: int = 0
    prefix_restore_duration: int = NOT_MEASURED
