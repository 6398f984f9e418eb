"""The one lease protocol: what every kind of lease offers, written once.

A lease is something a user submits requests to: an ordinary or latency
lease (:class:`~aner_nb.llm.lease.LLMModel`), an adapter lease, a batching
lease (:class:`~aner_nb.llm.batching.BatchingModel`) or a conversation
(:class:`~aner_nb.llm.session.Session`). Consumers (magics, the HTTP service,
widgets, benchmarks) switch on :attr:`Lease.kind` and :meth:`Lease.supports`,
never on class or module names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal, get_args

from .errors import ConfigurationError

__all__ = ["Lease", "LeaseKind", "KINDS", "FEATURES"]

LeaseKind = Literal["ordinary", "latency", "adapter", "throughput", "session"]
KINDS: tuple[str, ...] = get_args(LeaseKind)
FEATURES = ("generate", "chat", "stream", "session", "prefix_cache", "speculative", "continuous_batching", "adapter")


class Lease(ABC):
    """What every lease kind offers: its kind, its features, and its lifetime."""

    @property
    @abstractmethod
    def kind(self) -> LeaseKind:
        """``ordinary``, ``latency`` (prefix cache or speculation), ``adapter`` (applies a LoRA adapter),
        ``throughput`` (continuous batching) or ``session`` (a conversation keeping its KV)."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """Whether the lease still accepts requests."""

    @abstractmethod
    def close(self) -> None:
        """Reject new requests; accepted ones finish, then native memory is released."""

    @abstractmethod
    def _features(self) -> frozenset[str]:
        """The features of this lease while it is open."""

    def supports(self, feature: str) -> bool:
        """Whether this lease can do ``feature`` now (one of FEATURES); closed leases support nothing."""
        if feature not in FEATURES:
            raise ConfigurationError(f"unknown feature {feature!r}; known features: {', '.join(FEATURES)}", param="feature")
        return not self.closed and feature in self._features()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
