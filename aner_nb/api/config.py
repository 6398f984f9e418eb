"""What one HTTP service serves and the limits it applies: :class:`ServiceConfig`.

Frozen and checked by the builder (:class:`aner_nb.api.App` holds one and
replaces it on every builder call); the application (``service.build_app``)
and its :class:`~aner_nb.api.service.Service` read it as it is, never a copy
of its fields. Light on imports, so ``import aner_nb.api`` does not load
FastAPI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..llm.options import REGISTRY, Registry
from .routes import MountSpec

__all__ = ["ServiceConfig"]


@dataclass(frozen=True)
class ServiceConfig:
    """Everything the application needs; built and validated by :class:`aner_nb.api.App`."""

    title: str = "aner_nb"
    mounts: tuple[MountSpec, ...] = ()
    max_rows: int = 64
    timeout_ms: int = 120_000
    max_body_bytes: int = 1 << 20
    max_concurrent: Optional[int] = None
    retry_after_s: int = 1
    max_tokens: int = REGISTRY["max_tokens"].default
    bearer_token: Optional[str] = field(default=None, repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # accepted besides bearer_token
    host: str = "127.0.0.1"  # the bind address: which Host values are allowed by default (see origin)
    allowed_hosts: tuple[str, ...] = ()  # more allowed Host names (origin.check_host_pattern); "*": any
    sse_keepalive_s: float = 15.0  # 0: no keep-alive comments
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the service; none by default
    body_timeout_s: float = 30.0  # a request body still arriving this long after its head is answered 408
    registry: Registry = REGISTRY  # the request options the bodies declare (tests build their own)
    lenient_fields: bool = False  # unknown OpenAI fields ignored (listed in IGNORED_FIELDS_HEADER), not a 400

    @property
    def authenticated(self) -> bool:
        """Whether requests need a key."""
        return self.bearer_token is not None or bool(self.api_keys)
