"""Resident weights of one load, shared by every lease derived from it.

The weights hold a count of the leases (and sessions) using them and free the
native model when the last one lets go, whether it was closed explicitly or
collected by its finalizer.
"""

from __future__ import annotations

import functools
import platform
import threading
from dataclasses import asdict, dataclass

from ._engine import NativeModel, build_flags
from .artifact import ModelFacts
from .chat import ChatTemplate
from .profiles import LoadSettings
from .reuse import ReuseShape, for_restored_windows, reuse_shape, softmax_lanes

__all__ = ["LoadSummary", "SharedWeights"]


@dataclass(frozen=True)
class LoadSummary:
    """What loading cost, phase by phase, in nanoseconds (``-1``: the phase did not run).

    The first SHA-256 pass runs alongside the native load, so ``total_duration``
    is less than the sum of the phases. The warm-up is one short decode on a
    throwaway context: it pages the weights in and initialises the backend, so
    the first request's timings describe the request (``load(warmup=False)``
    skips it).
    """

    fingerprint: str
    file_bytes: int
    hash_duration: int  # first pass, overlapped with the native load
    load_duration: int  # llama_model_load_from_file
    verify_duration: int  # second pass, after the weights are resident
    warmup_duration: int  # one 1-token decode on a context of the load's settings, then freed; -1 if skipped
    total_duration: int
    cpu_extra_buffers: str = "off"  # "on" when quantized weights went to AMX/repack buffer types
    cpu_extra_buffers_reason: str = ""  # the setting, or the CPU probe's verdict

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class SharedWeights:
    """One loaded model and what was learned about it while loading."""

    def __init__(
        self,
        native: NativeModel,
        facts: ModelFacts,
        template: ChatTemplate,
        settings: LoadSettings,
        device: str,
        summary: LoadSummary,
    ) -> None:
        self.native = native
        self.facts = facts
        self.template = template
        self.settings = settings
        self.device = device
        self.summary = summary
        self._users = 0
        self._lock = threading.Lock()

    @property
    def fingerprint(self) -> str:
        return self.summary.fingerprint

    @functools.cached_property
    def reuse_shape(self) -> ReuseShape:
        """Where a prompt may start over cached KV on these weights' kernels (:func:`~aner_nb.llm.reuse.reuse_shape`)
        in a one-sequence context, whose saved states hold every cell (restored in place)."""
        types = (t for _, t in self.facts.tensor_types)
        return reuse_shape(types, build_flags=build_flags(), machine=platform.machine(), on_cpu=self.device == "cpu")

    def reuse_shape_for(self, sequences: int) -> ReuseShape:
        """The reuse shape of a context of ``sequences`` sequences: with more than one, a sliding-window
        model's prefixes come back from per-sequence states whose window lands in the stream's first cells,
        so its restore points are aligned to the softmax's lanes (:func:`~aner_nb.llm.reuse.for_restored_windows`),
        tiers or not (a lease with tiers answers as one without)."""
        if sequences <= 1 or int(getattr(self.native, "n_swa", 0) or 0) == 0:
            return self.reuse_shape
        lanes = softmax_lanes(build_flags(), machine=platform.machine(), on_cpu=self.device == "cpu")
        return for_restored_windows(self.reuse_shape, lanes)

    @property
    def released(self) -> bool:
        return not self.native.alive

    def retain(self) -> None:
        with self._lock:
            if not self.native.alive:
                raise RuntimeError("weights were already freed")
            self._users += 1

    def release(self) -> None:
        """Drop one user; the last one frees contexts, then the model."""
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self.native.free()
