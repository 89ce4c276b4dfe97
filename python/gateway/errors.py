"""The gateway's exception tree.

`GatewayError` and the scheduling errors are defined by the Rust core (so errors it raises
are real members of the tree); the rest subclass them here.

- `QueueFull(message, retry_after_ms)`: no queue room (SPEC §3 "Overflow").
- `NoHealthyInstance(message, retry_after_ms)`: nothing the request may use is up (SPEC §6).
- `UnknownTicket`: a ticket released twice or never known.
- `InvalidPoolConfig`: a scheduler value the core refuses.
- `ConfigError`: an invalid configuration file; `path` names the field.
"""

from __future__ import annotations

from gateway._core import (
    GatewayError,
    InvalidPoolConfig,
    NoHealthyInstance,
    QueueFull,
    UnknownTicket,
)

__all__ = [
    "ConfigError",
    "GatewayError",
    "InvalidPoolConfig",
    "NoHealthyInstance",
    "QueueFull",
    "UnknownTicket",
    "retry_after_ms",
]


class ConfigError(GatewayError):
    """A configuration that cannot be used; `path` names the field, e.g.
    `pools.light.instances[0].url`."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason


def retry_after_ms(exc: GatewayError) -> int:
    """The wait the core suggests before a retry, carried as the error's second argument."""
    value = exc.args[1] if len(exc.args) > 1 else 1000
    return int(value)
