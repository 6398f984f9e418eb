"""The library: load GGUF models as leases, run requests, measure them.

``from aner_nb import llm`` then ``model = llm.load(path)``; see DESIGN.md and
the README for the contract. This package never imports IPython, widgets or
HTTP code; only ``_engine`` imports llama_cpp.
"""

from __future__ import annotations

from . import errors
from .artifact import SUPPORTED_ARCHITECTURES, ModelFacts, inspect_model, sha256_file
from .chat import BUILTIN_TEMPLATES, ChatTemplate
from .lease import FEATURES, LLMModel
from .loader import load, native_available, resolve_device
from .memory import KV_CACHE_TYPES, kv_estimate
from .profiles import LoadSettings, OptimizerSettings, Profile, RequestSettings
from .response import Response, Timings, Usage
from .session import Session
from .stream import Stream
from .summary import MemorySummary
from .weights import LoadSummary


def with_optimizer(model: LLMModel, **settings: int) -> LLMModel:
    """Module form of :meth:`LLMModel.with_optimizer`."""
    return model.with_optimizer(**settings)


def with_context_pool(model: LLMModel, max_idle: int) -> LLMModel:
    """Module form of :meth:`LLMModel.with_context_pool`."""
    return model.with_context_pool(max_idle)


__all__ = [
    "errors",
    "load",
    "native_available",
    "resolve_device",
    "with_optimizer",
    "with_context_pool",
    "LLMModel",
    "Session",
    "Stream",
    "Response",
    "Timings",
    "Usage",
    "LoadSummary",
    "MemorySummary",
    "ModelFacts",
    "inspect_model",
    "sha256_file",
    "kv_estimate",
    "KV_CACHE_TYPES",
    "FEATURES",
    "SUPPORTED_ARCHITECTURES",
    "BUILTIN_TEMPLATES",
    "ChatTemplate",
    "LoadSettings",
    "OptimizerSettings",
    "Profile",
    "RequestSettings",
]
