"""The gateway's exception tree: every error the gateway can answer is a class here.

`GatewayError` and the scheduling errors are defined by the Rust core (so errors it raises are
real members of the tree); the rest subclass them here. Code that finds a problem raises the
domain error with what it knows (typed attributes, never data in `args`); `responses.py` keeps
the one table from class to HTTP answer (status, code, type, Retry-After), the way aiohttp
keeps its HTTP exceptions in one module.

- `QueueFull`: no queue room (SPEC §3 "Overflow"); `retry_after_ms` attribute.
- `NoHealthyInstance`: nothing the request may use is up (SPEC §6); `retry_after_ms`.
  `UpstreamUnavailable` is one: the upstreams themselves asked for a pause (503 Retry-After).
- `UnknownTicket`, `InvalidPoolConfig`: the core's own complaints.
- `ConfigError`: an invalid configuration file; `path` names the field.
- `RequestError` and its subclasses: answered to the client as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from gateway._core import (
    GatewayError,
    InvalidPoolConfig,
    NoHealthyInstance,
    QueueFull,
    UnknownTicket,
)

__all__ = [
    "DEFAULT_RETRY_AFTER_MS",
    "ConfigError",
    "Draining",
    "GatewayError",
    "InternalError",
    "InvalidConfig",
    "InvalidPoolConfig",
    "InvalidRequest",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoHealthyInstance",
    "NotFound",
    "Overloaded",
    "QueueFull",
    "QueueTimeout",
    "RateLimited",
    "RequestError",
    "RequestTimeout",
    "RequestTooLarge",
    "Restarting",
    "SloUnattainable",
    "Unauthorized",
    "UnknownTicket",
    "UpstreamFailed",
    "UpstreamRateLimited",
    "UpstreamTimedOut",
    "UpstreamUnavailable",
    "retry_after_ms",
    "with_retry_after",
]


class ConfigError(GatewayError):
    """A configuration that cannot be used; `path` names the field, e.g.
    `pools.light.instances[0].url`.

    `errors` lists every problem found in the file (SPEC §18: all of them in one run): a lone
    error's list is itself; one made by `combine` has no `path` and its message lists them."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason
        self.errors: list[ConfigError] = [self]

    @classmethod
    def combine(cls, errors: Sequence[ConfigError]) -> ConfigError:
        """One error standing for all of `errors` (at least one): the error itself when alone,
        else one whose message is `N errors:` and each error on its own line."""
        if len(errors) == 1:
            return errors[0]
        lines = "".join(f"\n  {e}" for e in errors)
        combined = cls("", f"{len(errors)} errors:{lines}")
        combined.errors = list(errors)
        return combined


class RequestError(GatewayError):
    """An error answered to the client as it is: `message` is for the client (never a secret,
    never the client's own input echoed), `param` names the offending field, `retry_after_ms`
    becomes `Retry-After`, `headers` are added to the answer."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after_ms: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_ms = retry_after_ms
        self.headers = dict(headers or {})


class InvalidRequest(RequestError):
    """Malformed JSON, missing or invalid fields, bad header values."""


class Unauthorized(RequestError):
    """Auth is on and the key is missing or unknown."""


class ModelNotFound(RequestError):
    """An alias this gateway (or this key) does not serve."""


class NotFound(RequestError):
    """No such route."""


class MethodNotAllowed(RequestError):
    """The route exists with other methods (named in `Allow`)."""


class RequestTimeout(RequestError):
    """The request body arrived too slowly (SPEC §7 slowloris bound)."""


class RequestTooLarge(RequestError):
    """A body over `max_body_bytes`."""


class RateLimited(RequestError):
    """A per-key RPM/TPM limit (SPEC §4 keys); carries Retry-After and the limit headers."""


class QueueTimeout(RequestError):
    """SPEC §3 "Deadlines": waited longer than the class's `max_wait_ms`."""


class Overloaded(RequestError):
    """SPEC §16: the gateway already holds `limits.max_buffered_bytes` of requests."""


class Draining(RequestError):
    """SPEC §7: the gateway is shutting down (or its drain deadline passed)."""


class SloUnattainable(RequestError):
    """SPEC §17: no instance the request may use is predicted to meet its latency objective
    and `scheduler.shed_unattainable` is on; `retry_after_ms` says when it may be."""


class Restarting(RequestError):
    """SPEC §12: the worker that serves this (the Batch API's, worker 0) is being replaced."""


class InvalidConfig(RequestError):
    """`POST /admin/reload` of a config that does not validate; the old one stays."""


class UpstreamFailed(RequestError):
    """Every attempt failed (SPEC §6), or the upstream rejected the gateway's own key."""


class UpstreamRateLimited(RateLimited):
    """SPEC §7: the upstream's own quota (e.g. OpenAI's 429) left nothing to try; 429
    `rate_limited` with the computed Retry-After, so SDKs back off."""


class UpstreamUnavailable(NoHealthyInstance):
    """SPEC §7: the upstreams answered 503 with Retry-After (or are cooling from it) and nothing
    else is left; answered like `NoHealthyInstance`, with the computed Retry-After."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class UpstreamTimedOut(RequestError):
    """Every attempt failed and the last one timed out."""


class InternalError(RequestError):
    """A bug: answered without details, logged with them."""


#: The Retry-After given when nothing better is known (drain, overload), in ms.
DEFAULT_RETRY_AFTER_MS = 1000


E = TypeVar("E", bound=GatewayError)


def with_retry_after(exc: E, retry_after_ms: int) -> E:
    """`exc` carrying `retry_after_ms`, as the core's `QueueFull` and `NoHealthyInstance` do."""
    exc.retry_after_ms = retry_after_ms  # type: ignore[attr-defined]
    return exc


def retry_after_ms(exc: GatewayError) -> int:
    """The wait an error suggests before a retry, in ms (1 s when it says nothing)."""
    value = getattr(exc, "retry_after_ms", None)
    return value if isinstance(value, int) else DEFAULT_RETRY_AFTER_MS
