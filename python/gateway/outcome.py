"""What serving one request from inside the process ended with, as a value.

A Batch API line (SPEC §14) goes through the same path as an HTTP request; the runner needs
"execute this request at low priority and tell me the typed outcome", not an HTTP answer to
parse back: `Answered` (what an upstream said, any status) or `Refused` (the gateway's own
domain error, its status and code from the one table in `responses.py`, and the wait it names).
`Executor` is the port a batch runner is handed (the gateway implements it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gateway.errors import GatewayError
from gateway.responses import answer_of, error_response

if TYPE_CHECKING:
    from gateway.auth import Tenant
    from gateway.exchange import Exchange
    from gateway.messages import Endpoint

__all__ = ["Answered", "Executor", "Outcome", "Refused"]


@dataclass(frozen=True, slots=True)
class Answered:
    """An upstream's answer, whatever its status (an upstream's 400 is an answer too)."""

    status: int
    body: bytes
    usage: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """The gateway's own refusal: `error` is the domain error (`QueueFull`, `RateLimited`,
    `Draining`, …); `retry_after_ms` the wait it names, None when it names none."""

    error: GatewayError
    status: int
    code: str
    retry_after_ms: int | None

    @classmethod
    def of(cls, error: GatewayError) -> Refused:
        status, code, _ = answer_of(error)
        wait = getattr(error, "retry_after_ms", None)
        return cls(error, status, code, wait if isinstance(wait, int) else None)

    @property
    def body(self) -> bytes:
        """The OpenAI-shaped error body an HTTP client would have been answered."""
        body = error_response(self.error).body
        assert isinstance(body, bytes)
        return body


Outcome = Answered | Refused


class Executor(Protocol):
    """Serves one request from inside the process, never streamed (SPEC §14)."""

    async def call(
        self,
        endpoint: Endpoint,
        raw: bytes,
        tenant: Tenant,
        *,
        request_id: str,
        priority: str = "low",
        seen: list[Exchange] | None = None,
        slo_ttft_ms: int | None = None,
    ) -> Outcome: ...
