"""What the Batch API is handed by the gateway (its ports), not the gateway itself.

A batch runner needs "execute this request at low priority and tell me the typed outcome"
(`Executor`), the current key ring (it changes on reload), the current settings (config and
router, changed in place by a reload) and the counters it feeds. The composition root wires
them; nothing here imports the ingress.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.auth import KeyRing
    from gateway.config import Config
    from gateway.metrics import Metrics
    from gateway.outcome import Executor
    from gateway.router import Router

__all__ = ["BatchPorts", "Settings"]


class Settings(Protocol):
    """The running settings (the gateway's `Runtime` is one): read anew at each use."""

    @property
    def config(self) -> Config: ...

    @property
    def router(self) -> Router: ...


@dataclass(frozen=True, slots=True)
class BatchPorts:
    executor: Executor
    keys: Callable[[], KeyRing]
    settings: Settings
    metrics: Metrics
