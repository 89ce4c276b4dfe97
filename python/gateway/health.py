"""Active health probes (SPEC §6): zero-token `GET probe.path` on every instance, off the
request path. A failed probe counts as a failure; a passing one only lets an ejected instance
into half-open — the core decides what each result means.

The prober must outlive anything an upstream sends: half-open needs a passing probe, so a
prober that died would keep every ejected instance out for good. Each probe's own failure
(whatever it raises) is that probe's failed result; a round that breaks is logged and the
next round runs on time. The task runs whether probing is on or off, so a reload that turns
probes on takes effect at the next interval.

SPEC §15 "Backend load": at the same interval (probes on or off) the prober also reads each
`provider: vllm` instance's `/metrics` and hands its queue and KV-cache usage to the pool
(gateway.backend_load).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway import backend_load
from gateway.events import ProbeFinished
from gateway.runtime import Runtime

__all__ = ["Prober"]

log = logging.getLogger("gateway.health")

_IDLE_CHECK_S = 1.0  # how soon a reload that enables probing is noticed


class Prober:
    """Probes every instance of a runtime every `probe.interval_ms`."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="prober")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        loads_at = float("-inf")
        while True:
            probe = self.runtime.config.health.probe
            interval = probe.interval_ms / 1000
            if loop.time() - loads_at >= interval:
                loads_at = loop.time()
                try:
                    await self.read_backend_loads()
                except Exception:
                    log.exception("backend load round failed")
            if not probe.enabled:
                await asyncio.sleep(min(_IDLE_CHECK_S, interval))
                continue
            try:
                await self.probe_all()
            except Exception:
                log.exception("probe round failed")
            await asyncio.sleep(interval)

    async def read_backend_loads(self) -> None:
        """SPEC §15: every vLLM instance's own queue and KV-cache usage, read at once, each
        bounded by the probe timeout; an unreadable one has its reading cleared."""
        timeout_s = self.runtime.config.health.probe.timeout_ms / 1000
        jobs = [
            (pool, idx, up)
            for pool in self.runtime.pools.values()
            for idx, up in pool.live_upstreams()
            if up.provider == "vllm"
        ]
        if not jobs:
            return
        readings = await asyncio.gather(
            *(backend_load.read(up, timeout_s) for _, _, up in jobs), return_exceptions=True
        )
        for (pool, idx, up), load in zip(jobs, readings, strict=True):
            pool.set_backend_load(idx, up, None if isinstance(load, BaseException) else load)

    async def probe_all(self) -> None:
        """One round: every instance at once, each bounded by the probe timeout."""
        probe = self.runtime.config.health.probe
        jobs = []
        for pool in self.runtime.pools.values():
            for idx, up in pool.live_upstreams():
                if not pool.claim_probe(idx, probe.interval_ms):
                    continue  # SPEC §12: another worker probes it this interval
                jobs.append((pool, idx, up.name, up.probe(probe.path, probe.timeout_ms / 1000)))
        results = await asyncio.gather(*(job[3] for job in jobs), return_exceptions=True)
        for (pool, idx, name, _), ok in zip(jobs, results, strict=True):
            passed = ok is True
            if isinstance(ok, BaseException):
                log.warning(
                    "probe raised",
                    extra={
                        "fields": {"pool": pool.name, "instance": name, "error": type(ok).__name__}
                    },
                )
            events = self.runtime.events
            if events:
                events.publish(ProbeFinished(pool.name, name, passed))
            # State changes this causes are logged by the scheduler's transition hook.
            try:
                pool.record_probe(idx, passed)
            except Exception:  # e.g. the instance went away in a reload meanwhile
                log.exception("recording a probe failed")
            if not passed:
                log.info("probe failed", extra={"fields": {"pool": pool.name, "instance": name}})

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
