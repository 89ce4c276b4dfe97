"""The operator's side of the HTTP surface (SPEC §7): liveness, readiness, `/admin/state`,
`/admin/reload`, `/metrics` and the dashboard. Everything here reads pool snapshots; nothing
reaches into a pool's core."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from aiohttp import web

from gateway import __version__
from gateway.auth import bearer
from gateway.dashboard import render as render_dashboard
from gateway.errors import InvalidConfig, Unauthorized
from gateway.pool import InstanceSnapshot, PoolSnapshot, now_ms
from gateway.redact import REDACTOR

if TYPE_CHECKING:
    from gateway.auth import KeyRing
    from gateway.cluster.node import ClusterNode
    from gateway.config import Config
    from gateway.metrics import Metrics
    from gateway.pool import Pool

__all__ = ["Admin", "Reloader", "Snapshots"]


class Snapshots(Protocol):
    """What the admin routes read of the running gateway (the `Gateway` is one)."""

    @property
    def draining(self) -> bool: ...

    @property
    def buffered_bytes(self) -> int: ...

    @property
    def keys(self) -> KeyRing: ...

    @property
    def metrics(self) -> Metrics: ...

    def config(self) -> Config: ...

    def pools(self) -> Mapping[str, Pool]: ...

    def batches(self) -> tuple[dict[str, int], list[dict[str, Any]]]: ...


class Reloader(Protocol):
    """Who re-reads the config (the `Server`, the composition root)."""

    async def reload(self, *, everywhere: bool = False) -> tuple[bool, str, list[str]]:
        """Applies the config file if entirely valid: (applied, message, notes). With
        `everywhere`, the other workers reload too (SPEC §12)."""
        ...


log = logging.getLogger("gateway")

_JSON = "application/json"


class Admin:
    """The admin routes of one gateway."""

    def __init__(
        self,
        snapshots: Snapshots,
        reloader: Reloader,
        *,
        worker: tuple[int, int] | None = None,
    ) -> None:
        self.snapshots = snapshots
        self.reloader = reloader
        #: SPEC §12: (which worker this is, of how many); None for a single process.
        self.worker = worker
        #: SPEC §13: this replica's cluster membership (set by `Server`; None: cluster off).
        self.cluster: ClusterNode | None = None

    def routes(self) -> dict[tuple[str, str], Any]:
        return {
            ("GET", "/livez"): self.livez,
            ("GET", "/healthz"): self.livez,
            ("GET", "/readyz"): self.readyz,
            ("GET", "/admin/state"): self.admin_state,
            ("GET", "/dashboard"): self.dashboard,
            ("POST", "/admin/reload"): self.admin_reload,
            ("GET", "/metrics"): self.metrics,
        }

    async def livez(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(body=b'{"status":"ok"}', content_type=_JSON)

    def ready(self) -> tuple[bool, str]:
        """SPEC §7: ready once config is loaded, at least one instance per pool is not
        ejected, and not draining."""
        if self.snapshots.draining:
            return False, "draining"
        if self.cluster is not None and not self.cluster.joined:
            return False, "no cluster lease yet (Redis not reached since start)"
        now = now_ms()
        for name, pool in self.snapshots.pools().items():
            if not pool.snapshot(now).ready:
                return False, f"every instance of pool {name} is ejected"
        return True, "ready"

    async def readyz(self, request: web.BaseRequest) -> web.StreamResponse:
        ok, reason = self.ready()
        doc = {"status": "ready" if ok else "not_ready", "reason": reason}
        if self.cluster is not None:
            doc["cluster"] = self.cluster.status  # SPEC §13: `cluster: degraded`
        body = orjson.dumps(doc)
        return web.Response(status=200 if ok else 503, body=body, content_type=_JSON)

    def state(self) -> dict[str, Any]:
        """The /admin/state document (SPEC §7 shape, plus counters)."""
        now = now_ms()
        # Monotonic core times become Unix times for people.
        offset = time.time() - now / 1000
        sched = self.snapshots.config().scheduler
        pools: dict[str, Any] = {}
        for name, pool in self.snapshots.pools().items():
            snap = pool.snapshot(now)
            pools[name] = _pool_doc(snap, offset) | {
                "queue_capacity": {"high": sched.high.capacity, "low": sched.low.capacity},
                # where saturated simple work goes (tier spill; None: nowhere)
                "spill_to": pool.spec.spill_to,
            }
        # SPEC §14: batches per status, and the ones being worked on with their progress.
        batches, running = self.snapshots.batches()
        return {
            "pools": pools,
            "batches": batches,
            "running_batches": running,
            "buffered_bytes": self.snapshots.buffered_bytes,
            "draining": self.snapshots.draining,
            **({"cluster": self.cluster.state()} if self.cluster is not None else {}),
            # SPEC §12: which worker answered, of how many (absent for a single process).
            **(
                {"worker": self.worker[0], "workers": self.worker[1]}
                if self.worker is not None
                else {}
            ),
            "version": __version__,
            "now": round(time.time(), 3),
        }

    async def admin_state(self, request: web.BaseRequest) -> web.StreamResponse:
        self.snapshots.keys.authenticate_admin(request.headers)
        return web.Response(body=orjson.dumps(self.state()), content_type=_JSON)

    async def admin_reload(self, request: web.BaseRequest) -> web.StreamResponse:
        self.snapshots.keys.authenticate_admin(request.headers)
        # SPEC §12: a reload applies to all workers.
        ok, message, notes = await self.reloader.reload(everywhere=True)
        if not ok:
            raise InvalidConfig(f"Config not reloaded: {message}")
        body = orjson.dumps({"status": "reloaded", "notes": notes})
        return web.Response(body=body, content_type=_JSON)

    def authenticate_scrape(self, headers: Mapping[str, str]) -> None:
        """SPEC §9: with `auth` on, `/metrics` (instance names, load, per-key token counts)
        answers only `Authorization: Bearer <auth.metrics_key>` or the admin key, unless
        `auth.public_metrics: true` opens it on purpose; without `auth` it is open. Raises
        `Unauthorized` (401, OpenAI-shaped, no metric text)."""
        auth = self.snapshots.config().auth
        if auth is None or auth.public_metrics:
            return
        presented = bearer(headers)
        if presented is not None:
            # Both compared, whatever matched: constant time in which key it was.
            ok = False
            for secret in (auth.metrics_key, auth.admin_key):
                if secret and hmac.compare_digest(secret.encode(), presented):
                    ok = True
            if ok:
                return
        raise Unauthorized(
            "/metrics needs the metrics key or the admin key: send 'Authorization: Bearer <key>'."
        )

    async def metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        self.authenticate_scrape(request.headers)
        # OpenMetrics (with exemplars, if on) when the scraper asks for it, else classic text.
        body, content_type = self.snapshots.metrics.exposition(request.headers.get("Accept"))
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp

    async def dashboard(self, request: web.BaseRequest) -> web.StreamResponse:
        # The page itself holds no data; it asks /admin/state (with the admin key, when
        # auth is on) from the browser.
        return web.Response(
            body=render_dashboard(),
            content_type="text/html",
            charset="utf-8",
            headers={"Cache-Control": "no-store"},
        )


def _unix(ms: int | None, offset: float) -> float | None:
    return None if ms is None else round(ms / 1000 + offset, 3)


def _instance_doc(i: InstanceSnapshot, offset: float) -> dict[str, Any]:
    last = i.last_error
    return {
        "name": i.name,
        "state": i.state,
        "in_flight": i.in_flight,
        "max_concurrency": i.max_concurrency,
        "consecutive_failures": i.consecutive_failures,
        "ejected_until": _unix(i.ejected_until_ms, offset),
        "cooling_until": _unix(i.cooling_until_ms, offset),
        "next_try_at": _unix(i.next_try_ms, offset),
        "ejections": i.ejections,
        "removed": i.removed,
        "last_error": REDACTOR.redact(last[1]) if last else None,
        "last_error_at": round(last[0], 3) if last else None,
        # SPEC §13: this replica's leased slots (cluster mode only).
        **({"lease": i.lease} if i.lease is not None else {}),
        # SPEC §15 (affinity pools): prompt blocks remembered as sent to it, and their bound.
        **(
            {"prefix_index": {"blocks": i.prefix_index[0], "capacity": i.prefix_index[1]}}
            if i.prefix_index is not None
            else {}
        ),
        # SPEC §17: the cap in force (an adaptive instance's current limit) and the latency
        # model's view: p90 predictions for a typical request now, their mean absolute
        # errors, the share of TTFT samples within the p90 band, and whether it is calibrated.
        "concurrency_limit": i.concurrency_limit,
        "adaptive": i.adaptive,
        "prediction": {
            "ttft_ms": round(i.predicted_ttft_ms, 1),
            "tpot_ms": round(i.predicted_tpot_ms, 2),
            "ttft_error_ms": round(i.ttft_mae_ms, 1),
            "tpot_error_ms": round(i.tpot_mae_ms, 2),
            "ttft_coverage": round(i.ttft_coverage, 3),
            "samples": round(i.samples, 1),
            "calibrated": i.calibrated,
        },
        # SPEC §15: what a vLLM backend last reported of its own load (null: not read).
        "backend": (
            {"waiting": i.backend.waiting, "gpu_cache_usage": i.backend.gpu_cache_usage}
            if i.backend is not None
            else None
        ),
    }


def _goodput(snap: PoolSnapshot) -> float | None:
    offered = snap.slo_met + snap.slo_missed + snap.slo_shed
    return round(snap.slo_met / offered, 4) if offered else None


def _pool_doc(snap: PoolSnapshot, offset: float) -> dict[str, Any]:
    return {
        "queued": {"high": snap.queued_high, "low": snap.queued_low},
        "in_flight": snap.in_flight,
        "granted": {"high": snap.granted_high, "low": snap.granted_low},
        "forced_low_grants": snap.forced_low,
        "expired": snap.expired,
        "cancelled": snap.cancelled,
        "rejected_full": snap.rejected_full,
        "drain_rate_per_s": round(snap.drain_rate_per_s, 3),
        "fallback": snap.fallback,
        "balancer": snap.balancer,
        # SPEC §15: grants to their key's first-choice instance (hits) or a later one (spills).
        "affinity": {"hits": snap.affinity_hits, "spills": snap.affinity_spills},
        # SPEC §17 goodput (this process): requests with an objective by verdict, and
        # met / all of them (null: none yet).
        "slo": {
            "met": snap.slo_met,
            "missed": snap.slo_missed,
            "shed": snap.slo_shed,
            "goodput": _goodput(snap),
        },
        "instances": [_instance_doc(i, offset) for i in snap.instances],
    }
