"""The server's settings: the engine's config plus what only the HTTP layer needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.config import EngineConfig

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


@dataclass
class ServiceConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None  # None: no authentication
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413
    shutdown_timeout: float = 30.0  # SIGTERM: seconds in-flight requests get to finish
    log_level: str = "info"
