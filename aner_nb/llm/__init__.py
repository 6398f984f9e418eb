"""The library: load GGUF models as leases, run requests, measure them.

``from aner_nb import llm`` then ``model = llm.load(path)``; see the README and
docs/ (the project's design contract, DESIGN.md, is kept outside this repository). This package never imports IPython, widgets or
HTTP code; only ``_engine`` imports llama_cpp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import errors
from .adapters import AdapterInfo, AdapterManifest, read_manifest, write_manifest
from .artifact import SUPPORTED_ARCHITECTURES, AdapterFacts, ModelFacts, inspect_adapter, inspect_model, sha256_file
from .batching import BatchingModel, BatchingSettings, with_batching
from .catalog import ModelEntry, find_models, models, resolve_model
from .chat import BUILTIN_TEMPLATES, ChatTemplate
from .lease import LLMModel
from .protocol import BUILDERS, FEATURES, KINDS, Lease, LeaseKind
from .loader import load, native_available, resolve_device
from .memory import KV_CACHE_TYPES, kv_estimate
from .profiles import LoadSettings, OptimizerSettings, Profile, RequestSettings
from .frame_map import INTERRUPTED, MapStats
from .response import Response, Usage
from .tools import Tool, ToolCall
from .logprobs import TokenLogprob
from .timings import Timings, timing_fields
from .scheduler import SchedulerStats
from .session import Session
from .stream import Stream
from .summary import MemorySummary
from .system import SystemInfo, system_info
from .weights import LoadSummary

if TYPE_CHECKING:
    import os


def with_optimizer(model: LLMModel, **settings: int) -> LLMModel:
    """Module form of :meth:`LLMModel.with_optimizer`."""
    return model.with_optimizer(**settings)


def with_context_pool(model: LLMModel, max_idle: int) -> LLMModel:
    """Module form of :meth:`LLMModel.with_context_pool`."""
    return model.with_context_pool(max_idle)


def with_adapter(model: LLMModel, manifest_path: "str | os.PathLike[str]") -> LLMModel:
    """Module form of :meth:`LLMModel.with_adapter`."""
    return model.with_adapter(manifest_path)


__all__ = [
    "errors",
    "load",
    "models",
    "find_models",
    "resolve_model",
    "ModelEntry",
    "native_available",
    "system_info",
    "SystemInfo",
    "resolve_device",
    "with_optimizer",
    "with_context_pool",
    "with_batching",
    "with_adapter",
    "Lease",
    "MapStats",
    "INTERRUPTED",
    "LeaseKind",
    "KINDS",
    "LLMModel",
    "BatchingModel",
    "BatchingSettings",
    "SchedulerStats",
    "Session",
    "Stream",
    "Response",
    "Tool",
    "ToolCall",
    "TokenLogprob",
    "Timings",
    "timing_fields",
    "Usage",
    "LoadSummary",
    "MemorySummary",
    "ModelFacts",
    "inspect_model",
    "AdapterFacts",
    "AdapterInfo",
    "AdapterManifest",
    "inspect_adapter",
    "read_manifest",
    "write_manifest",
    "sha256_file",
    "kv_estimate",
    "KV_CACHE_TYPES",
    "FEATURES",
    "BUILDERS",
    "SUPPORTED_ARCHITECTURES",
    "BUILTIN_TEMPLATES",
    "ChatTemplate",
    "LoadSettings",
    "OptimizerSettings",
    "Profile",
    "RequestSettings",
]
