"""A finished exchange's access-log values, below the ingress.

The access line (`logs.AccessLog`) is built as a request finishes, from the finished
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
    (`RequestFinished`'s fields), for `ex` finished at monotonic time `now` (a
    `logs.AccessSource`; the log builds the same line from the exchange's fields in one call
    where it can, `gateway._core.LineBuffer.access`). Typed values that cannot
    hold a secret (names from the config, codes, numbers) but for a request id the client
    chose: that one is redacted (SPEC §7: no key in any log line); an id the gateway made
    (`id_prefix` + its ticket) is not."""

    __slots__ = ("_redactor", "prefix")

    def __init__(self, id_prefix: str, redactor: Redactor) -> None:
        #: The prefix of the request ids the gateway makes (`logs.AccessSource`).
        self.prefix = id_prefix
        self._redactor = redactor

    def values(self, ex: Exchange, now: float) -> tuple[Any, ...]:
        # Exchange's properties (`usage`, `priority_label`, `has_objective`) read inline: this
        # runs once per request, on the loop, where each Python call costs (issue 25).
        d = ex.decision
        attempt = ex.attempt
        usage = attempt.usage if attempt is not None else None
        rid = ex.request_id
        prefix = self.prefix
        if not (rid.startswith(prefix) and rid[len(prefix) :].isdigit()):
            rid = self._redactor.redact(rid)
        if usage:
            prompt = usage.get("prompt_tokens")
            completion = usage.get("completion_tokens")
            prompt = prompt if prompt.__class__ is int and prompt >= 0 else None
            completion = completion if completion.__class__ is int and completion >= 0 else None
        else:
            prompt = completion = None
        complexity: str | None = None
        rule: str | None = None
        priority: str | None = None
        if d is not None:
            complexity, rule = d.complexity, d.complexity_rule
            priority = (ex.waited_as or d.priority).label
        return (
            rid,
            ex.pool,
            ex.instance,
            priority,
            complexity,
            rule,
            round(ex.queue_ms, 1),
            round(ex.upstream_ms, 1),
            ex.status,
            ex.attempts,
            ex.error,
            round((now - ex.started) * 1000, 1),
            ex.source,
            # SPEC §9: operators bill and throttle by key — its name, never the key itself.
            ex.key_name,
            prompt,
            completion,
            ex.affinity if ex.affinity_key or ex.affinity_prefix is not None else None,
            ex.affinity_match,
            # SPEC §17: met, missed or shed (None: no objective).
            (ex.slo_result or "missed")
            if ex.slo_ttft_ms is not None or ex.slo_tpot_ms is not None
            else None,
        )
