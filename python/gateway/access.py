"""A finished exchange's access-log values, below the ingress.

The access line (`logs.AccessLog`) is built when its batch is flushed, from the finished
`Exchange`: what builds it is handed down to the log as a value (`AccessValues`, made once per
gateway), so the log never calls back up into the ingress for it.
"""

from __future__ import annotations

from typing import Any

from gateway.exchange import Exchange
from gateway.redact import Redactor

__all__ = ["AccessValues"]


class AccessValues:
    """`values(ex, now)`: the access line's values, in `logs.ACCESS_FIELDS` order
    (`RequestFinished`'s fields), for `ex` finished at monotonic time `now` (the log is handed
    the bound method: as cheap to call as the ingress's own was). Typed values that cannot
    hold a secret (names from the config, codes, numbers) but for a request id the client
    chose: that one is redacted (SPEC §7: no key in any log line); an id the gateway made
    (`id_prefix` + its ticket) is not."""

    __slots__ = ("_prefix", "_redactor")

    def __init__(self, id_prefix: str, redactor: Redactor) -> None:
        self._prefix = id_prefix
        self._redactor = redactor

    def values(self, ex: Exchange, now: float) -> tuple[Any, ...]:
        d = ex.decision
        usage = ex.usage
        rid = ex.request_id
        prefix = self._prefix
        if not (rid.startswith(prefix) and rid[len(prefix) :].isdigit()):
            rid = self._redactor.redact(rid)
        return (
            rid,
            ex.pool,
            ex.instance,
            ex.priority_label,
            d.complexity if d else None,
            d.complexity_rule if d else None,
            round(ex.queue_ms, 1),
            round(ex.upstream_ms, 1),
            ex.status,
            ex.attempts,
            ex.error,
            round((now - ex.started) * 1000, 1),
            ex.source,
            # SPEC §9: operators bill and throttle by key — its name, never the key itself.
            ex.key_name,
            _count(usage.get("prompt_tokens")) if usage else None,
            _count(usage.get("completion_tokens")) if usage else None,
            ex.affinity if ex.affinity_key or ex.affinity_prefix is not None else None,
            ex.affinity_match,
            # SPEC §17: met, missed or shed (None: no objective).
            (ex.slo_result or "missed") if ex.has_objective else None,
        )


def _count(value: Any) -> int | None:
    """A token count from an upstream's `usage`, if it is one (a non-negative int)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
