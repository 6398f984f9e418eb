"""Typed exceptions of the library.

Every rule of the contract raises one of these with a message that names the
offending value and what is allowed, so callers (magics, the HTTP service) can
map them to user-facing errors without parsing strings.
"""

from __future__ import annotations

__all__ = [
    "LLMError",
    "InvalidArtifactError",
    "UnsupportedModelError",
    "ModelNotFoundError",
    "AdapterError",
    "ArtifactChangedError",
    "ChatTemplateError",
    "ConfigurationError",
    "InvalidRequestError",
    "ContextOverflowError",
    "DeviceUnavailableError",
    "BusyError",
    "ClosedError",
    "UnsupportedFeatureError",
    "EngineError",
    "NativeUnavailableError",
    "UnsupportedCPUError",
    "StateMismatchError",
]


class LLMError(Exception):
    """Base class of every error raised by ``aner_nb.llm``.

    ``param`` names the offending argument or setting when there is one
    (``max_tokens``, ``messages[2].role``, ``stop[0]``, ``context``), so the
    HTTP service and the magics can point at it without parsing the message.
    """

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidArtifactError(LLMError, ValueError):
    """The file is not a readable single-file GGUF (bad magic, truncated, corrupted)."""


class UnsupportedModelError(InvalidArtifactError):
    """A valid GGUF that this toolkit does not admit (split, projector, adapter, architecture)."""


class ModelNotFoundError(InvalidArtifactError, LookupError):
    """A model name matches no GGUF file of the known stores (or more than one: ``candidates``)."""

    def __init__(self, message: str, *, candidates: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.candidates = candidates


class AdapterError(InvalidArtifactError):
    """An adapter manifest or adapter file failed a check; ``field`` names what was wrong.

    ``field`` is a manifest field (``base_sha256``, ``adapter_file``...), a GGUF
    metadata key (``general.type``, ``adapter.type``) or an adapter tensor name.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message, param=field)
        self.field = field


class ArtifactChangedError(LLMError):
    """The file's bytes changed between the hash before loading and the one after."""


class ChatTemplateError(LLMError, ValueError):
    """No usable chat template, or the template failed to render in the sandbox."""


class ConfigurationError(LLMError, ValueError):
    """A load or profile setting is out of range or an unsupported combination."""


class InvalidRequestError(LLMError, ValueError):
    """A request argument (max_tokens, temperature, seed, messages, stop) is invalid."""


class ContextOverflowError(InvalidRequestError):
    """The formatted prompt plus ``max_tokens`` does not fit the context; nothing is truncated."""


class DeviceUnavailableError(ConfigurationError):
    """An explicitly requested device is not available in this engine build."""


class BusyError(LLMError):
    """The lease already runs a request (or its queue is full); retry later."""


class ClosedError(LLMError):
    """The lease was closed; it accepts no new requests."""


class UnsupportedFeatureError(LLMError):
    """The lease's profile does not support this operation."""


class EngineError(LLMError, RuntimeError):
    """llama.cpp reported a failure (load, context creation, decode)."""


class NativeUnavailableError(EngineError):
    """llama-cpp-python cannot be imported or its shared library cannot be loaded."""


class UnsupportedCPUError(NativeUnavailableError):
    """This llama.cpp build executes instructions this CPU cannot run (a probe child died by a signal)."""


class StateMismatchError(LLMError, ValueError):
    """Saved KV state (a prefix tier entry, a saved conversation) is not valid for this context.

    ``reason`` says why, one of ``kv_identity.REASONS``: ``corrupt``, ``truncated``,
    ``foreign_model``, ``foreign_adapter``, ``foreign_build``, ``foreign_kv_type``,
    ``newer_format``, ``layout``, ``sliding_window`` (a restored sliding-window
    state, which holds only its last window, kept shorter than its last token).
    Nothing was loaded.
    """

    def __init__(self, message: str, *, reason: str, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.reason = reason
