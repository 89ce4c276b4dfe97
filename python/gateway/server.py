"""One gateway server's whole life: the one place a gateway is started and stopped.

uvicorn's `Server(config)` is the model: everything that lives as long as the server — the
HTTP runner and its listening site, the prober, the janitor that closes drained upstreams, the
config watcher, signal handlers — is owned here, so the CLI, the demo, the tests and the
benchmarks run exactly the same server, and a background task or a reload step can never exist
in one of them only.

    server = Server(config, config_path="gateway.yaml", port=0)
    await server.start()          # listening; server.url is known
    ...
    await server.shutdown()       # SPEC §7 drain, then everything stops

`serve()` is `start()`, wait for SIGTERM/SIGINT (SIGHUP reloads), `shutdown()` with the
config's `shutdown.drain_delay_ms` (a second signal skips the delay, a third ends the drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from gateway.admin import Admin
from gateway.app import Gateway
from gateway.auth import KeyRing
from gateway.batch.relay import BatchRelay
from gateway.clock import LOOP_CLOCK, Clock
from gateway.config import Config, load_config
from gateway.errors import ConfigError
from gateway.health import Prober
from gateway.redact import REDACTOR, secrets_of
from gateway.topology import Topology, WorkerLink
from gateway.workers import TICK_S

if TYPE_CHECKING:
    from gateway.cluster.node import ClusterNode

__all__ = ["ListenError", "Server"]

log = logging.getLogger("gateway")

_JANITOR_INTERVAL_S = 5.0
_WATCH_INTERVAL_S = 1.0
_METRICS_FLUSH_TICKS = 100  # every second at the 10 ms tick


class ListenError(Exception):
    """The server could not listen on its address (a port taken, an address not here)."""


class Server:
    """The gateway of one config, listening on one address."""

    def __init__(
        self,
        config: Config,
        *,
        config_path: str | None = None,
        host: str | None = None,
        port: int | None = None,
        watch: bool = False,
        backlog: int = 4096,
        topology: Topology | None = None,
        clock: Clock = LOOP_CLOCK,
    ) -> None:
        # The composition root: the topology (one process, or one of N workers: SPEC §12;
        # either of them a cluster member: SPEC §13) is decided here, from what the worker was
        # handed at its start and the config, and passed down; so is the clock the pools and
        # the heartbeat read (the real one; a test may hand down its own).
        self.topology = topology if topology is not None else Topology.single()
        if config.cluster is not None:
            self.topology = Topology.cluster(config.cluster, self.topology.link)
        self.clock = clock
        self.gateway = Gateway(config, config_path=config_path, topology=self.topology, clock=clock)
        self.host = host or config.listen.host
        self.port = port if port is not None else config.listen.port
        self.watch = watch
        self.backlog = backlog
        self.prober = Prober(self.gateway.runtime)
        # SPEC §13 cluster mode; the module (and Redis's client) is imported only when the
        # config has a `cluster:` section.
        self.cluster: ClusterNode | None = None
        settings = self.topology.cluster_settings
        if settings is not None:
            from gateway.cluster.node import ClusterNode

            gw = self.gateway
            # SPEC §12 × §13: with workers, one member per host talks to Redis (the seat).
            self.cluster = ClusterNode(
                gw.runtime, gw.keys, gw.metrics.registry, settings, self.topology.seat()
            )
        self._runner: web.ServerRunner | None = None
        self._site: web.TCPSite | None = None
        self._tasks: set[asyncio.Task[object]] = set()
        self._stopped = False
        # SPEC §7: the signals after the first — the 2nd skips the drain delay, the 3rd ends
        # the drain (what is unfinished is answered 503 `draining` or a stream error event).
        self._signals = 0
        self._skip_delay = asyncio.Event()
        self._cut_drain = asyncio.Event()
        # SPEC §12: this server is one of several workers (None: it is the whole gateway).
        self.link: WorkerLink | None = self.topology.link
        # The admin routes get what they read and who reloads, not the gateway to walk.
        worker = (self.link.slot, self.link.workers) if self.link is not None else None
        self.admin = Admin(self.gateway, self, worker=worker)
        self.admin.cluster = self.cluster
        self.gateway.mount(self.admin)

    @property
    def url(self) -> str:
        """`http://host:port` once started (the port the OS chose when 0 was asked)."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Listens and starts the background work; returns once requests are served."""
        if self.cluster is not None:
            # SPEC §13: a first lease before the first request (pools admit nothing without).
            await self.cluster.start()
        runner = web.ServerRunner(self.gateway.server(), handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(
            runner,
            self.host,
            self.port,
            backlog=self.backlog,
            reuse_address=True,
            reuse_port=self.link is not None,  # SPEC §12: every worker on the one port
        )
        try:
            await site.start()
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise ListenError(f"cannot listen on {self.host}:{self.port}: {why}") from exc
        self._site = site
        if runner.addresses:
            self.port = int(runner.addresses[0][1])
        batch_home = self.link is None or self.link.batch_home
        if self.link is not None and self.link.batch_socket:
            # SPEC §12 × §14: worker 0 serves the Batch API; the others relay to it.
            if batch_home:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.link.batch_socket)  # left by the worker this one replaces
                await web.UnixSite(runner, self.link.batch_socket).start()
            else:
                self.gateway.batch_relay = BatchRelay(self.link.batch_socket)
        self.prober.start()
        if self.link is not None:
            self.link.on_wake = self._kick
            self.link.start(asyncio.get_running_loop())
            self._spawn(self._worker_tick(self.link), "worker-tick")
        # SPEC §14: unfinished batches resume (the store opens later if it does not exist yet).
        if batch_home:
            await self.gateway.batch.start()
        self._spawn(self._janitor(), "janitor")
        if self.cluster is not None:
            self._spawn(self.cluster.run(), "cluster")
        if self.watch and self.gateway.config_path is not None:
            self._spawn(self._watch(self.gateway.config_path), "watcher")

    def _spawn(self, coro: object, name: str) -> asyncio.Task[object]:
        task: asyncio.Task[object] = asyncio.get_running_loop().create_task(coro, name=name)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def reload_soon(self) -> None:
        """SPEC §8: re-read the config file in the background (SIGHUP, --watch)."""
        self._spawn(self.reload(), "reload")

    async def reload(self, *, everywhere: bool = False) -> tuple[bool, str, list[str]]:
        """Re-reads the config file; applies it only if it is entirely valid (SPEC §8).
        Returns (applied, message, notes); on failure the running config stays. With
        `everywhere` (a reload asked over HTTP), the other workers reload too (SPEC §12)."""
        gw = self.gateway
        if gw.config_path is None:
            return False, "the gateway was not started from a config file", []
        try:
            config = await asyncio.to_thread(load_config, gw.config_path)
        except ConfigError as exc:
            gw.metrics.reloaded(False)
            log.error("config reload failed", extra={"fields": {"reason": str(exc)}})
            return False, str(exc), []
        if (config.cluster is None) != (self.cluster is None):
            gw.metrics.reloaded(False)
            return False, "turning cluster mode on or off needs a restart", []
        REDACTOR.add(secrets_of(config))
        try:
            notes = gw.runtime.reload(config)
        except ConfigError as exc:  # refused whole (no room for a new pool): nothing changed
            gw.metrics.reloaded(False)
            log.error("config reload failed", extra={"fields": {"reason": str(exc)}})
            return False, str(exc), []
        # The previous ring: unchanged keys keep their RPM/TPM buckets and tenant indexes
        # (queued requests carry them).
        gw.keys = KeyRing(config, previous=gw.keys)
        # SPEC §9: per-key series only for the configured names; exemplars only if asked for.
        gw.metrics.keep_keys(t.name for t in gw.keys.tenants)
        gw.metrics.exemplars = config.telemetry.exemplars
        if self.cluster is not None:
            self.cluster.adopt_keys(gw.keys)  # SPEC §13 cluster-wide limits, before any request
            assert config.cluster is not None  # both on: checked above
            fresh = Topology.cluster(config.cluster, self.link).cluster_settings
            if fresh != self.topology.cluster_settings:
                notes.append("cluster settings apply after a restart")
        gw.metrics.reloaded(True)
        await gw.runtime.collect()
        log.info(
            "config reloaded",
            extra={"fields": {"pools": ",".join(config.pools), "notes": "; ".join(notes) or None}},
        )
        if everywhere and self.link is not None:
            self.link.reloaded()  # SPEC §12: a reload applies to all workers
        return True, "reloaded", notes

    async def serve(self, on_listening: Callable[[Server], None] | None = None) -> None:
        """Runs until SIGTERM or SIGINT, then drains and stops; SIGHUP reloads."""
        await self.start()
        if on_listening is not None:
            on_listening(self)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def signalled() -> None:
            self._signals += 1
            if self._signals == 1:
                stop.set()
            elif self._signals == 2:
                log.info("second signal: the drain delay is skipped")
                self._skip_delay.set()
            else:
                log.warning("third signal: the drain ends now")
                self._cut_drain.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signalled)
        loop.add_signal_handler(signal.SIGHUP, self.reload_soon)
        try:
            await stop.wait()
            # The handlers stay through the drain: a second signal hurries it (SPEC §7).
            delay_ms = self.gateway.runtime.config.shutdown.drain_delay_ms
            await self.shutdown(delay_ms=delay_ms)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            await self.shutdown()  # cancelled before the drain began: stop all the same

    async def shutdown(self, *, drain: bool = True, delay_ms: int = 0) -> None:
        """SPEC §7 "SIGTERM drains", in steps: (1) /readyz turns 503 at once while the
        listener keeps accepting and serving for `delay_ms` (load balancers and Kubernetes
        endpoints take seconds to stop sending; a second signal skips it — `serve()` passes
        `shutdown.drain_delay_ms`, an in-process caller 0); (2) the listener closes and
        in-flight and queued requests finish within the drain deadline (a third signal ends
        it), the rest are answered 503 or get a stream error event; (3) background work stops;
        (4) connections close and upstream pools are released. `drain=False` skips (1) and
        (2): whatever is still running is cancelled within a second (tests tearing down).
        Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        if drain and self._site is not None:
            # SPEC §7: first /readyz turns 503 while the listener keeps accepting and serving
            # for shutdown.drain_delay_ms, then new connections stop.
            self.gateway.draining = True
            if delay_ms > 0 and not self._skip_delay.is_set():
                log.info(
                    "draining: not ready, still serving", extra={"fields": {"delay_ms": delay_ms}}
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._skip_delay.wait(), delay_ms / 1000)
            drain_ms = self.gateway.runtime.config.shutdown.drain_timeout_ms
            log.info("draining", extra={"fields": {"deadline_ms": drain_ms}})
            # Batch lines already running get the same deadline; no new line starts.
            await asyncio.gather(
                self.gateway.drain(self._site, self._cut_drain),
                self.gateway.batch.drain(drain_ms / 1000),
            )
        # Batch results in hand are committed; unfinished lines run after the next start.
        await self.gateway.batch.stop()
        await self.prober.stop()
        if self.link is not None:
            self.link.stop(asyncio.get_running_loop())
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.cluster is not None:
            await self.cluster.close()  # gives the leases back at once (SPEC §13)
        if self._runner is not None:
            await self._runner.cleanup()
        self.gateway.metrics.flush()  # the last counts of this worker stay in the totals
        await self.gateway.close()
        log.info("stopped")

    def _kick(self) -> None:
        """Another worker freed a unit this one's waiters may take: every pool looks."""
        for pool in self.gateway.runtime.pools.values():
            pool.tick()

    async def _worker_tick(self, worker: WorkerLink) -> None:
        """SPEC §12: the heartbeat the supervisor watches for hangs, and a look at the shared
        state every tick — the net under a wake-up that raced (bounded to one tick)."""
        ticks = 0
        now_ms = self.clock.now_ms
        while True:
            worker.heartbeat(now_ms())
            try:
                if self.cluster is not None:
                    self.cluster.follow()  # SPEC §12 × §13: the host member's lease, applied
                self._kick()
                ticks += 1
                if ticks % _METRICS_FLUSH_TICKS == 0:
                    self.gateway.metrics.flush()  # the others' scrapes see this worker's counts
            except Exception:
                log.exception("worker tick failed")
            await asyncio.sleep(TICK_S)

    async def _janitor(self) -> None:
        """Closes the connection pools of instances and pools that drained after a reload."""
        while True:
            await asyncio.sleep(_JANITOR_INTERVAL_S)
            try:
                await self.gateway.runtime.collect()
            except Exception:
                log.exception("closing drained upstreams failed")

    async def _watch(self, path: str) -> None:
        """Polls the config file's identity (mtime, size, inode); a change triggers a reload."""

        def stamp() -> tuple[int, int, int] | None:
            try:
                st = os.stat(path)
            except OSError:
                return None
            return (st.st_mtime_ns, st.st_size, st.st_ino)

        last = stamp()
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            now = stamp()
            if now is not None and now != last:
                last = now
                self.reload_soon()
