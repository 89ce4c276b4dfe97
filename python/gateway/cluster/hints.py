"""Shared ejection hints (SPEC §13: "An ejection seen by one replica is shared as a hint; each
replica still decides with its own probes").

Detection stays local (Envoy's outlier detection and Linkerd's failure accrual are per proxy
too). When this replica ejects an instance, the next lease sync of its pool stores a hint with
the ejection's remaining time as TTL; the other replicas' syncs return it. The rule a replica
applies to a hint from another: **never eject on a remote signal alone**. A hint about an
instance this replica still finds healthy starts up to `health.failure_threshold` immediate
probes (spaced by `_CONFIRM_GAP_S`, stopping at the first pass); each failed probe is an
ordinary local failure (SPEC §6 "a failed probe counts as a failure"), so an instance that is
down for everyone is ejected here within a few hundred milliseconds instead of after as many
failed requests, while a reporter that is merely cut off from it (a partition) ejects nobody
else. With probing off (`health.probe.enabled: false`) hints are only shown.

Detection reads the pool snapshot's ejection counters in the sync loop — never an event
listener, which would make every request build its event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.pool import PoolSnapshot

__all__ = ["HintTracker"]

# A hint lives at least this long, whatever the local ejection time left.
_MIN_TTL_MS = 1000
CONFIRM_GAP_S = 0.1


@dataclass(slots=True)
class HintTracker:
    """Hints published and received, across pools."""

    #: (pool, instance) → ejections counted at the last look.
    _ejections: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (pool, instance, reporter) → the hint's end as received (remaining ms + receive time).
    _seen: dict[tuple[str, str, str], int] = field(default_factory=dict)
    published: int = 0
    received: int = 0
    #: The hints of other replicas in force at the last sync: (pool, instance, reporter, ms).
    active: list[tuple[str, str, str, int]] = field(default_factory=list)
    #: pool → hints whose sync failed, sent with the next one.
    _unsent: dict[str, dict[str, int]] = field(default_factory=dict)

    def unsent(self, pool: str, hints: dict[str, int]) -> None:
        """The sync carrying `hints` failed: they go with the next one."""
        self._unsent.setdefault(pool, {}).update(hints)
        self.published -= len(hints)

    def outgoing(self, pool: str, snap: PoolSnapshot) -> dict[str, int]:
        """Instances this replica ejected since the last look → hint TTL in ms."""
        out: dict[str, int] = self._unsent.pop(pool, {})
        for inst in snap.instances:
            key = (pool, inst.name)
            before = self._ejections.get(key)
            self._ejections[key] = inst.ejections
            if before is None or inst.ejections <= before or inst.ejected_until_ms is None:
                continue  # first look (not news), or no new ejection
            out[inst.name] = max(_MIN_TTL_MS, inst.ejected_until_ms - snap.now_ms)
        self.published += len(out)
        return out

    def incoming(self, pool: str, hints: Any, now: int) -> list[str]:
        """The other replicas' hints of one pool's answer → the instances to confirm (each
        (instance, reporter, ejection) once)."""
        self.active = [h for h in self.active if h[0] != pool]
        fresh: list[str] = []
        if not isinstance(hints, list):
            return fresh  # an empty Lua table comes back as {}
        for name, reporter, remaining in hints:
            self.active.append((pool, str(name), str(reporter), int(remaining)))
            key = (pool, str(name), str(reporter))
            until = now + int(remaining)
            before = self._seen.get(key)
            # The same hint read again ends at the same moment (± the sync's latency).
            if before is not None and abs(before - until) < _MIN_TTL_MS:
                continue
            self._seen[key] = until
            self.received += 1
            fresh.append(str(name))
        self._seen = {k: v for k, v in self._seen.items() if v > now}
        return fresh
